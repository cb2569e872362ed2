"""Drive releases on hosts: plan (read-only probe), confirm, then one transactional agent call per host.

Per host: `release.probe` (1 call, read-only, no lock) gives what the plan needs; the plan is pure (which GPUs
restart and why, the commands as argv, the rollback) and printed; after confirmation one `release.apply` call
(under the host lock, taken and released by that call) stages the bundle (sent on the call's stdin), activates
the release as one transaction, stops removed services and restarts the changed ones `max_unavailable` at a
time through the health gate, and -- on any failure after activation began -- re-activates the previous
release and restarts what it touched. The host's agent runs that to the end even if this machine or the link
goes away; the outcome is journaled with the run's token, and read back (release.outcome) after a lost link.
Hosts run in parallel on ssh.run_per_host's bounded pool; `--max-fail` stops starting new hosts.
deploy, rollback and restart share that one skeleton (run_host) and one batch builder (restart_batch).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import contract
from .. import facts as factsmod
from ..inventory import Host, Inventory
from ..remote import commands
from ..remote.client import AgentError, LinkLost, Remote
from ..remote.client import lock_holder as holder  # noqa: F401 (rollout.holder: tests use it)
from ..ssh import open_checked, run_per_host
from . import build, gateplan, hostfit, hybrid, render
from . import router as routermod
from .layout import host_args  # noqa: F401 (rollout.host_args: callers and tests use it)

PROBE_DEADLINE = 120.0
SILENCE = 45.0          # heartbeats come every 10 s: this long without a word means the link is gone
SYSTEMCTL_RESTART = commands.systemctl("restart", (), "--no-block")
SYSTEMCTL_RESET = commands.systemctl("reset-failed")
SYSTEMCTL_STOP = commands.systemctl("stop")
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


# ---------------------------------------------------------------- commands, built pure

def restart_batch(manifest: dict, insts: list[str], drain: bool = True, previous: dict | None = None) -> dict:
    """One batch: the systemctl commands that restart `insts` together and what each one's gate expects: where
    the service listens and the host's API-key file (the agent reads the key there; the key never travels); with
    the host's router (and `drain`), how the agent takes them out of it first (at their `previous` release's url
    too, when their port changes) and puts them back after."""
    units = [render.unit_name(i) for i in insts]
    return {"instances": list(insts), "reset_failed": SYSTEMCTL_RESET + units, "restart": SYSTEMCTL_RESTART + units,
            "gates": {i: gate(manifest["services"][i]) for i in insts},
            "drain": routermod.drain_spec(manifest, previous=previous) if drain else None}


def gate(svc: dict) -> dict:
    """What a service's health gate checks, from its manifest entry."""
    return {"port": svc["port"], "digest": svc["digest"],
            "expect": {"model": svc.get("served_model_name") or svc["model"], "algorithm": svc["algorithm"]},
            "address": svc.get("address"), "api_key_file": svc.get("api_key_file")}


def restart_batches(host: Host, manifest: dict, insts: list[str], drain: bool = True,
                    previous: dict | None = None) -> list[dict]:
    """`insts` in batches of the host's max_unavailable (what deploy, rollback and restart send)."""
    out = [restart_batch(manifest, b, drain, previous) for b in batches(insts, host.vars["max_unavailable"])]
    for b in out:  # each gate's start timeout from its service's expected start (deploy/startup.py)
        gateplan.timed_gates(b["gates"], host, manifest)
    return out


def router_spec(manifest: dict | None) -> dict | None:
    """What brings the manifest's router up before any GPU restarts (the agent restarts it only when its digest
    differs from the one it runs, or it is down): None without one."""
    r = (manifest or {}).get("router") or {}
    if not r.get("enabled"):
        return None
    return {"digest": r["digest"], "address": r["address"], "port": r["port"],
            "reset_failed": SYSTEMCTL_RESET + [r["unit"]], "restart": commands.systemctl("restart", [r["unit"]])}


