"""`smoke.run`: the DDTree payload's smoke test on one GPU of this host, with the active release's venv and plugin.

It runs `{venv}/bin/python -m sglang_ddtree_tools.smoke` (the plugin tools' host-side module: tiny seeded model of
the requested family, transient SGLang servers started with `systemd-run` as the service user, the lossless
statistic, the server's reports, an unsupported request) under the op's deadline, and always stops every transient
unit it started (their names share a per-run prefix, and each unit carries RuntimeMaxSec as a second guard). The
servers change nothing the deploy manages and the op takes no host lock; root runs the venv's interpreter only after
the venv passed the trust check (nothing in it writable by another user).

The tools (distribution sglang-ddtree-tools) are not in the serving venv: the call carries their wheel on its
stdin (`tools`: its file name, size and sha256), which is checked (name, sha256, every member against its RECORD)
and installed into the run's private work directory (`pip --no-index --no-deps --target`), on PYTHONPATH of the
module's process only; the directory is removed when the run ends.
"""
import hashlib
import json
import os
import re
import shutil
import tempfile

from . import contract, jitcache, proc
from . import venv as venvmod
from . import wheels
from .fsutil import Unsafe
from .registry import Failure, op

MODES = contract.SMOKE_MODES
FAMILIES = ("hybrid", "dense")
USER_RE = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")
PREFIX_RE = re.compile(r"ddtree-smoke-[0-9a-f]{8,32}\Z")
REPORT_MAX = 8 << 20  # a report larger than this is not read (the control side would refuse it anyway)
TOOLS_DIST = "sglang-ddtree-tools"  # the tools' distribution (the control side's deploy/tools.py DIST)
TOOLS_MODULE = "sglang_ddtree_tools"
TOOLS_MAX = 16 << 20  # the tools wheel is pure Python, a few hundred KiB
START_MARGIN_S = 40  # what the smoke needs after its servers are up: generate, re-score, the unsupported request


def smoke_argv(python, a, report, prefix, runtime_max):
    """The smoke module's command line (the control side shows the same fields in its plan). Its servers must be
    healthy START_MARGIN_S before the op's deadline: a server that starts too slowly is then reported by the module
    with its log's last exception line, not cut off by the deadline with nothing said."""
    argv = [python, "-m", TOOLS_MODULE + ".smoke", "--gpu", str(a["gpu"]), "--mode", a["mode"],
            "--family", a["family"], "--budget", str(a["budget"]), "--prompts", str(a["prompts"]),
            "--tokens", str(a["tokens"]), "--launcher", "systemd-run", "--unit-prefix", prefix,
            "--runtime-max", str(int(runtime_max)),
            "--start-timeout", str(max(20, int(runtime_max) - START_MARGIN_S)), "--json", report]
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
    check_jit(a)


# the service environment a transient server of the GPU runs with (the unit's own `env`, deploy/values.py's rules:
# a name, and a value an EnvironmentFile would keep as it is); the names the contract or the run sets are refused
ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}\Z")
ENV_VALUE_RE = re.compile(r"(?:[!#%&(-\[\]-_a-~]+(?: [!#%&(-\[\]-_a-~]+)*)?\Z")
ENV_MAX = 64
ENV_SET_BY_RUN = frozenset({"PATH", "HOME", "PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES",
                            "CUDA_DEVICE_ORDER", "NCCL_SOCKET_IFNAME", "LD_PRELOAD", contract.PLUGIN_ALLOWLIST_ENV,
                            contract.MODE_ENV, contract.BUDGET_ENV, contract.OVERLAP_ENV, contract.XDG_CACHE_ENV[0]}
                           | {k for k, _d in contract.JIT_CACHE_ENV})


def check_service_env(env):
    """The op's `env` (the GPU's service environment, or absent): {} or a dict the servers may run with; raises
    Failure naming the first bad entry."""
    if env is None:
        return {}
    if not (isinstance(env, dict) and len(env) <= ENV_MAX):
        raise Failure("bad-args", "env must be a mapping of at most %d variables" % ENV_MAX)
    for k, v in env.items():
        if not (isinstance(k, str) and ENV_KEY_RE.match(k)):
            raise Failure("bad-args", "env: %r is not a variable name" % (k if isinstance(k, str) else type(k)))
        if k in ENV_SET_BY_RUN:
            raise Failure("bad-args", "env: %s is set by the run itself" % k)
        if contract.secret_name(k):  # systemd-run's argv would show it
            raise Failure("bad-args", "env: %s looks like a secret: secrets never go into a server's environment "
                          "by argument" % k)
        if not (isinstance(v, str) and len(v) <= 4096 and ENV_VALUE_RE.match(v)):
            raise Failure("bad-args", "env: the value of %s is not a plain string" % k)
    return dict(env)


def check_tools(t):
    """The `tools` argument: {wheel: a sglang-ddtree-tools wheel file name, size, sha256}; raises Failure."""
    if not isinstance(t, dict):
        raise Failure("bad-args", "tools must be {wheel, size, sha256} (the tools wheel follows the request)")
    nv = wheels.parse_wheel_filename(t.get("wheel"))
    if nv is None or nv[0] != TOOLS_DIST:
        raise Failure("bad-args", "tools.wheel must be a %s wheel file name" % TOOLS_DIST)
    if not (isinstance(t.get("size"), int) and not isinstance(t["size"], bool) and 0 < t["size"] <= TOOLS_MAX):
        raise Failure("bad-args", "tools.size must be an integer in [1, %d]" % TOOLS_MAX)
    try:
        wheels.checked_sha256(t.get("sha256"))
    except wheels.WheelError as exc:
        raise Failure("bad-args", "tools.sha256: %s" % exc)


