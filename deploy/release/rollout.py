"""Drive releases on hosts: plan (probe + lock), confirm, stage, gated rolling restart, automatic rollback.

Per host, in round trips: probe+lock (1), put bundle (1 sftp), stage+activate (1), one restart+gate per batch
of `max_unavailable` GPUs, and finish (journal, prune, unlock) (1). Hosts run in parallel on
ssh.run_per_host's bounded pool; GPUs within a host go batch by batch. A failing gate stops that host and
re-activates its previous release (wheel, overlays, unit, env files), restarts what was changed and
re-gates it. `--max-fail` stops starting new hosts once that many have failed.
"""
from __future__ import annotations

import base64
import getpass
import io
import json
import os
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..inventory import Host, Inventory
from ..ssh import as_root, open_root_sftp, run_per_host
from . import build, hybrid, render

AGENT_SOURCE = (Path(__file__).parent / "agent.py").read_text()
MARK = "@@AGENT@@"


class AgentError(RuntimeError):
    pass


def agent_argv(op: str, args: dict, python: str = "python3") -> list[str]:
    """The remote command as argv: the agent's source is an argument (no stdin round trip)."""
    return [python, "-c", AGENT_SOURCE, op, base64.b64encode(json.dumps(args).encode()).decode()]


def parse_agent_output(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARK + " "):
            out = json.loads(line[len(MARK) + 1:])
            if not out.get("ok"):
                raise AgentError(out.get("error", "agent failed"))
            return out["result"]
    raise AgentError("no result from the remote agent: " + stdout[-800:])


def call(conn, op: str, args: dict, timeout: float | None = 600) -> dict:
    r = conn.run(as_root(conn, agent_argv(op, args)), hide=True, warn=True, in_stream=False, timeout=timeout)
    try:
        return parse_agent_output(r.stdout)
    except AgentError as exc:
        if r.return_code != 0 and MARK not in r.stdout:
            raise AgentError(f"remote python3 exited {r.return_code}: {(r.stderr or r.stdout)[-800:]}") from None
        raise exc


def host_args(host: Host) -> dict:
    root = host.vars["release_root"]
    return {"root": root, "state_dir": render.state_dir(host), "venv": host.vars["venv"]}


def expect_for(svc) -> dict:
    return {"model": svc.served_model_name or svc.model, "algorithm": render.ALGORITHM[svc.mode]}


def holder(command: str) -> dict:
    return {"holder": f"{getpass.getuser()}@{socket.gethostname()}", "command": command, "pid": os.getpid(),
            "token": uuid.uuid4().hex}


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), max(1, size))]


def changed_services(new: dict, old: dict | None, units: dict, recorded: dict) -> dict[str, str]:
    """instance -> why it must be (re)started; unchanged and running services are left alone."""
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
    return out


# ---------------------------------------------------------------- printing

class Printer:
    """Line-at-a-time output shared by host threads: `[host] message`."""

    def __init__(self, quiet: bool = False):
        self.lock = threading.Lock()
        self.quiet = quiet
        self.lines: list[str] = []

    def __call__(self, host: str, msg: str) -> None:
        line = f"[{host}] {msg}"
        with self.lock:
            self.lines.append(line)
            if not self.quiet:
                print(line, flush=True)


def gate_line(inst: str, port: int, g: dict) -> str:
    if g.get("ok"):
        steps = g.get("steps", {})
        al = g.get("accept_length")
        return (f"{inst} :{port} gate ok in {g.get('seconds', 0):.1f}s (ready {steps.get('ready', 0):.1f}s, "
                f"{g.get('algorithm')}" + (f", accept length {al}" if al is not None else "") + ")")
    out = f"{inst} :{port} gate FAILED at {g.get('step')}: {g.get('detail')}"
    tail = [ln for ln in g.get("journal", []) if ln.strip()][-3:]
    return out + "".join(f"\n      | {ln}" for ln in tail)


# ---------------------------------------------------------------- the deploy