def router_refusal(state: dict, restarting: bool, no_drain: bool) -> str | None:
    """A host whose router should be running but is not cannot drain its GPUs: refused at the plan (unless
    --no-drain, or nothing restarts)."""
    r = state.get("router") or {}
    if not restarting or no_drain or not r.get("expected") or r.get("alive"):
        return None
    return (f"router: sglang-router.service is down ({r.get('detail')}): its GPUs cannot be drained before they "
            "restart. Start it (`systemctl start sglang-router` on the host; `fab logs` says why it stopped), or run "
            "again with --no-drain to restart without draining (requests in flight are cut)")


def stop_spec(insts: list[str], manifest: dict | None = None, old: dict | None = None, drain: bool = True) -> dict:
    """Stop services a release no longer runs; with the new release's router, drained out of it first (their
    ports are the `old` release's)."""
    spec = {"instances": insts, "argv": SYSTEMCTL_STOP + [render.unit_name(i) for i in insts]}
    gone = {i: (old or {}).get("services", {}).get(i) for i in insts}
    if drain and manifest and all(gone.values()) and (d := routermod.drain_spec(manifest, gone)):
        spec["drain"] = d
        spec["servers"] = {i: [s["port"], s.get("address") or "127.0.0.1"] for i, s in gone.items()}
    return spec


def activation(host: Host, manifest: dict, previous: dict | None) -> dict:
    """What makes `manifest`'s release active on `host`, and the command that puts the venv's plugin back the way
    it was if the transaction has to be undone (the previous release's wheel, or no plugin)."""
    root, py = host.vars["release_root"], commands.venv_python(host.vars["venv"])
    rid = manifest["release"]
    enabled = [render.unit_name(i) for i, s in manifest["services"].items() if s.get("enabled", True)]
    disabled = [render.unit_name(i) for i, s in manifest["services"].items() if not s.get("enabled", True)]
    undo = (commands.pip_install(py, [f"{root}/{previous['release']}/{previous['plugin']['wheel']}"]) if previous
            else commands.pip_uninstall(py, [manifest["plugin"]["dist"]]))
    r = manifest.get("router") or {}
    if r.get("enabled"):
        enabled.append(r["unit"])
    elif ((previous or {}).get("router") or {}).get("enabled"):
        # router switched off: stopped and disabled with the activation (the GPUs then listen on listen_address)
        disabled.append(previous["router"]["unit"])
    return {"release": rid, "dropin_name": render.GPU_DROPIN, "router_venv": router_venv(manifest, root),
            "commands": {
        "install_plugin": commands.pip_install(py, [f"{root}/{rid}/{manifest['plugin']['wheel']}"]),
        "undo_plugin": undo,
        "daemon_reload": commands.systemctl("daemon-reload"),
        "enable": commands.systemctl("enable", enabled, "--quiet") if enabled else None,
        "disable": commands.systemctl("disable", disabled, "--now", "--quiet") if disabled else None}}


def router_venv(manifest: dict, root: str) -> dict | None:
    """How the agent builds the router's venv when the host has none for this wheel (from the wheel the release
    carries then: make_plan adds it)."""
    r = manifest.get("router") or {}
    if not r.get("enabled"):
        return None
    tmp = r["venv"] + ".tmp"
    return {"path": r["venv"], "wheel": r["wheel"]["path"], "sha256": r["wheel"]["sha256"],
            "commands": {"venv": [render.SYSTEM_PYTHON, "-m", "venv", tmp],
                         "install": commands.pip_install(commands.venv_python(tmp),
                                                         [f"{root}/{manifest['release']}/{r['wheel']['path']}"])}}


