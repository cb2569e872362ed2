"""The host's sglang-router unit: whether it runs and answers /liveness, its own view of its workers, and
(re)starting it when what it runs changed or it is down, before any GPU restarts (the drain goes through it)."""
import os
import time

from . import drain as drainmod
from . import server_secrets
from .fsutil import now_iso, read_json, write_json
from .systemd import journal_lines, named_states

ROUTER_UNIT = "sglang-router.service"
ROUTER_START = 60.0     # s for a (re)started router to answer /liveness


def router_state(man, sdir):
    """The router venvs this host has, and -- when the active release runs a router -- its unit and whether it
    answers /liveness (what the plan refuses a restart on: no router, no drain)."""
    rdir = os.path.join(sdir, "router")
    out = {"venvs": sorted(d for d in os.listdir(rdir) if not d.startswith(".") and not d.endswith(".tmp"))
           if os.path.isdir(rdir) else [], "expected": False}
    r = (man or {}).get("router") or {}
    if r.get("enabled"):
        st = named_states([ROUTER_UNIT]).get(ROUTER_UNIT, {})
        ok, detail = drainmod.alive(r)
        out.update(expected=True, unit=st, alive=ok and st.get("ActiveState") == "active",
                   detail="%s, /liveness %s" % (st.get("ActiveState") or "unknown", detail))
    return out


def router_view(man):
    """The router's own view of its workers, {url: {healthy, load}}, or why it could not be read. With a router key
    this needs root (the key file is root's): read-only, the key is sent and never returned."""
    r = (man or {}).get("router") or {}
    if not r.get("enabled"):
        return None
    ok, detail = drainmod.alive(r)
    view = {"alive": ok, "detail": detail, "port": r["port"], "listen": r.get("listen")}
    if not ok:
        return view
    key = None
    if r.get("api_key_file"):
        try:
            key = server_secrets.read_api_key(r["api_key_file"])
        except (server_secrets.SecretsError, OSError) as exc:
            view["error"] = "cannot read the router's key file: %s" % exc
            return view
    try:
        view["workers"] = dict((u, {"healthy": bool(w.get("is_healthy")), "load": w.get("load")})
                               for u, w in drainmod.workers(r, key).items())
    except RuntimeError as exc:
        view["error"] = str(exc)
    return view


def router_up(h, spec):
    """(Re)start the router when what it runs changed (its digest differs from the one it was started with)
    or it is not running; wait for /liveness. Raises RuntimeError when it does not come up."""
    rec_path = os.path.join(h.sdir, "router.json")
    rec = read_json(rec_path, {})
    st = named_states([ROUTER_UNIT]).get(ROUTER_UNIT, {})
    if rec.get("digest") == spec["digest"] and st.get("ActiveState") == "active" and drainmod.alive(spec)[0]:
        return {"restarted": False}
    t0 = time.monotonic()
    h.run(spec["reset_failed"], "router reset-failed", check=False)
    h.run(spec["restart"], "router restart")
    end = t0 + ROUTER_START
    while True:
        ok, detail = drainmod.alive(spec)
        if ok:
            break
        if time.monotonic() > end:
            raise RuntimeError("sglang-router did not answer /liveness within %.0fs (%s): %s" % (
                ROUTER_START, detail, " | ".join(journal_lines(None, 5, unit_name=ROUTER_UNIT))))
        time.sleep(0.3)
    write_json(rec_path, {"digest": spec["digest"], "started": now_iso()})
    res = {"restarted": True, "seconds": round(time.monotonic() - t0, 2)}
    h.ctx.event("router", phase="restarted", **res)
    return res
