"""The release ops: read a host's release state (probe, status, logs, outcome) and change it (apply) as one
transaction per call.

`release.apply` runs what the control machine planned, in order -- check the secrets files as the unit's own
start check will (before any change), stage a bundle (read from stdin), activate a release, stop services,
restart batches through the health gate -- under the host lock, checking the lock's token before each step.
Activation is one transaction (activation.py): the plugin in the venv, the file overlays, the unit file with the
per-GPU drop-ins and `current` switch together, or every step already done is undone. Any failure after
activation began re-activates the previous release and restarts what was touched (rollback.py; when the plan
gives a previous release). The op never stops half-way because its client went away: it finishes or rolls back,
journals the outcome with the run's token (release.outcome reads it) and only then lets the lock go.

Each step lives in the module named for it, all working on one ReleaseHost (releasehost.py): releasedir.py (the
release directory: layout, staging, `current`, what is kept), activation.py, unitfiles.py, routerunit.py,
services.py (drained, gated restarts), rollback.py, secretcheck.py. The host's secrets never leave it: this agent
reads an API key only to send it in the gate's Authorization header.
"""
import json
import os
import time

from . import drain as drainmod
from . import gate as gatemod
from . import locks
from . import venv as venvmod
from .activation import ActivationFailed, activate, overlay_check
from .fsutil import Unsafe, append_jsonl, describe, now_iso, read_json, tail_jsonl, trusted_dir
from .registry import Failure, op
from .releasedir import current_release, failed_releases, finish, list_releases, manifest_of, stage
from .releasehost import ReleaseHost
from .rollback import rollback
from .routerunit import ROUTER_START, ROUTER_UNIT, router_state, router_up, router_view
from .secretcheck import check_secrets, gate_keys
from .services import GateFailed, prune, roll, stop
from .systemd import journal_lines, unit_states
from .wheels import normalize


def plugin_version(venv, dist):
    try:
        return venvmod.installed_versions(venvmod.site_packages(venv), [dist]).get(normalize(dist))
    except venvmod.VenvError:
        return None


def venv_trust(venv):
    try:
        venvmod.check_runnable(venv)
        return "ok"
    except (Unsafe, venvmod.VenvError) as exc:
        return str(exc)


def _state(ctx, a, health=False):
    root, sdir = a["root"], a["state_dir"]
    cur = current_release(root)
    man = manifest_of(root, cur)
    lock = locks.read(ctx.state)
    if lock:
        lock["stale"] = locks.stale(lock)
    out = {"current": cur, "releases": list_releases(root), "failed": failed_releases(root), "manifest": man,
           "lock": lock, "services": read_json(os.path.join(sdir, "services.json"), {}),
           "venv_python": os.path.exists(venvmod.python(a["venv"]))}
    if a.get("manifests"):
        out["manifests"] = dict((r, manifest_of(root, r)) for r in out["releases"])
    insts = list(a.get("instances") or [])
    if health:
        insts = sorted(set(insts) | set((man or {}).get("services", {})), key=lambda s: (len(s), s))
    out["units"] = unit_states(insts)
    out["router"] = router_state(man, sdir)
    return out, man, insts


@op("release.probe")
def probe(ctx, a):
    """What a plan needs, changing nothing and taking no lock: current release and manifest, unit states, each
    tree-verify model's config.json (hybrid gate), the file-overlay guards, whether root may run the venv and
    the secrets files: the secrets env file and every API-key file the plan may restart with (those asked for and
    those of the manifests read), each "ok" or why the unit's start check would refuse it (never a key); with
    `listeners` (ports) and `model_dirs` (paths), who listens on each port and whether each path is a model
    directory (fit.py); with `facts` (the facts probe's arguments), the venv's facts as facts.probe reads them
    (the deploy's coherence preflight)."""
    out, _man, _insts = _state(ctx, a)
    out["configs"] = {}
    for m in a.get("models", []):
        p = os.path.join(m, "config.json")
        try:
            with open(p) as fh:
                out["configs"][m] = {"config": json.load(fh)}
        except (OSError, ValueError) as e:
            out["configs"][m] = {"error": "%s: %s" % (p, e)}
    try:
        out["overlays"] = overlay_check(a["venv"], a.get("overlays", []))
    except venvmod.VenvError as exc:
        out["overlays"] = [{"path": o["path"], "ok": False, "why": str(exc), "state": "?"} for o in a["overlays"]]
    if a.get("venv_trust", True):  # a rollback or restart does not ask: its activation checks the venv itself
        out["venv_trust"] = venv_trust(a["venv"]) if out["venv_python"] else "no venv python"
    secrets = a.get("secrets_file")
    out["secrets"] = "unchecked" if not secrets else "ok" if os.path.lexists(secrets) else "absent"
    if out["secrets"] == "ok":
        try:
            check_secrets(secrets)
        except Unsafe as exc:
            out["secrets"] = str(exc)
    key_files = set(a.get("api_key_files") or [])
    for m in [out["manifest"]] + list((out.get("manifests") or {}).values()):
        key_files.update(s["api_key_file"] for s in ((m or {}).get("services") or {}).values()
                         if isinstance(s, dict) and s.get("api_key_file"))
    out["api_keys"] = {}
    for f in sorted(key_files):
        try:
            check_secrets(None, [f])
            out["api_keys"][f] = "ok"
        except Unsafe as exc:
            out["api_keys"][f] = str(exc)
    out["health"] = service_health(out["manifest"], out["units"])
    out["router_view"] = router_view(out["manifest"])
    if a.get("listeners") is not None or a.get("model_dirs") is not None:
        # what the plan checks the inventory against: who listens on its ports, are its model paths models
        from . import fit
        out["listeners"] = fit.listeners(a.get("listeners") or [])
        out["model_dirs"] = dict((m, fit.model_dir(m)) for m in a.get("model_dirs") or [])
    if a.get("facts") is not None:
        # coherence before change: the facts probe's own reading of the venv (distributions with their
        # requirements, native extensions against torch for the GPU archs), in this call, under its deadline
        from . import probe as facts_probe
        out["facts"] = facts_probe.probe(ctx, dict(a["facts"], venv=a["venv"]))
    return out