def rollback_spec(host: Host, previous: dict | None, current: dict) -> dict:
    """What the host does when something fails after activation began: re-activate `previous` (whose own undo
    puts `current`'s plugin back) and restart the touched services in batches; with no previous release, stop
    them."""
    return {"activate": activation(host, previous, current) if previous else None, "stop": SYSTEMCTL_STOP,
            "reset_failed": SYSTEMCTL_RESET, "restart": SYSTEMCTL_RESTART,
            "max_unavailable": host.vars["max_unavailable"],
            "gates": gateplan.timed_gates({i: gate(s) for i, s in (previous or {}).get("services", {}).items()},
                                          host, previous),
            "drain": routermod.drain_spec(previous, previous=current) if previous else None,
            "router": router_spec(previous)}


def apply_commands(payload: dict) -> list[list[str]]:
    """Every command a release.apply payload runs, in order (what the confirmation shows)."""
    out = []
    act = payload.get("activate")
    if act:
        c = act["commands"]
        if act.get("router_venv"):  # only where the host has no venv for the router's wheel yet
            out += [act["router_venv"]["commands"]["venv"], act["router_venv"]["commands"]["install"]]
        out += [c["install_plugin"], c["daemon_reload"]] + [c[k] for k in ("enable", "disable") if c.get(k)]
    if payload.get("router"):  # only when what the router runs changed, or it is down
        out.append(payload["router"]["restart"])
    if payload.get("stop"):
        out.append(payload["stop"]["argv"])
    for b in payload.get("batches") or []:
        out.append(b["restart"])
    return out


def _timeouts(host: Host) -> dict:
    return {"start_timeout": host.vars["start_timeout"], "gate_timeout": host.vars["gate_timeout"]}


def apply_deadline(host: Host, payload: dict) -> float:
    """A bound on one release.apply: the bundle, pip, each batch's gates -- twice when it may roll back."""
    drain = (host.vars.get("router") or {}).get("drain_timeout", 0) if routermod.enabled(host) else 0
    per = host.vars["start_timeout"] + host.vars["gate_timeout"] + 60 + drain
    restarts = sum(len(b["instances"]) for b in payload.get("batches") or [])
    once = 900 + per * max(1, restarts) + (payload.get("stage") or {}).get("size", 0) / 1e6
    return 120 + once * (2 if payload.get("rollback") else 1)


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


def canary_text(c: dict | None) -> str:
    """What a passed canary showed, for the gate's line."""
    if not isinstance(c, dict):
        return ""
    return (f", canary {c.get('tokens')} tokens"
            + (f" within {c['max_gap']} nats of the argmax" if c.get("max_gap") is not None else "")
            + (f", floor {c['accept_floor']}" if c.get("accept_floor") is not None else ""))


def gate_line(inst: str, port: int, g: dict) -> str:
    if g.get("ok"):
        steps = g.get("steps", {})
        al = g.get("accept_length")
        return (f"{inst} :{port} gate ok in {g.get('seconds', 0):.1f}s (ready {steps.get('ready', 0):.1f}s, "
                f"{g.get('algorithm')}" + (f", accept length {al}" if al is not None else "")
                + canary_text(g.get("canary")) + ")")
    out = f"{inst} :{port} gate FAILED at {g.get('step')}: {g.get('detail')}"
    tail = [ln for ln in g.get("journal", []) if ln.strip()][-3:]
    return out + "".join(f"\n      | {ln}" for ln in tail)


def drain_line(ev: dict, what: str | None = None, then: str = "restarting") -> str:
    """One drain's line: a GPU's (or `what`: a worker the release does not name) out of the router and its wait;
    an unknown reading (a server that does not answer /metrics) waits to the deadline and says so."""
    inst, first, n = what or ev["instance"], ev.get("in_flight_at_start"), ev.get("in_flight")
    where = "out of the router" if ev.get("removed") else "not in the router"
    if ev.get("previous_url"):
        where += (f" (and its old worker {ev['previous_url']}" if ev.get("previous_removed") else
                  f" (its old worker {ev['previous_url']} was not listed") + ")"
    if ev.get("timed_out") and n is None:
        return (f"{inst} {where}; DRAIN DEADLINE passed after {ev.get('seconds', 0):.1f}s with its in-flight requests "
                f"unknown ({ev.get('detail')}): {then} anyway (any it holds are cut)")
    if ev.get("timed_out"):
        return (f"{inst} {where}; DRAIN DEADLINE passed after {ev.get('seconds', 0):.1f}s with {n} request(s) still "
                f"in flight: {then} anyway (they are cut)")
    return f"{inst} {where}; drained {first or 0} in-flight request(s) in {ev.get('seconds', 0):.1f}s"