def tools_install_argv(python, wheel, target):
    """Install the tools wheel, exactly that file, offline, into `target` (never the venv's site-packages)."""
    return [python, "-m", "pip", "install", "--isolated", "--no-index", "--no-deps", "--no-compile",
            "--disable-pip-version-check", "--no-input", "--no-cache-dir", "--target", target, wheel]


def install_tools(ctx, python, t, work):
    """Take the tools wheel (`t`: check_tools' fields) off the call's stdin, check it and install it under `work`;
    returns the directory to put on PYTHONPATH. Raises Failure."""
    data = ctx.stdin.read(t["size"])
    if len(data) != t["size"] or hashlib.sha256(data).hexdigest() != t["sha256"]:
        raise Failure("tools", "the tools wheel arrived damaged (%d of %d bytes)" % (len(data), t["size"]))
    path = os.path.join(work, t["wheel"])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    try:
        wheels.check_wheel(path)
    except wheels.WheelError as exc:
        raise Failure("tools", "the tools wheel was refused: %s" % exc)
    target = os.path.join(work, "tools")
    res = proc.run(tools_install_argv(python, path, target), timeout=ctx.deadline.left(cap=120, floor=5))
    if res["rc"] != 0:
        raise Failure("tools", "installing %s into the run's directory failed: %s"
                      % (t["wheel"], (res["out"] + res["err"]).strip()[-1500:]))
    return target


def stop_units(prefix):
    """Stop every transient unit of this run (by its name prefix) and forget failed ones."""
    pattern = prefix + "-*"
    proc.run(["systemctl", "stop", pattern], timeout=60)
    proc.run(["systemctl", "reset-failed", pattern], timeout=20)


def check_jit(a):
    """The op's `instance` and `cache_key` (the GPU's service and its active payload; both null: none)."""
    problem = jitcache.check(a.get("instance"), a.get("cache_key"))
    if problem:
        raise Failure("bad-args", problem)


def seed_jit(ctx, a):
    """The transient servers' JIT cache variables (a copy of the GPU's service caches, jitcache.seed) and what
    the seeding found; never fails the op (the servers then start cold)."""
    try:
        return jitcache.seed(a.get("instance"), a.get("cache_key"), a.get("user"),
                             deadline_s=ctx.deadline.left(cap=4 * jitcache.DEADLINE_S) / 4)
    except OSError as exc:
        return {}, {"state": "cold", "warning": "the transient JIT cache directory: %s" % exc}


def run_transient(ctx, venv, prefix, build_argv, tools, inputs=None, cap=4000, jit=None, service_env=None):
    """Run one of the tools' host modules (smoke, bench) with `venv`'s interpreter under the op's deadline: the
    tools wheel (`tools`: check_tools' fields; the bytes on the call's stdin) is installed into the private work
    directory first and put on the module's PYTHONPATH, its report file (`build_argv(python, report, runtime_max,
    work)` names it) is read back, every transient unit named `prefix-*` is stopped afterwards whatever happened,
    and the work directory is removed. `inputs`: {file name: text} written into that directory first (0600,
    root's) for the module to read. `jit`: the op's arguments naming the GPU's service (check_jit): its servers'
    JIT caches are seeded from the service's first (seed_jit), the result's `jit_cache` says how. `service_env`:
    the GPU's service environment (check_service_env), handed to the module as `--service-env FILE` so that its
    servers run with what the service's unit sets."""
    check_tools(tools)
    service_env = check_service_env(service_env)
    if service_env:
        inputs = dict(inputs or {}, **{"service-env.json": json.dumps(service_env)})
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
        env = dict(os.environ, PYTHONPATH=install_tools(ctx, python, tools, work))
        jit_env, jit_res = seed_jit(ctx, jit) if jit is not None else ({}, None)
        env.update(jit_env)
        left = ctx.deadline.left(floor=30.0)
        argv = build_argv(python, report, runtime_max, work)
        if service_env:
            argv += ["--service-env", os.path.join(work, "service-env.json")]
        res = proc.run(argv, timeout=max(30, left - 20), merge=False,
                       cap=cap, env=env)
        doc = None
        try:
            if os.path.getsize(report) <= REPORT_MAX:
                with open(report) as fh:
                    doc = json.load(fh)
        except (OSError, ValueError):
            pass
        return {"rc": res["rc"], "timed_out": res["timed_out"], "report": doc, "stderr": res["err"][-3000:],
                "argv": res["argv"], "seconds": res.get("seconds"), "jit_cache": jit_res}
    finally:
        stop_units(prefix)
        shutil.rmtree(work, ignore_errors=True)


@op("smoke.run")
def run(ctx, a):
    _check(a)
    return run_transient(ctx, a["venv"], a["prefix"],
                         lambda python, report, runtime_max, work: smoke_argv(python, a, report, a["prefix"],
                                                                                 runtime_max), a.get("tools"), jit=a,
                         service_env=a.get("env"))