def service_health(man, units, timeout=2.0):
    """{instance: "ok" or why not} for each enabled service of the active release whose unit is active: its
    /health must answer 200 within `timeout` (a hung or stopped server does not: it is no healthy service, even
    with its unit running)."""
    out = {}
    for i, ms in sorted(((man or {}).get("services") or {}).items()):
        if not ms.get("enabled", True) or (units.get(i) or {}).get("ActiveState") != "active" or not ms.get("port"):
            continue
        code, raw = gatemod.http(int(ms["port"]), "GET", "/health", timeout=timeout,
                                 address=ms.get("address") or "127.0.0.1")
        out[i] = "ok" if code == 200 else ("/health HTTP %s" % code if code else
                                           "/health: %s" % raw[:80].decode("utf-8", "replace"))
    return out


METRICS_MAX = 1 << 20   # bytes of a server's /metrics text returned (SGLang's is a few tens of KiB)


@op("release.status")
def status(ctx, a):
    """Unit states, /health, each server's /metrics text (parsed by the caller) and the router's view."""
    out, man, insts = _state(ctx, a, health=True)
    health, metrics = {}, {}
    for i in insts:
        ms = (man or {}).get("services", {}).get(i) or {}
        port = ms.get("port") or (a.get("ports") or {}).get(i)
        if port:  # at the address it listens on (the manifest's); /health and /metrics need no API key
            addr = ms.get("address") or "127.0.0.1"
            code, _ = gatemod.http(int(port), "GET", "/health", timeout=2, address=addr)
            health[i] = code
            if code is not None and a.get("metrics", True):
                mcode, raw = gatemod.http(int(port), "GET", "/metrics", timeout=3, address=addr)
                metrics[i] = raw[:METRICS_MAX].decode("utf-8", "replace") if mcode == 200 else None
    out.update(metrics=metrics, router_view=router_view(man))
    out.update(health=health, journal=tail_jsonl(os.path.join(a["state_dir"], "journal.jsonl"), a.get("journal_n", 5)),
               plugin_installed=plugin_version(a["venv"], ((man or {}).get("plugin") or {}).get("dist")
                                               or "sglang-ddtree"))
    return out


@op("release.logs")
def logs(ctx, a):
    out = dict((i, journal_lines(i, a.get("n", 50), a.get("since"))) for i in a["instances"])
    if a.get("router"):
        out["router"] = journal_lines(None, a.get("n", 50), a.get("since"), unit_name=ROUTER_UNIT)
    return out


@op("release.outcome")
def outcome(ctx, a):
    """The journal entry of the run with this token (what happened on the host while its client was away)."""
    entries = [j for j in tail_jsonl(os.path.join(a["state_dir"], "journal.jsonl"), 200) if j.get("token") == a["token"]]
    lock = locks.read(ctx.state)
    return {"entry": entries[-1] if entries else None, "running": bool(lock and lock.get("token") == a["token"])}