def event_printer(host: str, out: Printer, kind: str):
    """Turn the agent's events into the run's lines."""
    def on_event(ev: dict) -> None:
        e = ev.get("event")
        if e == "activated" and kind == "deploy" and ev.get("bundle"):
            out(host, f"release {ev['release']} staged and active ({ev['bundle'] // 1024} KiB, "
                      f"{(ev.get('stage_seconds') or 0) + ev.get('seconds', 0):.1f}s)")
        elif e == "activated":
            out(host, f"release {ev['release']} active ({ev.get('seconds', 0):.1f}s)")
        elif e == "stopped":
            out(host, f"stopped {', '.join(ev['instances'])} (removed or disabled)")
        elif e == "gate":
            out(host, gate_line(ev["instance"], ev["port"], ev["gate"]))
            g = ev["gate"]
            if g.get("ok") and g.get("router"):
                out(host, f"{ev['instance']} back in the router (warm-up {g.get('warmup', {}).get('seconds', 0):.2f}s, "
                          f"healthy in {g['router'].get('seconds', 0):.1f}s)")
        elif e == "drain":
            out(host, drain_line(ev))
        elif e == "stray":
            out(host, drain_line(ev, f"router worker {ev.get('url')} is not in the inventory:", "removed"))
        elif e == "note" and ev.get("message") == "prune-failed":
            out(host, f"WARNING could not read the router's workers to remove those the inventory does not name "
                      f"({ev.get('detail')})")
        elif e == "interrupted":
            out(host, f"took over the lock of an interrupted run ({ev.get('holder')}, {ev.get('command')!r}, since "
                      f"{ev.get('started')}; stopped at step {ev.get('step')!r}; out of the router: "
                      f"{', '.join(ev.get('out') or []) or 'none'}): journaled as interrupted")
        elif e == "note" and ev.get("message") == "drain-failed":
            out(host, f"WARNING could not drain before stopping ({ev.get('detail')}): stopping anyway")
        elif e == "router" and ev.get("phase") == "restarted":
            out(host, f"sglang-router (re)started in {ev.get('seconds', 0):.1f}s")
        elif e == "note" and ev.get("message") == "nothing-restarted":
            out(host, "all services up to date; nothing restarted" if kind != "rollback"
                else "no service differs between the releases; nothing restarted")
        elif e == "rollback" and ev.get("phase") == "start":
            out(host, f"rolling back to {ev['release']}")
        elif e == "rollback" and ev.get("phase") == "done":
            out(host, f"rollback to {ev['release']} {'ok' if ev.get('ok') else 'FAILED'} in {ev['seconds']:.1f}s")
        elif e == "rollback" and ev.get("phase") == "none":
            out(host, f"no previous release to roll back to: stopped {', '.join(ev.get('instances') or [])}")
    return on_event


# ---------------------------------------------------------------- one skeleton for every change

class HostLocked(RuntimeError):
    def __init__(self, h: dict):
        age = time.time() - float(h.get("started_ts") or time.time())
        super().__init__(f"locked by {h.get('holder')} running {h.get('command')!r} since {h.get('started')} "
                         f"({age / 60:.1f} min ago, pid {h.get('pid')}); wait, or `--break-lock` if that run is dead")