@dataclass
class DeployOptions:
    mode: str | None = None
    allow_hybrid_unsafe: bool = False
    max_fail: int = 1
    break_lock: bool = False
    command: str = "fab deploy"
    plugin_dir: Path = build.DEFAULT_PLUGIN_DIR
    overlay_spec: Path | None = build.DEFAULT_OVERLAY_SPEC


@dataclass
class HostPlan:
    host: Host
    token: str
    release: str
    current: str | None
    manifest: dict
    files: dict
    restart: dict
    stop: list
    refused: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    unchanged: bool = False
    probe: dict = field(default_factory=dict)


def with_mode(host: Host, mode: str | None) -> Host:
    """The host with every service switched to `mode` (the --mode override for the hosts given)."""
    if not mode:
        return host
    from dataclasses import replace
    return replace(host, services=tuple(replace(s, mode=mode) for s in host.services))


def plan_host(conn, host: Host, plugin: build.Plugin, overlays: list[dict], release: str, opts: DeployOptions,
              lock: dict) -> HostPlan:
    models = sorted({s.model for s in host.services if s.mode == "tree-verify" and s.enabled and s.model})
    probe = call(conn, "probe", host_args(host) | {
        "instances": [s.instance for s in host.services], "models": models, "lock_holder": lock,
        "break_lock": opts.break_lock,
        "overlays": [{k: o[k] for k in ("package", "version", "path", "sha256", "new_sha256")} for o in overlays]})
    lr = probe.get("lock_result") or {}
    if not lr.get("ok"):
        h = lr.get("holder") or {}
        raise HostLocked(host.name, h)
    try:
        return _plan_host(host, plugin, overlays, release, opts, lock, probe)
    except Exception:
        call(conn, "finish", host_args(host) | {"token": lock["token"], "keep": 10 ** 6})  # never leave our lock
        raise


def _plan_host(host, plugin, overlays, release, opts, lock, probe) -> HostPlan:
    files, svc = build.host_files(host, plugin, overlays)
    params = {"mode_override": opts.mode, "services": {s.instance: s.mode for s in host.services}}
    manifest = build.make_manifest(release, host, plugin, overlays, files, svc, opts.command, params)
    p = HostPlan(host, lock["token"], release, probe.get("current"), manifest, files, {}, [], probe=probe)
    for o in probe.get("overlays", []):
        if not o["ok"]:
            p.refused.append(f"file overlay {o['path']}: {o['why']}")
    for s in host.services:
        if not s.enabled:
            continue
        if not hybrid.mode_supported(s.mode, plugin.capabilities):
            p.refused.append(f"{s.instance}: the plugin declares modes {plugin.capabilities.get('modes')}, "
                             f"not {s.mode}")
        if s.mode != "tree-verify":
            continue
        c = probe["configs"].get(s.model, {})
        if "error" in c:
            p.refused.append(f"{s.instance}: cannot read the model's config.json for the hybrid check: {c['error']}")
            continue
        verdict, msg = hybrid.decide(s.mode, hybrid.hybrid_reason(c["config"]), plugin.capabilities,
                                     opts.allow_hybrid_unsafe)
        if verdict == "refuse":
            p.refused.append(f"{s.instance}: {msg}")
        elif verdict == "unsafe":
            manifest["unsafe"][s.instance] = msg
            p.warnings.append(f"{s.instance}: WARNING {msg}")
    manifest["allow_hybrid_unsafe"] = bool(manifest["unsafe"])
    old = probe.get("manifest")
    if old and old.get("content_digest") == manifest["content_digest"] and \
            old.get("unsafe", {}) == manifest["unsafe"]:
        p.unchanged = True
        p.release = old["release"]
        p.manifest = old
    p.restart = changed_services(p.manifest, None if p.unchanged else old, probe["units"],
                                 probe.get("services") or {}) if not p.unchanged else \
        changed_services(old, old, probe["units"], probe.get("services") or {})
    if old:
        p.stop = [i for i, s in old.get("services", {}).items()
                  if i not in p.manifest["services"] or not p.manifest["services"][i].get("enabled", True)]
    return p


