"""`fab deploy` and `fab rollback`: releases with health-gated rolling restarts and automatic rollback."""
from __future__ import annotations

import json as jsonlib
import sys
from pathlib import Path

from invoke import Exit, task

from .. import modes


def _inv(hosts):
    from ..inventory import InventoryError, load_inventory
    try:
        inv = load_inventory()
        return inv, inv.select(hosts)
    except InventoryError as exc:
        raise Exit(str(exc), code=2)


def confirm_prompt(yes: bool):
    """None (no question) with --yes; else a function asking on the terminal; refuses without one."""
    if yes:
        return None
    if not sys.stdin.isatty():
        raise Exit("no terminal to confirm on: review the plan with a terminal, or pass --yes", code=2)

    def ask():
        # Ctrl-C or end of input is a no; the plan took no lock, so no host is left locked
        from ..prompt import ask_yes_no
        return ask_yes_no("Proceed with this rollout?")
    return ask


def report(summary: dict, json: bool, what: str) -> None:
    if json:
        print(jsonlib.dumps(summary, indent=1, default=str))
    hosts = summary["hosts"]
    bad = {h: r for h, r in hosts.items() if not r.get("ok")}
    for h, r in hosts.items():
        if r.get("ok"):
            extra = "unchanged" if r.get("unchanged") and not r.get("restarted") else \
                f"restarted {', '.join(r.get('restarted') or []) or 'nothing'}"
            print(f"{what} ok   {h}: release {r.get('release')} ({extra}, {r.get('seconds', 0):.1f}s)", file=sys.stderr)
        else:
            rb = r.get("rollback") or {}
            tail = (f"; rolled back to {rb.get('release')} ({'ok' if rb.get('ok') else 'FAILED'}, "
                    f"{rb.get('seconds', 0):.1f}s)") if rb else ""
            print(f"{what} FAIL {h}: {r.get('error')}{tail}", file=sys.stderr)
    print(f"{what}: {len(hosts) - len(bad)}/{len(hosts)} hosts ok in {summary.get('seconds', 0):.1f}s"
          + (" (aborted)" if summary.get("aborted") else ""), file=sys.stderr)
    if bad or not hosts:
        raise Exit(code=1)


@task(help={"mode": "linear | shadow-linear | tree-verify for every service of the hosts given "
                    "(default: each service's mode from the inventory)",
            "hosts": "comma-separated hosts or groups (default: all)",
            "yes": "do not ask for confirmation (required without a terminal)",
            "allow_hybrid_unsafe": "allow tree-verify on a hybrid recurrent model without the plugin's "
                                   "tree-aware-state declaration (recorded in the manifest and status)",
            "max_fail": "stop starting new hosts after this many failed (0: never stop; default 1)",
            "break_lock": "remove another run's host lock first (runbook: only when that run is dead)",
            "plugin": "the plugin project to build into the release (default overlays/sglang-ddtree)",
            "overlays": "file-overlay spec (default overlays/file-overlays.yaml, if present)",
            "no_drain": "restart GPUs without draining them out of the host's router (in-flight requests are cut; "
                        "for a host whose router is down)",
            "json": "print the summary as JSON"})
def deploy(c, mode=None, hosts=None, yes=False, allow_hybrid_unsafe=False, max_fail=1, break_lock=False,
           plugin=None, overlays=None, json=False, no_drain=False):
    """Build a release and roll it out: one gated restart per changed GPU service, auto-rollback on failure.

    A host is refused at the plan, before anything is locked, staged or restarted, when its SGLang is not one the
    built plugin supports, when a pin among sglang / sglang-kernel / torch / flashinfer-python is unmet, or when
    sgl_kernel's common_ops for its GPU arch does not resolve against its torch (RUNBOOK: the coherence
    preflight), or when its router is down (no drain possible; --no-drain restarts anyway); the other hosts go on.
    Each GPU is taken out of its host's router and drained before it restarts, and put back after its gate. Exit 0
    only if every host is ok."""
    from ..release import build, plan, rollout
    if mode is not None and mode not in modes.MODES:
        raise Exit(f"--mode must be one of {', '.join(modes.MODES)}", code=2)
    inv, selected = _inv(hosts)
    ask = confirm_prompt(yes)
    opts = plan.DeployOptions(mode=mode, allow_hybrid_unsafe=allow_hybrid_unsafe, max_fail=int(max_fail),
                              break_lock=break_lock, command=" ".join(["fab"] + sys.argv[1:]),
                              plugin_dir=Path(plugin) if plugin else build.DEFAULT_PLUGIN_DIR,
                              overlay_spec=Path(overlays) if overlays else build.DEFAULT_OVERLAY_SPEC,
                              no_drain=no_drain)
    try:
        summary = rollout.deploy(inv, selected, opts, confirm=ask)
    except build.BuildError as exc:
        raise Exit(f"release build failed: {exc}", code=1)
    report(summary, json, "deploy")


@task(help={"hosts": "comma-separated hosts or groups (default: all)",
            "to": "release id to re-activate (default: the one before the current)",
            "break_lock": "remove another run's host lock first", "json": "print the summary as JSON",
            "yes": "accepted for symmetry with deploy: rollback never asks (a runbook action, gated per GPU)",
            "no_drain": "restart GPUs without draining them out of the host's router (in-flight requests are cut; "
                        "for a host whose router is down)",
})
def rollback(c, yes=False, hosts=None, to=None, break_lock=False, json=False, no_drain=False):
    """Re-activate the previous (or --to) release through the same gated, drained restart."""
    from ..release import rollout
    inv, selected = _inv(hosts)
    summary = rollout.rollback(inv, selected, to=to, break_lock=break_lock,
                               command=" ".join(["fab"] + sys.argv[1:]), no_drain=no_drain)
    report(summary, json, "rollback")


TASKS = [deploy, rollback]