def probe(remote: Remote, host: Host, **extra) -> dict:
    """The host's release state, read-only; it also checks the secrets env file and the API-key files (the
    inventory's and those of the manifests it reads) as the unit's start check will."""
    keyfile = host.vars.get("api_key_file")
    return remote.call("release.probe", host_args(host) | {"api_key_files": [keyfile] if keyfile else []} | extra,
                       deadline=PROBE_DEADLINE)


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


def check_lock(host: Host, state: dict, break_lock: bool) -> None:
    """A plan refuses a host another live run holds (the apply would refuse it anyway)."""
    lk = state.get("lock")
    if lk and not break_lock and not lk.get("stale"):
        raise HostLocked(lk)


def run_host(inv: Inventory, remote: Remote, host: Host, payload: dict, lock: dict, out: Printer, kind: str,
             data: bytes = b"") -> dict:
    """One release.apply call: the transaction runs on the host; its events print as they come. A lost link is
    followed by reading the outcome from the host's journal once it answers again."""
    last: list[str] = []

    def tee(name: str, msg: str) -> None:  # the host's last line: what its agent last reported
        last[:] = [msg]
        out(name, msg)
    on_event = event_printer(host.name, tee, kind)
    try:
        return remote.call("release.apply", payload, deadline=apply_deadline(host, payload), lock=lock, data=data,
                           on_event=on_event, silence=SILENCE)
    except AgentError as exc:
        if exc.kind == "locked":
            raise HostLocked(exc.reply.get("holder") or {}) from None
        if exc.kind == "no-reply":  # the agent process died (killed) while the link stayed up
            how = exc.message.removeprefix("the agent gave no answer ")
            raise AgentError("agent-died", f"the host's agent died during {kind} without an answer {how}; its last "
                                           f"report: {last[0] if last else 'none (it died before its first step)'}. "
                                           f"The host may be left mid-{kind}: `fab status` shows what is out; the "
                                           f"next deploy, restart or rollback of it finishes it first") from None
        if not isinstance(exc, LinkLost):
            raise
        out(host.name, f"LINK LOST during {kind}: {exc.message}; the host's agent finishes or rolls back on its own")
        return outcome_after_loss(inv, host, lock["token"], exc.message)


def outcome_after_loss(inv: Inventory, host: Host, token: str, why: str, wait: float = 120.0) -> dict:
    """Reconnect and read what the host did with the run `token` (its journal entry), for up to `wait` s."""
    end = time.monotonic() + wait
    last = why
    while time.monotonic() < end:
        conn = None
        try:
            conn = open_checked(inv, host)
            r = Remote(conn, host.name).call("release.outcome", host_args(host) | {"token": token},
                                                               deadline=30)
            if r.get("entry") and not r.get("running"):
                j = r["entry"]
                return {"ok": bool(j.get("ok")), "error": f"link lost ({why}); on the host: {j.get('event')}"
                        + (f": {j.get('error')}" if j.get("error") else ""), "restarted": j.get("restarted") or [],
                        "rolled_back": bool(j.get("rollback_ok")),
                        "rollback": {"release": j.get("rolled_back_to"), "ok": j.get("rollback_ok"),
                                     "seconds": j.get("rollback_seconds") or 0} if j.get("rolled_back_to") else None,
                        "link_lost": True, "journal": j}
            last = "still running on the host"
        except Exception as exc:  # still unreachable: try again until `wait` is over
            last = f"{type(exc).__name__}: {exc}"
        finally:
            if conn is not None:
                conn.close()
        time.sleep(3)
    return {"ok": False, "link_lost": True, "restarted": [],
            "error": f"link lost ({why}); outcome unknown ({last}): the host's agent finishes or rolls back on its "
                     f"own and journals it -- `fab status --history 5` shows it once the host answers"}


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
    no_drain: bool = False


@dataclass
class HostPlan:
    host: Host
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
    payload: dict = field(default_factory=dict)
    coherence: dict = field(default_factory=dict)

    @property
    def commands(self) -> list[list[str]]:
        return apply_commands(self.payload)


