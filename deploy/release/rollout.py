"""Drive releases over the fleet: plan every host (read-only probe), confirm, then one transactional agent call
per host.

Per host: `release.probe` (1 call, read-only, no lock) gives what the plan needs; the plan is pure (plan.py: which
GPUs restart and why, the commands as argv, the rollback; payload.py builds the request) and printed; after
confirmation one `release.apply` call (agentcalls.py; under the host lock, taken and released by that call) stages
the bundle (sent on the call's stdin), activates the release as one transaction, stops removed services and
restarts the changed ones `max_unavailable` at a time through the health gate, and -- on any failure after
activation began -- re-activates the previous release and restarts what it touched. The host's agent runs that to
the end even if this machine or the link goes away; the outcome is journaled with the run's token, and read back
(release.outcome) after a lost link. Hosts run in parallel on ssh.run_per_host's bounded pool; `--max-fail` stops
starting new hosts. deploy, rollback and restart share that one skeleton (agentcalls.run_host) and one batch
builder (payload.restart_batch).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from dataclasses import replace

from ..inventory import Host, Inventory
from ..remote import commands
from ..remote.client import Remote
from ..remote.client import lock_holder as holder
from ..ssh import run_per_host
from . import build, gateplan, render
from .agentcalls import check_lock, plan_host, probe, run_host
from .changes import NO_DRAIN_WARNING, interrupted_line, router_refusal, secrets_refusals
from .payload import restart_payload, rollback_payload
from .plan import DeployOptions, HostPlan, with_mode
from .progress import Printer


def build_release(opts: DeployOptions, release: str | None = None):
    release = release or build.new_release_id()
    plugin = build.build_plugin(release, opts.plugin_dir)
    overlays = build.load_overlay_spec(opts.overlay_spec)
    return release, plugin, overlays


def deploy(inv: Inventory, hosts: list[Host], opts: DeployOptions, confirm=None, out: Printer | None = None) -> dict:
    """Plan every host (read-only), confirm, then roll out. Returns a summary dict (see tasks.release)."""
    out = out or Printer()
    t0 = time.monotonic()
    hosts = [with_mode(h, opts.mode) for h in hosts]
    release, plugin, overlays = build_release(opts)
    build_s = time.monotonic() - t0
    out("local", f"built {plugin.wheel.name} in {build_s:.1f}s (capabilities: "
                 f"{json.dumps(plugin.capabilities, sort_keys=True) if plugin.capabilities else 'none declared'})")
    try:
        return _deploy(inv, hosts, opts, confirm, out, t0, release, plugin, overlays, build_s)
    finally:
        shutil.rmtree(plugin.wheel.parent, ignore_errors=True)


def auto_modes(inv: Inventory, hosts: list[Host], plugin: build.Plugin, out: Printer):
    """`mode: auto` services get the mode and budget `fab bench` measured best (deploy/bench.py says the rule);
    returns the resolved hosts and {host: refusals} for those that could not be."""
    from .. import bench

    def graphs_for(svc, mode):
        return render.decode_cuda_graphs(replace(svc, mode=mode))

    hosts, refused, notes = bench.resolve_auto(inv.path, hosts, plugin.source_digest, graphs_for)
    for n, lines in notes.items():
        for line in lines:
            out(n, line)
    return hosts, refused


def _deploy(inv, hosts, opts, confirm, out, t0, release, plugin, overlays, build_s) -> dict:
    hosts, auto_refused = auto_modes(inv, hosts, plugin, out)
    problems, rendered = [], {}
    for h in hosts:  # every unit and env file renders before any host is touched (and once: the plans use them)
        try:
            rendered[h.name] = build.host_files(h, plugin, overlays)
        except render.RenderError as exc:
            problems.append(str(exc))
    if problems:
        raise build.BuildError("cannot render:\n  " + "\n  ".join(problems))
    plans: dict[str, HostPlan] = {}
    planned = run_per_host(inv, hosts, lambda c, h: plan_host(c, h, plugin, overlays, release, opts,
                                                              rendered[h.name]), label="plan")
    summary = {"release": release, "wheel": plugin.wheel.name, "hosts": {}, "build_seconds": round(build_s, 2)}
    for n, msgs in auto_refused.items():  # refused before its probe: nothing was read, locked or staged
        summary["hosts"][n] = {"ok": False, "error": "; ".join(msgs), "kind": "refused", "phase": "plan"}
        for msg in msgs:
            out(n, f"REFUSED {msg}")
    for r in planned:
        if r.ok:
            plans[r.host] = r.value
        else:
            summary["hosts"][r.host] = {"ok": False, "error": r.error, "kind": r.kind, "phase": "plan"}
    by_name = {h.name: h for h in hosts}
    for n, p in plans.items():
        if p.refused:
            summary["hosts"][n] = {"ok": False, "error": "; ".join(p.refused), "kind": "refused", "phase": "plan",
                                   "coherence": p.coherence}
            for msg in p.refused:
                out(n, f"REFUSED {msg}")
    go = {n: p for n, p in plans.items() if not p.refused}
    for n, p in go.items():
        for w in p.warnings:
            out(n, w)
        what = "unchanged" if p.unchanged else f"{p.current or '(none)'} -> {p.release}"
        rs = ", ".join(f"{i} ({why})" for i, why in p.restart.items()) or "none"
        out(n, f"plan: release {what}; restart: {rs}" + (f"; stop: {', '.join(p.stop)}" if p.stop else ""))
        summary["hosts"].setdefault(n, {}).update(commands=[commands.shown(c) for c in p.commands],
                                                  coherence=p.coherence)
    summary["expected_seconds"] = gateplan.plan(inv.path, go, plugin.source_digest, inv.settings["parallel"],
                                                out)["seconds"]
    if go and confirm is not None and any(not p.unchanged or p.restart for p in go.values()):
        for n, p in go.items():
            for argv in p.commands:
                out(n, "  $ " + commands.shown(argv))
        if not confirm():
            # nothing was locked: the plan only read the hosts
            for n in go:
                summary["hosts"][n] = {"ok": False, "error": "not confirmed", "kind": "aborted", "phase": "plan"}
            summary["aborted"] = True
            return _finish_summary(summary, t0)
    failures = [0]
    fail_lock = threading.Lock()
    max_fail = opts.max_fail if opts.max_fail > 0 else 10 ** 9
    lock = dict(holder(opts.command), mode="once", **({"break": True} if opts.break_lock else {}))

    def one(conn, host):
        with fail_lock:
            skip = failures[0] >= max_fail
        if skip:
            return {"host": host.name, "ok": False, "skipped": True, "error": f"skipped: --max-fail {max_fail} reached"}
        p = go[host.name]
        remote = Remote(conn, host.name)
        data = b""
        if p.payload.get("stage"):
            data = build.bundle(p.release, p.files, p.manifest)
            p.payload["stage"].update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        r = run_host(inv, remote, host, p.payload, dict(lock, journal=f"{render.state_dir(host)}/journal.jsonl"), out,
                     "deploy", data)
        r = dict(r, host=host.name, release=p.release, previous=p.current, unchanged=p.unchanged,
                 service_seconds=round(sum(g.get("seconds", 0) for g in (r.get("gates") or {}).values()), 2))
        if not r["ok"]:
            with fail_lock:
                failures[0] += 1
        return r

    for r in run_per_host(inv, [by_name[n] for n in go], one, label="deploy"):
        summary["hosts"][r.host] = (dict(summary["hosts"].get(r.host, {}), **r.value) if r.ok else
                                    {"ok": False, "error": r.error, "kind": r.kind, "phase": "deploy"})
    return _finish_summary(summary, t0)


def _finish_summary(summary: dict, t0: float) -> dict:
    summary["seconds"] = round(time.monotonic() - t0, 2)
    summary["ok"] = bool(summary["hosts"]) and all(h.get("ok") for h in summary["hosts"].values())
    return summary


def _runbook(inv: Inventory, hosts: list[Host], kind: str, plan_one, command: str, break_lock: bool,
             out: Printer, manifests: bool = False, no_drain: bool = False) -> dict:
    """rollback and restart: probe (read-only) -> pure payload -> one release.apply per host. `manifests`: the
    probe reads every kept release's manifest (a rollback chooses among them; a restart needs the current one)."""
    lock = dict(holder(command), mode="once", **({"break": True} if break_lock else {}))
    t0 = time.monotonic()

    def one(conn, host):
        t = time.monotonic()
        remote = Remote(conn, host.name)
        # no venv trust walk: the activation walks it itself before root runs anything of the venv
        state = probe(remote, host, instances=[s.instance for s in host.services], manifests=manifests,
                      venv_trust=False)
        check_lock(host, state, break_lock)
        if line := interrupted_line(state.get("lock")):
            out(host.name, line)
        res = {"host": host.name, "ok": False, "restarted": [], "release": state.get("current")}
        try:
            payload = plan_one(host, state, out)
        except RuntimeError as exc:
            res.update(error=str(exc), seconds=round(time.monotonic() - t, 2))
            return res
        refused = secrets_refusals(state, [g.get("api_key_file") for b in payload.get("batches") or []
                                           for g in b["gates"].values()])
        restarting = any(b["instances"] for b in payload.get("batches") or [])
        if why := router_refusal(state, restarting, no_drain):
            refused.append(why)
        elif no_drain and restarting:
            out(host.name, NO_DRAIN_WARNING)
        if refused:
            for msg in refused:
                out(host.name, f"REFUSED {msg}")
            res.update(error="; ".join(refused), kind="refused", seconds=round(time.monotonic() - t, 2))
            return res
        # the release the GPUs come back on: a rollback's target, a restart's current one
        gated = (state.get("manifests") or {}).get(payload["journal"].get("release")) or state.get("manifest")
        gateplan.runbook_canaries(inv.path, host, gated, payload, out)
        payload["journal"] = dict(payload["journal"], by=lock["holder"], command=command)
        r = run_host(inv, remote, host, payload, dict(lock, journal=f"{render.state_dir(host)}/journal.jsonl"), out, kind)
        res.update(r, seconds=round(time.monotonic() - t, 2),
                   service_seconds=round(sum(g.get("seconds", 0) for g in (r.get("gates") or {}).values()), 2))
        if not res["ok"] and kind == "rollback" and r.get("failed"):
            res["error"] = "gate failed after rollback on " + ", ".join(r["failed"])
        return res

    summary = {"hosts": {}}
    for r in run_per_host(inv, hosts, one, label=kind):
        summary["hosts"][r.host] = r.value if r.ok else {"ok": False, "error": r.error, "kind": r.kind}
    return _finish_summary(summary, t0)


def rollback(inv: Inventory, hosts: list[Host], to: str | None = None, break_lock: bool = False,
             command: str = "fab rollback", out: Printer | None = None, no_drain: bool = False) -> dict:
    """Re-activate the previous (or named) release on each host through the same gated, drained restart."""
    return _runbook(inv, hosts, "rollback", lambda h, st, o: rollback_payload(h, st, to, o, no_drain), command,
                    break_lock, out or Printer(), manifests=True, no_drain=no_drain)


def restart(inv: Inventory, hosts: list[Host], gpus: list[int] | None = None, break_lock: bool = False,
            command: str = "fab restart", out: Printer | None = None, no_drain: bool = False) -> dict:
    """Gated, drained restart of the current release's services (one batch of max_unavailable at a time)."""
    return _runbook(inv, hosts, "restart", lambda h, st, o: restart_payload(h, st, gpus, no_drain), command,
                    break_lock, out or Printer(), no_drain=no_drain)