class HostLocked(RuntimeError):
    def __init__(self, host: str, h: dict):
        age = time.time() - float(h.get("started_ts") or time.time())
        super().__init__(f"locked by {h.get('holder')} running {h.get('command')!r} since {h.get('started')} "
                         f"({age / 60:.1f} min ago, pid {h.get('pid')}); wait, or `--break-lock` if that run is dead")


def restart_batch(conn, host: Host, manifest: dict, insts: list[str], out: Printer, action: str = "restart") -> dict:
    gates = {i: {"port": manifest["services"][i]["port"],
                 "expect": {"model": manifest["services"][i]["served_model_name"] or manifest["services"][i]["model"],
                            "algorithm": manifest["services"][i]["algorithm"]},
                 "digest": manifest["services"][i]["digest"],
                 # where it listens and the host's API-key file (the agent reads the key there; never sent)
                 "address": manifest["services"][i].get("address"),
                 "api_key_file": manifest["services"][i].get("api_key_file")} for i in insts}
    r = call(conn, "restart", host_args(host) | {
        "instances": insts, "gates": gates, "action": action, "release": manifest["release"],
        "start_timeout": host.vars["start_timeout"], "gate_timeout": host.vars["gate_timeout"]},
             timeout=(host.vars["start_timeout"] + host.vars["gate_timeout"] + 30) * len(insts) + 120)
    for i in insts:
        out(host.name, gate_line(i, gates[i]["port"], r["results"][i]))
    return r["results"]


def execute_host(conn, plan: HostPlan, out: Printer) -> dict:
    """Stage, activate and roll the host's changed services; roll back on a failing gate."""
    host, t0 = plan.host, time.monotonic()
    res = {"host": host.name, "release": plan.release, "previous": plan.current, "restarted": [], "ok": True,
           "rolled_back": False, "unchanged": plan.unchanged, "gates": {}}
    journal = {"event": "deploy-noop" if plan.unchanged and not plan.restart else "deploy", "release": plan.release, "previous": plan.current, "by": plan.manifest.get(
        "created_by"), "command": plan.manifest.get("command"), "unsafe": plan.manifest.get("unsafe", {})}
    service_seconds = 0.0
    try:
        if not plan.unchanged:
            t = time.monotonic()
            data = build.bundle(plan.release, plan.files, plan.manifest)
            remote = f"/tmp/ddtree-release-{plan.release}-{plan.token[:8]}.tar.gz"
            sftp = open_root_sftp(conn)
            try:
                sftp.putfo(io.BytesIO(data), remote)
            finally:
                sftp.close()
            act = call(conn, "stage", host_args(host) | {"release": plan.release, "bundle": remote})
            res["stage_seconds"] = round(time.monotonic() - t, 2)
            out(host.name, f"release {plan.release} staged and active ({len(data) // 1024} KiB, wheel "
                           f"{act['steps'].get('wheel')}s, {res['stage_seconds']:.1f}s)")
        if plan.stop:
            call(conn, "stop", host_args(host) | {"instances": plan.stop})
            out(host.name, f"stopped {', '.join(plan.stop)} (removed or disabled)")
        todo = [s.instance for s in host.services if s.instance in plan.restart]
        if not todo:
            out(host.name, "all services up to date; nothing restarted")
        for batch in batches(todo, host.vars["max_unavailable"]):
            t = time.monotonic()
            results = restart_batch(conn, host, plan.manifest, batch, out)
            service_seconds += time.monotonic() - t
            res["gates"].update(results)
            bad = [i for i in batch if not results[i].get("ok")]
            res["restarted"] += batch
            if bad:
                res["ok"] = False
                res["failed"] = bad
                res["error"] = f"gate failed on {', '.join(bad)}: " + "; ".join(
                    f"{results[i].get('step')}: {results[i].get('detail')}" for i in bad)
                rb = rollback_after_failure(conn, plan, res["restarted"], out) if not plan.unchanged else None
                res["rolled_back"] = bool(rb and rb["ok"])
                res["rollback"] = rb
                journal.update(event="deploy-failed", failed=bad, error=res["error"],
                               rolled_back_to=rb and rb.get("release"), rollback_ok=rb and rb["ok"])
                break
    except Exception as exc:
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        journal.update(event="deploy-failed", error=res["error"])
    finally:
        res["seconds"] = round(time.monotonic() - t0, 2)
        res["service_seconds"] = round(service_seconds, 2)
        journal.update(restarted=res["restarted"], seconds=res["seconds"], unchanged=plan.unchanged)
        failed = {"failed_release": plan.release, "failed_why": res.get("error", "")} \
            if not res["ok"] and not plan.unchanged else {}
        fin = call(conn, "finish", host_args(host) | failed | {"journal": journal, "token": plan.token,
                                                     "keep": host.vars["releases_keep"],
                                                     "protect": [p for p in (plan.current,) if p]})
        res["pruned"] = fin["pruned"]
    return res