def with_mode(host: Host, mode: str | None) -> Host:
    """The host with every service switched to `mode` (the --mode override for the hosts given)."""
    if not mode:
        return host
    return replace(host, services=tuple(replace(s, mode=mode) for s in host.services))


def plan_host(conn, host: Host, plugin: build.Plugin, overlays: list[dict], release: str, opts: DeployOptions,
              rendered: tuple | None = None) -> HostPlan:
    """Read the host (no lock) and plan it (`rendered`: its build.host_files, when already made)."""
    remote = Remote(conn, host.name)
    models = sorted({s.model for s in host.services if s.mode == contract.TREE_VERIFY and s.enabled and s.model}
                    # a TP group's model and drafter: their attention heads against tp (hostfit.tp_refusals)
                    | {m for s in host.services if s.enabled and s.tp > 1 for m in (s.model, s.draft_model) if m})
    state = probe(remote, host, instances=[s.instance for s in host.services], models=models,
                  overlays=[{k: o[k] for k in ("package", "version", "path", "sha256", "new_sha256")}
                            for o in overlays],
                  facts={"budget": factsmod.PROBE_BUDGET, "import_torch": False}, **hostfit.probe_args(host))
    check_lock(host, state, opts.break_lock)
    return make_plan(host, plugin, overlays, release, opts, state, rendered)


def coherence_preflight(host: Host, state: dict, caps: dict) -> tuple[list[str], list[str], dict]:
    """Coherence before change, from the facts the plan's probe read (state["facts"]) and the capabilities of
    the plugin being deployed: (refusals, warnings, the verdicts for the summary). Refused: an SGLang version
    the plugin does not support, unmet pins among sglang / sglang-kernel / torch / flashinfer-python, native
    extensions SGLang loads at startup (sgl_kernel's common_ops for the host's GPU arch) that do not resolve
    against the host's torch, and facts that did not come back (never assumed fine)."""
    from .. import coherence
    raw = state.get("facts")
    if raw is None:
        return ["coherence: not checked (the host's probe returned no facts)"], [], {}
    facts = factsmod.build_facts(host.name, raw)
    refused, warnings = coherence.deploy_refusals(facts.get("venv"), caps)
    refused += coherence.tree_graph_refusal(facts.get("venv"), caps,
                                            [s for s in host.services if s.enabled and s.mode == contract.TREE_VERIFY
                                             and render.decode_cuda_graphs(s)])
    summary = {"refused": refused, "warnings": warnings, "pip_check": (facts.get("coherence") or {}).get("pip_check"),
               "sglang": (facts.get("packages") or {}).get("sglang"),
               "gpu_archs": sorted({g["sm"] for g in ((facts.get("nvidia") or {}).get("gpus") or []) if g.get("sm")})}
    return refused, warnings, summary


