"""What is shipped to a host's agent: the `release.apply` request of a deploy, rollback or restart, built pure from
the plan -- the stage (release directory: its bundle travels as the call's data), the activation (plugin wheel,
router venv, units), the restart batches with each GPU's gate and drain, the services to stop, the router to
(re)start and the rollback the agent runs when something fails after activation began -- and the commands it runs,
in order (what the confirmation shows), and a bound on how long it may take."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..inventory import Host
from ..remote import commands
from . import gateplan, render
from . import router as routermod
from .changes import by_gpu, batches, changed_services, out_first, rollback_target, routed
from .layout import host_args

if TYPE_CHECKING:
    from .plan import DeployOptions, HostPlan

SYSTEMCTL_RESTART = commands.systemctl("restart", (), "--no-block")
SYSTEMCTL_RESET = commands.systemctl("reset-failed")
SYSTEMCTL_STOP = commands.systemctl("stop")


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