def rollback_after_failure(conn, plan: HostPlan, touched: list[str], out: Printer) -> dict:
    host, t0 = plan.host, time.monotonic()
    if not plan.current:
        call(conn, "stop", host_args(host) | {"instances": touched})
        out(host.name, f"no previous release to roll back to: stopped {', '.join(touched)}")
        return {"ok": False, "release": None, "detail": "no previous release; services stopped",
                "seconds": round(time.monotonic() - t0, 2)}
    out(host.name, f"rolling back to {plan.current}")
    act = call(conn, "activate", host_args(host) | {"target": plan.current})
    prev = call(conn, "status", host_args(host) | {"journal_n": 0})["manifest"]
    restart = [i for i in touched if i in prev.get("services", {})]
    gone = [i for i in touched if i not in prev.get("services", {})]
    if gone:
        call(conn, "stop", host_args(host) | {"instances": gone})
    ok = True
    for batch in batches(restart, host.vars["max_unavailable"]):
        results = restart_batch(conn, host, prev, batch, out)
        ok = ok and all(r.get("ok") for r in results.values())
    secs = round(time.monotonic() - t0, 2)
    out(host.name, f"rollback to {plan.current} {'ok' if ok else 'FAILED'} in {secs:.1f}s")
    return {"ok": ok, "release": plan.current, "seconds": secs, "activate": act}


def build_release(opts: DeployOptions, release: str | None = None):
    release = release or build.new_release_id()
    plugin = build.build_plugin(release, opts.plugin_dir)
    overlays = build.load_overlay_spec(opts.overlay_spec)
    return release, plugin, overlays


def deploy(inv: Inventory, hosts: list[Host], opts: DeployOptions, confirm=None, out: Printer | None = None) -> dict:
    """Plan on every host (taking locks), confirm, then roll out. Returns a summary dict (see tasks.release)."""
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