def make_plan(host, plugin, overlays, release, opts, state, rendered: tuple | None = None) -> HostPlan:
    """The pure plan of one host from what its probe saw."""
    files, svc = rendered or build.host_files(host, plugin, overlays)
    r = svc.get("router") or {}
    if r.get("enabled") and Path(r["venv"]).name not in (state.get("router") or {}).get("venvs", []):
        # the host has no venv for this router wheel: this release carries the wheel (once per host and version)
        files = dict(files, **{r["wheel"]["path"]: routermod.wheel().path.read_bytes()})
    params = {"mode_override": opts.mode, "services": {s.instance: s.mode for s in host.services},
              "auto": {s.instance: s.auto for s in host.services if s.auto}}
    manifest = build.make_manifest(release, host, plugin, overlays, files, svc, opts.command, params)
    p = HostPlan(host, release, state.get("current"), manifest, files, {}, [], probe=state)
    p.refused, p.warnings, p.coherence = coherence_preflight(host, state, plugin.capabilities)
    fit_refused, fit_warnings = hostfit.refusals(host, state)  # GPUs, ports, model paths vs the host
    p.refused += fit_refused
    p.warnings += fit_warnings
    if state.get("venv_trust") not in (None, "ok"):
        p.refused.append(f"venv {host.vars['venv']}: root will not run it: {state['venv_trust']}")
    p.refused += secrets_refusals(state, [host.vars.get("api_key_file")])
    for o in state.get("overlays", []):
        if not o["ok"]:
            p.refused.append(f"file overlay {o['path']}: {o['why']}")
    for s in host.services:
        if not s.enabled:
            continue
        if not hybrid.mode_supported(s.mode, plugin.capabilities):
            p.refused.append(f"{s.instance}: the plugin declares modes {plugin.capabilities.get('modes')}, "
                             f"not {s.mode}")
        if s.mode != contract.TREE_VERIFY:
            continue
        c = state["configs"].get(s.model, {})
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
    old = state.get("manifest")
    if old and old.get("content_digest") == manifest["content_digest"] and \
            old.get("unsafe", {}) == manifest["unsafe"]:
        p.unchanged, p.release, p.manifest = True, old["release"], old
    units, recorded = state.get("units") or {}, state.get("services") or {}
    health, inrouter = state.get("health"), routed(old, state.get("router_view"))
    p.restart = changed_services(old, old, units, recorded, health, inrouter) if p.unchanged else \
        changed_services(p.manifest, old, units, recorded, health, inrouter)
    if line := interrupted_line(state.get("lock")):
        p.warnings.insert(0, line)
    if old:
        p.stop = [i for i, s in old.get("services", {}).items()
                  if i not in p.manifest["services"] or not p.manifest["services"][i].get("enabled", True)]
    if why := router_refusal(state, bool(p.restart), opts.no_drain):
        p.refused.append(why)
    elif opts.no_drain and p.restart:
        p.warnings.append(NO_DRAIN_WARNING)
    p.payload = deploy_payload(p, opts)
    return p


def out_first(insts: list[str], why: dict) -> list[str]:
    """The GPUs already out of the router first: restarting them costs no capacity (as a rollback does)."""
    return [i for i in insts if why.get(i) == "out of the router"] + \
        [i for i in insts if why.get(i) != "out of the router"]


def deploy_payload(p: HostPlan, opts: DeployOptions) -> dict:
    """The release.apply arguments of a planned host (its bundle travels as the call's data)."""
    host, old = p.host, p.probe.get("manifest")
    todo = out_first([s.instance for s in host.services if s.instance in p.restart], p.restart)
    payload = host_args(host) | _timeouts(host) | {
        "expect_current": p.current, "keep": host.vars["releases_keep"],
        "protect": [x for x in (p.current,) if x],
        "batches": restart_batches(host, p.manifest, todo, drain=not opts.no_drain, previous=old),
        "prune": None if opts.no_drain else routermod.drain_spec(p.manifest),
        "journal": {"event": "deploy-noop" if p.unchanged and not p.restart else "deploy", "release": p.release,
                    "previous": p.current, "by": p.manifest.get("created_by"), "command": p.manifest.get("command"),
                    "unsafe": p.manifest.get("unsafe", {}), "unchanged": p.unchanged},
        "fail_event": "deploy-failed"}
    if p.stop:
        payload["stop"] = stop_spec(p.stop, p.manifest, old, drain=not opts.no_drain)
    if rs := router_spec(p.manifest):  # also with --no-drain: a changed or stopped router is (re)started
        payload["router"] = rs
    if not p.unchanged:
        payload["stage"] = {"release": p.release, "user": {"name": host.vars["service_user"],
                                                           "useradd": commands.useradd(host.vars["service_user"])}}
        payload["activate"] = activation(host, p.manifest, old)
        rv = payload["activate"]["router_venv"]
        if rv and Path(rv["path"]).name in (p.probe.get("router") or {}).get("venvs", []):
            payload["activate"]["router_venv"] = None  # the host has it: nothing to build (nor to show)
        payload["rollback"] = rollback_spec(host, old, p.manifest)
        if opts.no_drain:
            payload["rollback"]["drain"] = None
    return payload


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