@op("release.apply", mutating=True)
def apply(ctx, a):
    """Run a planned change: stage, activate, stop, restart batches (gated); roll back on any failure after
    activation began; journal the outcome. Returns {ok, error, restarted, gates, rollback, pruned, ...}."""
    h = ReleaseHost(ctx, a)
    t0 = time.monotonic()
    trusted_dir(h.sdir, create=True)
    cur = current_release(h.root)
    if "expect_current" in a and cur != a["expect_current"]:
        raise Failure("changed", "the host changed since the plan: its current release is %s, the plan saw %s; "
                                 "plan again" % (cur, a["expect_current"]))
    journal = dict(a.get("journal") or {}, token=(ctx.lock or {}).get("token"))
    res = {"ok": True, "restarted": [], "gates": {}, "rolled_back": False, "previous": cur,
           "release": (a.get("activate") or {}).get("release") or cur}
    touched, began, lost = res["restarted"], False, False
    if locks.interrupted(ctx.took_over):  # the lock of a run that died part-way: say so, journal its end
        dead = locks.interrupted(ctx.took_over)
        res["interrupted"] = dead
        ctx.event("interrupted", **dead)
        append_jsonl(os.path.join(h.sdir, "journal.jsonl"), dict(
            event="interrupted", token=dead.get("token"), ok=False, time=now_iso(), by=dead.get("holder"),
            command=dead.get("command"), error="the run died at step %r with %s out of the router; finished by %s" % (
                dead.get("step"), ", ".join(dead.get("out") or []) or "no GPU",
                journal.get("command") or "the next run")))
    try:
        gates = {}
        for b in a.get("batches") or []:
            gates.update(b["gates"])
        try:  # before any change: a restart the unit's own start check would refuse must not begin
            gate_keys(a.get("secrets_file"), gates)
        except Unsafe as exc:
            raise Failure("secrets", "refusing to restart %s: %s; nothing changed" % (
                ", ".join(sorted(gates, key=lambda s: (len(s), s))) or "anything", exc))
        if a.get("stage"):
            ctx.step("stage")
            t = time.monotonic()
            stage(h, a["stage"])
            res["stage_seconds"] = round(time.monotonic() - t, 2)
        if a.get("activate"):
            ctx.step("activate")
            began = True
            act = activate(h, a["activate"])
            res["activate"] = act
            ctx.event("activated", release=act["current"], previous=act["previous"], seconds=act["seconds"],
                      stage_seconds=res.get("stage_seconds"), bundle=(a.get("stage") or {}).get("size"))
        if a.get("router"):  # before any GPU restarts: the drain goes through it
            ctx.step("router", seconds=ROUTER_START + 30)
            res["router"] = router_up(h, a["router"])
        batches = a.get("batches") or []
        if a.get("prune"):  # workers nobody names (a port changed, a run died): out first, drained
            ctx.step("prune", seconds=float(a["prune"].get("timeout") or 0) + 2 * drainmod.ROUTER_WAIT)
            keep = [u for b in batches for u in ((b.get("drain") or {}).get("previous") or {}).values()]
            keep += list(((a.get("stop") or {}).get("drain") or {}).get("workers", {}).values())
            res["pruned_workers"] = prune(h, a["prune"], keep)
        if a.get("stop"):
            ctx.step("stop")
            stop(h, a["stop"]["argv"], a["stop"]["instances"], a["stop"])
        if not batches:
            ctx.event("note", message="nothing-restarted")
        res["gates"] = roll(h, batches, res["release"], touched)
        if a.get("prune"):
            ctx.step("prune", seconds=float(a["prune"].get("timeout") or 0) + 2 * drainmod.ROUTER_WAIT)
            res["pruned_workers"] = (res.get("pruned_workers") or []) + prune(h, a["prune"])
        ctx.step("done")  # a run whose lock was broken while it ran does not report success
    except locks.LockLost as exc:  # someone broke our lock: they own the host now; stop, touch nothing more
        res.update(ok=False, error=str(exc), lock_lost=True)
        lost = True
    except Exception as exc:
        res.update(ok=False, error=str(exc) if isinstance(exc, (GateFailed, ActivationFailed, Failure))
                   else describe(exc))
        if isinstance(exc, GateFailed):
            res["failed"] = exc.failed
        if isinstance(exc, Failure):
            res["kind"] = exc.kind
        # activation undoes itself when it fails; past it, the previous release comes back -- unless the lock
        # was broken meanwhile (a failing gate may be the other run restarting our units): then hands off
        if began and not isinstance(exc, ActivationFailed) and a.get("rollback") is not None:
            try:
                ctx.step("rollback")
                rb = rollback(h, a["rollback"], list(touched), res.get("failed") or ())
                res.update(rollback=rb, rolled_back=rb["ok"])
            except locks.LockLost as lexc:
                res.update(error=res["error"] + "; not rolled back: " + str(lexc), lock_lost=True)
                lost = True
    res["seconds"] = round(time.monotonic() - t0, 2)
    journal.update(restarted=list(touched), seconds=res["seconds"])
    if not res["ok"]:
        journal.update(event=a.get("fail_event") or journal.get("event"), error=res.get("error"))
        if res.get("failed"):
            journal["failed"] = res["failed"]
        if "rollback" in res:
            journal.update(rolled_back_to=res["rollback"].get("release"), rollback_ok=res["rollback"]["ok"],
                           rollback_seconds=res["rollback"].get("seconds"))
    journal["ok"] = res["ok"]
    if lost:
        journal["event"] = "lock-lost"
    staged = (a.get("stage") or {}).get("release")
    res["pruned"] = finish(h, journal, staged if not res["ok"] and staged and a.get("mark_failed", True) else None,
                             res.get("error", ""))
    return res
