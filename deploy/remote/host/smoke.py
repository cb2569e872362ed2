"""`smoke.run`: the DDTree payload's smoke test on one GPU of this host, with the active release's venv and plugin.

It runs `{venv}/bin/python -m sglang_ddtree.smoke` (the plugin's own host-side module: tiny seeded model of the
requested family, transient SGLang servers started with `systemd-run` as the service user, the lossless statistic,
the server's reports, an unsupported request) under the op's deadline, and always stops every transient unit it
started (their names share a per-run prefix, and each unit carries RuntimeMaxSec as a second guard). The servers
change nothing the deploy manages and the op takes no host lock; root runs the venv's interpreter only after the
venv passed the trust check (nothing in it writable by another user).
"""
import json
import os
import re
import shutil
import tempfile

from . import contract, proc
from . import venv as venvmod
from .fsutil import Unsafe
from .registry import Failure, op

MODES = contract.SMOKE_MODES
FAMILIES = ("hybrid", "dense")
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")
PREFIX_RE = re.compile(r"ddtree-smoke-[0-9a-f]{8,32}\Z")
REPORT_MAX = 8 << 20  # a report larger than this is not read (the control side would refuse it anyway)


def smoke_argv(python, a, report, prefix, runtime_max):
    """The smoke module's command line (the control side shows the same fields in its plan)."""
    argv = [python, "-m", "sglang_ddtree.smoke", "--gpu", str(a["gpu"]), "--mode", a["mode"],
            "--family", a["family"], "--budget", str(a["budget"]), "--prompts", str(a["prompts"]),
            "--tokens", str(a["tokens"]), "--launcher", "systemd-run", "--unit-prefix", prefix,
            "--runtime-max", str(int(runtime_max)), "--json", report]
    if a.get("user"):
        argv += ["--user", a["user"]]
    return argv


def _check(a):
    if not (isinstance(a.get("gpu"), int) and 0 <= a["gpu"] < 64):
        raise Failure("bad-args", "gpu must be an integer index")
    if a.get("mode") not in MODES or a.get("family") not in FAMILIES:
        raise Failure("bad-args", "mode must be one of %s and family one of %s" % (MODES, FAMILIES))
    for k, lo, hi in (("budget", contract.BUDGET_MIN, contract.BUDGET_MAX), ("prompts", 1, 256), ("tokens", 1, 1024)):
        if not (isinstance(a.get(k), int) and lo <= a[k] <= hi):
            raise Failure("bad-args", "%s must be an integer in [%d, %d]" % (k, lo, hi))
    if a.get("user") is not None and not USER_RE.match(a["user"]):
        raise Failure("bad-args", "user must be a plain user name")
    if not PREFIX_RE.match(a.get("prefix") or ""):
        raise Failure("bad-args", "prefix must be ddtree-smoke-<hex>")


def stop_units(prefix):
    """Stop every transient unit of this run (by its name prefix) and forget failed ones."""
    pattern = prefix + "-*"
    proc.run(["systemctl", "stop", pattern], timeout=60)
    proc.run(["systemctl", "reset-failed", pattern], timeout=20)


def run_transient(ctx, venv, prefix, build_argv, inputs=None, cap=4000):
    """Run one of the plugin's host modules (smoke, bench) from `venv` under the op's deadline: its report file
    (`build_argv(python, report, runtime_max, work)` names it) is read back, every transient unit named
    `prefix-*` is stopped afterwards whatever happened, and the private work directory is removed. `inputs`:
    {file name: text} written into that directory first (0600, root's) for the module to read."""
    try:
        venvmod.check_runnable(venv)
    except (Unsafe, venvmod.VenvError) as exc:
        raise Failure("venv-trust", "%s: root will not run it: %s" % (venv, exc))
    python = venvmod.python(venv)
    work = tempfile.mkdtemp(prefix=prefix + "-op-")  # 0700, root's: the report file lives here
    report = os.path.join(work, "report.json")
    left = ctx.deadline.left(floor=30.0)
    runtime_max = max(60, int(left) - 15)
    try:
        for name, text in (inputs or {}).items():
            fd = os.open(os.path.join(work, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
        res = proc.run(build_argv(python, report, runtime_max, work), timeout=max(30, left - 20), merge=False,
                       cap=cap)
        doc = None
        try:
            if os.path.getsize(report) <= REPORT_MAX:
                with open(report) as fh:
                    doc = json.load(fh)
        except (OSError, ValueError):
            pass
        return {"rc": res["rc"], "timed_out": res["timed_out"], "report": doc, "stderr": res["err"][-3000:],
                "argv": res["argv"], "seconds": res.get("seconds")}
    finally:
        stop_units(prefix)
        shutil.rmtree(work, ignore_errors=True)


@op("smoke.run")
def run(ctx, a):
    _check(a)
    return run_transient(ctx, a["venv"], a["prefix"],
                         lambda python, report, runtime_max, work: smoke_argv(python, a, report, a["prefix"],
                                                                                 runtime_max))