# ---------------------------------------------------------------- rollback and restart

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


def rollback_payload(host: Host, state: dict, to: str | None, out: Printer, no_drain: bool = False) -> dict:
    cur, rels = state.get("current"), state.get("releases") or []
    target = rollback_target(cur, rels, state.get("failed"), to, host.name)
    out(host.name, f"rollback {cur} -> {target}")
    mans = state.get("manifests") or {}
    man, old = mans.get(target), state.get("manifest") or {}
    if not man:
        raise RuntimeError(f"release {target} on {host.name} has no readable manifest")
    why = changed_services(man, old or None, state.get("units") or {}, {}, state.get("health"),
                           routed(old or None, state.get("router_view")))
    todo = out_first(by_gpu(why), why)
    stop = [i for i in old.get("services", {}) if i not in man["services"]]
    payload = host_args(host) | _timeouts(host) | {
        "expect_current": cur, "keep": host.vars["releases_keep"], "protect": [x for x in (cur,) if x],
        "activate": activation(host, man, old or None),
        "batches": restart_batches(host, man, todo, drain=not no_drain, previous=old or None),
        "prune": None if no_drain else routermod.drain_spec(man),
        "journal": {"event": "rollback", "previous": cur, "release": target}, "fail_event": "rollback",
        "mark_failed": False}
    if stop:
        payload["stop"] = stop_spec(stop, man, old, drain=not no_drain)
    if rs := router_spec(man):
        payload["router"] = rs
    return payload


def rollback(inv: Inventory, hosts: list[Host], to: str | None = None, break_lock: bool = False,
             command: str = "fab rollback", out: Printer | None = None, no_drain: bool = False) -> dict:
    """Re-activate the previous (or named) release on each host through the same gated, drained restart."""
    return _runbook(inv, hosts, "rollback", lambda h, st, o: rollback_payload(h, st, to, o, no_drain), command,
                    break_lock, out or Printer(), manifests=True, no_drain=no_drain)


def restart_payload(host: Host, state: dict, gpus: list[int] | None, no_drain: bool = False) -> dict:
    man = state.get("manifest")
    if not man:
        raise RuntimeError(f"no active release on {host.name}; run fab deploy first")
    insts = by_gpu(i for i, s in man["services"].items() if s.get("enabled", True)
                   and (gpus is None or any(g in gpus for g in s.get("gpus") or [s["gpu"]])))  # a TP group: any GPU
    # a GPU left out of the router or on an older release (a run that died, a failed gate) restarts too, first
    why = changed_services(man, man, state.get("units") or {}, state.get("services") or {}, state.get("health"),
                           routed(man, state.get("router_view")))
    insts = out_first(by_gpu(set(insts) | set(why)), why)
    return host_args(host) | _timeouts(host) | {
        "expect_current": state.get("current"), "keep": host.vars["releases_keep"],
        "batches": restart_batches(host, man, insts, drain=not no_drain),
        "prune": None if no_drain else routermod.drain_spec(man),
        "journal": {"event": "restart", "release": state.get("current")}, "fail_event": "restart",
        "mark_failed": False}


def restart(inv: Inventory, hosts: list[Host], gpus: list[int] | None = None, break_lock: bool = False,
            command: str = "fab restart", out: Printer | None = None, no_drain: bool = False) -> dict:
    """Gated, drained restart of the current release's services (one batch of max_unavailable at a time)."""
    return _runbook(inv, hosts, "restart", lambda h, st, o: restart_payload(h, st, gpus, no_drain), command,
                    break_lock, out or Printer(), no_drain=no_drain)