def _deploy(inv, hosts, opts, confirm, out, t0, release, plugin, overlays, build_s) -> dict:
    problems = []
    for h in hosts:  # every unit and env file renders before any host is touched
        try:
            build.host_files(h, plugin, overlays)
        except render.RenderError as exc:
            problems.append(str(exc))
    if problems:
        raise build.BuildError("cannot render:\n  " + "\n  ".join(problems))
    lock = holder(opts.command)
    plans: dict[str, HostPlan] = {}
    planned = run_per_host(inv, hosts, lambda c, h: plan_host(c, h, plugin, overlays, release, opts, lock),
                           label="plan")
    summary = {"release": release, "wheel": plugin.wheel.name, "hosts": {}, "build_seconds": round(build_s, 2)}
    for r in planned:
        if r.ok:
            plans[r.host] = r.value
        else:
            summary["hosts"][r.host] = {"ok": False, "error": r.error, "kind": r.kind, "phase": "plan"}
    by_name = {h.name: h for h in hosts}

    def unlock_all(names):
        run_per_host(inv, [by_name[n] for n in names],
                     lambda c, h: call(c, "finish", host_args(h) | {"token": lock["token"], "keep": 10 ** 6}))

    refused = {n: p for n, p in plans.items() if p.refused}
    for n, p in refused.items():
        summary["hosts"][n] = {"ok": False, "error": "; ".join(p.refused), "kind": "refused", "phase": "plan"}
        for msg in p.refused:
            out(n, f"REFUSED {msg}")
    if refused:
        unlock_all(list(refused))
    go = {n: p for n, p in plans.items() if not p.refused}
    for n, p in go.items():
        for w in p.warnings:
            out(n, w)
        what = "unchanged" if p.unchanged else f"{p.current or '(none)'} -> {p.release}"
        rs = ", ".join(f"{i} ({why})" for i, why in p.restart.items()) or "none"
        out(n, f"plan: release {what}; restart: {rs}" + (f"; stop: {', '.join(p.stop)}" if p.stop else ""))
    if go and confirm is not None and any(not p.unchanged or p.restart for p in go.values()):
        if not confirm():
            unlock_all(list(go))
            for n in go:
                summary["hosts"][n] = {"ok": False, "error": "not confirmed", "kind": "aborted", "phase": "plan"}
            summary["aborted"] = True
            return _finish_summary(summary, t0)
    failures = [0]
    fail_lock = threading.Lock()
    max_fail = opts.max_fail if opts.max_fail > 0 else 10 ** 9
    # only rollout failures count toward --max-fail (refused and unreachable hosts are reported above)

    def one(conn, host):
        with fail_lock:
            skip = failures[0] >= max_fail
        if skip:
            call(conn, "finish", host_args(host) | {"token": lock["token"], "keep": 10 ** 6})
            return {"host": host.name, "ok": False, "skipped": True,
                    "error": f"skipped: --max-fail {max_fail} reached"}
        r = execute_host(conn, go[host.name], out)
        if not r["ok"]:
            with fail_lock:
                failures[0] += 1
        return r

    for r in run_per_host(inv, [by_name[n] for n in go], one, label="deploy"):
        summary["hosts"][r.host] = r.value if r.ok else {"ok": False, "error": r.error, "kind": r.kind,
                                                         "phase": "deploy"}
    return _finish_summary(summary, t0)


def _finish_summary(summary: dict, t0: float) -> dict:
    summary["seconds"] = round(time.monotonic() - t0, 2)
    summary["ok"] = bool(summary["hosts"]) and all(h.get("ok") for h in summary["hosts"].values())
    return summary


# ---------------------------------------------------------------- rollback and restart

