"""Restarting and stopping a release's GPU services: each batch drained out of the router, reset and restarted
together (one systemctl), gated service by service (gate.py: health, model, canary), warmed up and put back; a
failing gate stops the roll (GateFailed). Also taking out of the router the workers a release does not name."""
import os
import time

from . import drain as drainmod
from . import gate as gatemod
from . import server_secrets
from .fsutil import Unsafe, now_iso, read_json, write_json
from .secretcheck import gate_keys
from .systemd import unit_states


class GateFailed(Exception):
    def __init__(self, message, failed):
        Exception.__init__(self, message)
        self.failed = failed


def stop(h, argv, insts, spec=None):
    """Stop services; with a drain spec (the release's router), take them out of the router and wait for them
    first. A router that cannot be asked does not stop the stop: their health checks fail within seconds."""
    drain = (spec or {}).get("drain")
    if drain:
        try:
            key = server_secrets.read_api_key(drain["api_key_file"]) if drain.get("api_key_file") else None
            done = drainmod.take_out(drain, dict((i, tuple(v)) for i, v in spec["servers"].items()), key)
            for i in insts:
                h.ctx.event("drain", instance=i, **done[i])
        except (RuntimeError, server_secrets.SecretsError, OSError) as exc:
            h.ctx.event("note", message="drain-failed", detail=str(exc))
    h.run(argv, "stop", check=False)
    h.ctx.event("stopped", instances=insts)


def restart_batch(h, batch, release):
    """(Re)start one batch together, then gate each service; records services.json on success."""
    insts = batch["instances"]
    try:  # what the unit's ExecStartPre will check, before anything restarts (apply checked it once already)
        keys = gate_keys(h.a.get("secrets_file"), batch["gates"])
    except Unsafe as exc:  # nothing restarted: the running services keep serving
        keys = None
        results = dict((i, {"ok": False, "step": "secrets", "detail": str(exc), "port": batch["gates"][i]["port"]})
                       for i in insts)
    if keys is not None:
        results = restart_gate(h, batch, keys)
    rec_path = os.path.join(h.sdir, "services.json")
    rec = read_json(rec_path, {})
    for i in insts:
        if results[i]["ok"]:
            rec[i] = {"release": release, "digest": batch["gates"][i].get("digest"), "started": now_iso(),
                      "accept_length": results[i].get("accept_length")}
        h.ctx.event("gate", instance=i, port=batch["gates"][i]["port"], gate=results[i])
    write_json(rec_path, rec)
    return results


def restart_gate(h, batch, keys):
    """Drain the batch out of the router (when it has one), reset, restart it together (one systemctl), gate
    each service with its address and key, warm it up and put it back into the router."""
    insts = batch["instances"]
    drain = batch.get("drain")
    rkey = server_secrets.read_api_key(drain["api_key_file"]) if drain and drain.get("api_key_file") else None
    drained = {}
    if drain:  # the whole batch out of the router first, then one wait (one deadline) for all of it
        try:
            drained = drainmod.take_out(drain, dict(
                (i, (batch["gates"][i]["port"], batch["gates"][i].get("address") or "127.0.0.1")) for i in insts),
                rkey)
        except RuntimeError as exc:  # the router cannot be asked: restarting now would cut requests
            return dict((j, {"ok": False, "step": "drain", "detail": str(exc), "port": batch["gates"][j]["port"]})
                        for j in insts)
        h.out.update(insts)
        h.ctx.progress(out=sorted(h.out, key=lambda s: (len(s), s)))
        for i in insts:
            h.ctx.event("drain", instance=i, **drained[i])
    results = restart_only(h, batch, keys)
    for i in insts if drain else []:
        results[i]["drain"] = drained[i]
        if not results[i].get("ok"):
            continue  # a server that failed its gate stays out of the router
        g = batch["gates"][i]
        results[i]["warmup"] = drainmod.warm_up(g["port"], keys.get(i), g.get("address") or "127.0.0.1")
        back = drainmod.put_back(drain, i, rkey)
        results[i]["router"] = back
        if not back["ok"]:
            results[i].update(ok=False, step="router", detail=back["detail"])
        else:
            h.out.discard(i)
    if drain:
        h.ctx.progress(out=sorted(h.out, key=lambda s: (len(s), s)))
    return results


def restart_only(h, batch, keys):
    """Reset, restart the batch together (one systemctl), then gate each service with its address and key."""
    insts = batch["instances"]
    h.run(batch["reset_failed"], "reset-failed", check=False)  # a start-limit hit or failed state
    before = unit_states(insts)
    t0 = time.monotonic()
    r = h.run(batch["restart"], "restart", check=False)
    if r["rc"] != 0:
        results = dict((i, {"ok": False, "step": "systemctl", "detail": (r["out"] + r["err"]).strip()[-400:]})
                       for i in insts)
    else:
        results = {}
        for i in insts:
            g = batch["gates"][i]
            # the start timeout the plan derived from the mode and budget (deploy/startup.py), and the canary
            results[i] = gatemod.gate(g["port"], g["expect"], g.get("start_timeout") or h.a["start_timeout"],
                                      h.a["gate_timeout"],
                                      inst=i, restarts_before=int(before[i].get("NRestarts") or 0),
                                      old_invocation=before[i].get("InvocationID", ""),
                                      address=g.get("address") or "127.0.0.1", api_key=keys.get(i),
                                      canary_spec=g.get("canary"))
            results[i]["restart_seconds"] = round(time.monotonic() - t0, 2)
    return results


def roll(h, batches, release, touched):
    """Restart batch after batch; stops at the first batch with a failing gate (GateFailed)."""
    gates = {}
    for b in batches:
        h.ctx.step("restart " + ",".join(b["instances"]),
                      seconds=(h.a["start_timeout"] + h.a["gate_timeout"] + 30 + 2 * drainmod.ROUTER_WAIT)
                      * len(b["instances"]) + float((b.get("drain") or {}).get("timeout") or 0))
        results = restart_batch(h, b, release)
        gates.update(results)
        touched.extend(b["instances"])
        bad = [i for i in b["instances"] if not results[i].get("ok")]
        if bad:
            raise GateFailed("gate failed on %s: %s" % (", ".join(bad), "; ".join(
                "%s: %s" % (results[i].get("step"), results[i].get("detail")) for i in bad)), bad)
    return gates


def prune(h, spec, keep=()):
    """Take out of the router (drained) every worker the release does not name; say so per worker. A router
    that cannot be asked is a warning here (the restarts' own drain refuses to restart without it)."""
    if not spec:
        return []
    try:
        key = server_secrets.read_api_key(spec["api_key_file"]) if spec.get("api_key_file") else None
        done = drainmod.prune(spec, keep, key)
    except (RuntimeError, server_secrets.SecretsError, OSError) as exc:
        h.ctx.event("note", message="prune-failed", detail=str(exc))
        return []
    for d in done:
        h.ctx.event("stray", **d)
    return done
