"""Rolling back after a failure past activation: the previous release re-activated (activation.py), the router
(re)started when it runs one, what it does not run stopped, and the touched GPUs restarted and gated in batches --
the ones that failed their gate first."""
import time

from .activation import activate
from .fsutil import describe
from .releasedir import manifest_of
from .routerunit import router_up
from .services import GateFailed, prune, roll, stop
from .systemd import unit


def rollback(h, spec, touched, failed=()):
    """After a failure past activation: re-activate the previous release, stop what it does not run, restart
    and gate what was touched. Returns {ok, release, seconds, detail}."""
    t0 = time.monotonic()
    prev = spec.get("activate")
    if not prev:
        if touched:
            stop(h, spec["stop"] + [unit(i) for i in touched], touched)
        h.ctx.event("rollback", phase="none", instances=touched)
        return {"ok": False, "release": None, "detail": "no previous release; services stopped",
                "seconds": round(time.monotonic() - t0, 2)}
    h.ctx.event("rollback", phase="start", release=prev["release"])
    ok, detail = True, ""
    try:
        activate(h, prev)
        if spec.get("router"):
            router_up(h, spec["router"])
        pman = manifest_of(h.root, prev["release"])
        gone = [i for i in touched if i not in pman.get("services", {})]
        if gone:
            stop(h, spec["stop"] + [unit(i) for i in gone], gone)
        # the services that failed their gate first: they are out of the router already, so the others still
        # serve while those come back (restarting a serving one first would leave the router short of two)
        restart = [i for i in touched if i in pman.get("services", {})]
        restart = [i for i in restart if i in failed] + [i for i in restart if i not in failed]
        size = max(1, int(spec.get("max_unavailable") or 1))
        batches = [batch(spec, restart[i:i + size]) for i in range(0, len(restart), size)]
        roll(h, batches, prev["release"], [])
        prune(h, spec.get("drain"))  # e.g. the new url of a GPU whose port the failed release changed
    except GateFailed as exc:
        ok, detail = False, str(exc)
    except Exception as exc:
        ok, detail = False, describe(exc)
    res = {"ok": ok, "release": prev["release"], "seconds": round(time.monotonic() - t0, 2), "detail": detail}
    h.ctx.event("rollback", phase="done", **res)
    return res


def batch(spec, insts):
    """A restart batch of the previous release's services, from the command prefixes and the gates the plan
    made (payload.rollback_spec: the control side builds every gate)."""
    units = [unit(i) for i in insts]
    return {"instances": insts, "reset_failed": spec["reset_failed"] + units, "restart": spec["restart"] + units,
            "gates": dict((i, spec["gates"][i]) for i in insts), "drain": spec.get("drain")}