def rollback(inv: Inventory, hosts: list[Host], to: str | None = None, break_lock: bool = False,
             command: str = "fab rollback", out: Printer | None = None) -> dict:
    """Re-activate the previous (or named) release on each host through the same gated restart."""
    out = out or Printer()
    lock = holder(command)
    t0 = time.monotonic()

    def one(conn, host):
        t = time.monotonic()
        probe = call(conn, "probe", host_args(host) | {"instances": [s.instance for s in host.services],
                                                       "lock_holder": lock, "break_lock": break_lock})
        if not probe["lock_result"]["ok"]:
            raise HostLocked(host.name, probe["lock_result"]["holder"])
        cur, rels = probe["current"], probe["releases"]
        journal = {"event": "rollback", "previous": cur, "by": lock["holder"], "command": command}
        res = {"host": host.name, "previous": cur, "ok": False, "restarted": []}
        try:
            if to:
                if to not in rels:
                    raise RuntimeError(f"release {to} is not on {host.name} (kept: {', '.join(rels) or 'none'})")
                target = to
            else:
                bad = set(probe.get("failed") or [])
                older = [r for r in rels if (cur is None or r < cur) and r not in bad]
                if not older:
                    raise RuntimeError(f"no good release older than {cur} on {host.name} (kept: {', '.join(rels)}"
                                       + (f"; failed: {', '.join(sorted(bad))}" if bad else "") + ")")
                target = older[-1]
            res["release"] = journal["release"] = target
            out(host.name, f"rollback {cur} -> {target}")
            call(conn, "activate", host_args(host) | {"target": target})
            man = call(conn, "status", host_args(host) | {"journal_n": 0})["manifest"]
            old = probe.get("manifest") or {}
            todo = [i for i, s in man["services"].items() if s.get("enabled", True) and (
                (old.get("services", {}).get(i) or {}).get("digest") != s["digest"]
                or (probe["units"].get(i) or {}).get("ActiveState") not in ("active", "activating"))]
            stop = [i for i in old.get("services", {}) if i not in man["services"]]
            if stop:
                call(conn, "stop", host_args(host) | {"instances": stop})
            ok = True
            res["service_seconds"] = 0.0
            for batch in batches(sorted(todo, key=lambda s: (len(s), s)), host.vars["max_unavailable"]):
                tb = time.monotonic()
                results = restart_batch(conn, host, man, batch, out)
                res["service_seconds"] += round(time.monotonic() - tb, 2)
                res["restarted"] += batch
                ok = ok and all(r.get("ok") for r in results.values())
                if not ok:
                    res["error"] = "gate failed after rollback on " + ", ".join(
                        i for i, r in results.items() if not r.get("ok"))
                    break
            if not todo:
                out(host.name, "no service differs between the releases; nothing restarted")
            res["ok"] = ok
        except Exception as exc:
            res["error"] = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError) else str(exc)
        finally:
            res["seconds"] = round(time.monotonic() - t, 2)
            journal.update(ok=res["ok"], restarted=res["restarted"], seconds=res["seconds"],
                           error=res.get("error"))
            call(conn, "finish", host_args(host) | {"journal": journal, "token": lock["token"],
                                                   "keep": host.vars["releases_keep"],
                                                   "protect": [p for p in (cur,) if p]})
        return res

    summary = {"hosts": {}}
    for r in run_per_host(inv, hosts, one, label="rollback"):
        summary["hosts"][r.host] = r.value if r.ok else {"ok": False, "error": r.error, "kind": r.kind}
    return _finish_summary(summary, t0)


def restart(inv: Inventory, hosts: list[Host], gpus: list[int] | None = None, break_lock: bool = False,
            command: str = "fab restart", out: Printer | None = None) -> dict:
    """Gated restart of the current release's services (one batch of max_unavailable at a time)."""
    out = out or Printer()
    lock = holder(command)
    t0 = time.monotonic()

    def one(conn, host):
        t = time.monotonic()
        probe = call(conn, "probe", host_args(host) | {"lock_holder": lock, "break_lock": break_lock})
        if not probe["lock_result"]["ok"]:
            raise HostLocked(host.name, probe["lock_result"]["holder"])
        res = {"host": host.name, "ok": False, "restarted": [], "release": probe["current"]}
        try:
            man = probe.get("manifest")
            if not man:
                raise RuntimeError(f"no active release on {host.name}; run fab deploy first")
            insts = [i for i, s in man["services"].items() if s.get("enabled", True)
                     and (gpus is None or s["gpu"] in gpus)]
            ok = True
            for batch in batches(sorted(insts, key=lambda s: (len(s), s)), host.vars["max_unavailable"]):
                results = restart_batch(conn, host, man, batch, out)
                res["restarted"] += batch
                if not all(r.get("ok") for r in results.values()):
                    ok = False
                    res["error"] = "gate failed on " + ", ".join(i for i, r in results.items() if not r.get("ok"))
                    break
            res["ok"] = ok
        except Exception as exc:
            res["error"] = str(exc)
        finally:
            res["seconds"] = round(time.monotonic() - t, 2)
            call(conn, "finish", host_args(host) | {"token": lock["token"], "keep": host.vars["releases_keep"],
                                                   "journal": {"event": "restart", "release": probe["current"],
                                                               "by": lock["holder"], "ok": res["ok"],
                                                               "restarted": res["restarted"],
                                                               "error": res.get("error")}})
        return res

    summary = {"hosts": {}}
    for r in run_per_host(inv, hosts, one, label="restart"):
        summary["hosts"][r.host] = r.value if r.ok else {"ok": False, "error": r.error, "kind": r.kind}
    return _finish_summary(summary, t0)
