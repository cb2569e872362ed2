"""Which GPUs of a host restart, why and in what order, decided from what the plan's read-only probe saw (pure):
a new, changed or stale service, one not running, not healthy or out of its router; the GPUs already out of the
router first; a rollback's target release; and what refuses a host before anything changes (its router down, its
secrets or API-key files as the unit's own start check would judge them)."""
from __future__ import annotations

from . import router as routermod

NO_DRAIN_WARNING = ("WARNING --no-drain: GPUs restart WITHOUT draining them out of the router: requests in flight on "
                    "a restarting GPU are cut")


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def by_gpu(insts) -> list[str]:
    return sorted(insts, key=lambda s: (len(s), s))


def changed_services(new: dict, old: dict | None, units: dict, recorded: dict, health: dict | None = None,
                     routed: dict | None = None) -> dict[str, str]:
    """instance -> why it must be (re)started; unchanged, running and healthy services are left alone. `health`
    (the probe's {instance: "ok" or why not}) restarts a running service that does not answer /health (hung);
    `routed` ({instance: in the router?}, None without a router) one its router does not hold (left out by a
    failed gate or a run that died)."""
    out = {}
    for inst, s in new["services"].items():
        if not s.get("enabled", True):
            continue
        prev = (old or {}).get("services", {}).get(inst)
        state = (units.get(inst) or {}).get("ActiveState")
        if prev is None:
            out[inst] = "new"
        elif prev.get("digest") != s["digest"]:
            out[inst] = "changed"
        elif (recorded.get(inst) or {}).get("digest") not in (None, s["digest"]):
            out[inst] = "running an older release"
        elif state not in ("active", "activating"):
            out[inst] = f"not running ({state or 'unknown'})"
        elif (health or {}).get(inst, "ok") != "ok":
            out[inst] = f"not healthy ({health[inst]})"
        elif routed is not None and inst in routed and not routed[inst]:
            out[inst] = "out of the router"
    return out


def routed(manifest: dict | None, view: dict | None) -> dict | None:
    """{instance: whether the host's router holds its worker} from the probe's router view; None when the release
    has no router or the view could not be read."""
    if not manifest or not view or "workers" not in view:
        return None
    return {i: routermod.worker_url(s["port"]) in view["workers"] for i, s in manifest.get("services", {}).items()
            if s.get("enabled", True)}


def interrupted_line(lock: dict | None) -> str | None:
    """What a plan says about the lock of a run that died part-way (stale, with the step it had begun)."""
    if not lock or not lock.get("stale") or not lock.get("step") or lock.get("step") == "done":
        return None
    out = ", ".join(lock.get("out") or []) or "none"
    return (f"found an interrupted run: {lock.get('holder')} running {lock.get('command')!r} since "
            f"{lock.get('started')} stopped at step {lock.get('step')!r} ({lock.get('stale')}); GPUs it left out of "
            f"the router: {out}. This run finishes it first: every GPU out of the router or not on the active "
            f"release restarts (gated) and goes back")


def router_refusal(state: dict, restarting: bool, no_drain: bool) -> str | None:
    """A host whose router should be running but is not cannot drain its GPUs: refused at the plan (unless
    --no-drain, or nothing restarts)."""
    r = state.get("router") or {}
    if not restarting or no_drain or not r.get("expected") or r.get("alive"):
        return None
    return (f"router: sglang-router.service is down ({r.get('detail')}): its GPUs cannot be drained before they "
            "restart. Start it (`systemctl start sglang-router` on the host; `fab logs` says why it stopped), or run "
            "again with --no-drain to restart without draining (requests in flight are cut)")


def secrets_refusals(state: dict, key_files) -> list[str]:
    """Why a plan refuses a host for its secrets: the secrets env file or an API-key file the change would
    start services with is one the unit's own start check (ExecStartPre) would refuse -- found before anything
    is staged or stopped, not at the restart."""
    out = []
    if state.get("secrets") not in (None, "ok", "absent", "unchecked"):
        out.append(f"secrets file: {state['secrets']}")
    checked = state.get("api_keys") or {}
    for f in sorted({f for f in key_files if f}):
        why = checked.get(f, f"{f}: not checked by the host")
        if why != "ok":
            out.append(f"API key file: {why}")
    return out


def out_first(insts: list[str], why: dict) -> list[str]:
    """The GPUs already out of the router first: restarting them costs no capacity (as a rollback does)."""
    return [i for i in insts if why.get(i) == "out of the router"] + \
        [i for i in insts if why.get(i) != "out of the router"]


def rollback_target(current: str | None, releases: list[str], failed: list[str], to: str | None, host: str) -> str:
    """The release a rollback re-activates: `to`, or the newest good release older than the current one."""
    if to:
        if to not in releases:
            raise RuntimeError(f"release {to} is not on {host} (kept: {', '.join(releases) or 'none'})")
        return to
    bad = set(failed or [])
    older = [r for r in releases if (current is None or r < current) and r not in bad]
    if not older:
        raise RuntimeError(f"no good release older than {current} on {host} (kept: {', '.join(releases)}"
                           + (f"; failed: {', '.join(sorted(bad))}" if bad else "") + ")")
    return older[-1]
