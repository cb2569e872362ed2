"""Does a host's inventory entry fit the host? The deploy plan's checks of the values the inventory gives against
what the plan's read-only probe saw there, pure: a GPU index the host lacks (nvidia-smi's list), a port another
service or sshd listens on (deploy/remote/host/fit.py reads who listens), a model or draft model path that is not a
model directory (one with a config.json), a tensor-parallel group whose GPUs cannot do peer-to-peer (`nvidia-smi
topo -m`: NODE/SYS) where its service does not say accept_no_p2p, or whose model's attention heads tp does not
divide (deploy/tp.py). Each refusal names the file:line of the value (deploy/inventory.py keeps
where every value came from), before anything is staged or restarted.

A port held by this toolkit's own units (a GPU service, the router) is not refused: the rollout restarts, moves or
stops them itself.
"""
from __future__ import annotations

from .. import tp as tpmod
from ..facts import parse_query_gpu_csv, parse_topo_matrix
from ..inventory import Host
from . import render
from . import router as routermod

WILDCARD = ("0.0.0.0", "::")
SSH_UNITS = ("ssh.service", "sshd.service", "ssh.socket", "sshd.socket")


def wanted_ports(host: Host) -> list[tuple[int, str, str, str]]:
    """(port, address it binds, what binds it, where the inventory set it) of every listener a deploy of `host`
    starts: each enabled GPU service (a TP group's rendezvous ports too) and, when enabled, the router and its metrics endpoint."""
    out = [(s.port, s.listen, s.instance, s.where.get("port") or f"{host.name}: {s.instance}.port")
           for s in host.services if s.enabled]
    # a TP group's rendezvous ports (contract.tp_ports), on loopback
    out += [(p, "127.0.0.1", f"{s.instance}'s TP group ({flag})",
             s.where.get("gpus") or f"{host.name}: {s.instance}.gpus (vars.tp_port_base)")
            for s in host.services if s.enabled and s.tp_port for p, flag in zip(s.tp_port, ("--dist-init-addr",
                                                                                             "--nccl-port"))]
    if routermod.enabled(host):
        r = routermod.settings(host)
        out.append((r["port"], host.vars.get("listen_address", "127.0.0.1"), "the router",
                    host.where.get("router.port") or f"{host.name}: router.port"))
        out.append((r["metrics_port"], "127.0.0.1", "the router's metrics",
                    host.where.get("router.metrics_port") or f"{host.name}: router.metrics_port"))
    return out


def model_paths(host: Host) -> list[str]:
    return sorted({m for s in host.services if s.enabled for m in (s.model, s.draft_model) if m})


def probe_args(host: Host) -> dict:
    """What release.probe reads for these checks: who listens on the ports, are the model paths models."""
    return {"listeners": sorted({p for p, *_ in wanted_ports(host)}), "model_dirs": model_paths(host)}


def host_gpus(raw: dict | None) -> tuple[list[int] | None, str | None]:
    """(the GPU indices nvidia-smi listed, None when it did not answer; why it did not) from the facts probe's raw
    output."""
    q = (raw or {}).get("nvidia_smi_query")
    if raw is None:
        return None, "no facts"
    if q is None:
        return None, "no nvidia-smi on the host"
    if q.get("rc") != 0:
        return None, f"nvidia-smi exited {q.get('rc')}: {(q.get('err') or '').strip()[:200]}"
    return sorted(g["index"] for g in parse_query_gpu_csv(q.get("out") or "") if g.get("index") is not None), None


def ours(unit: str | None) -> bool:
    """A unit this toolkit runs (the rollout restarts or stops it before its port is needed again)."""
    return bool(unit) and (unit == routermod.UNIT or
                           (unit.startswith(render.UNIT_PREFIX) and unit.endswith(".service")))


def overlaps(bound: str, wanted: str) -> bool:
    """Would binding `wanted` clash with a socket bound to `bound` on the same port (a wildcard clashes with all)?"""
    return bound == wanted or bound in WILDCARD or wanted in WILDCARD


def holder(o: dict) -> str:
    """A listening socket's owner, as the refusal names it."""
    if o.get("pid") is None:
        return f"a socket on {o.get('address')} whose process was not found"
    ssh = o.get("comm") == "sshd" or o.get("unit") in SSH_UNITS
    return (f"{'sshd, the host SSH server' if ssh else o.get('comm') or 'a process'} (pid {o['pid']}"
            + (f", {o['unit']}" if o.get("unit") else "") + f", on {o.get('address')})")


def refusals(host: Host, state: dict) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of `host`'s inventory against its probe `state` (release.probe with probe_args and
    facts). What the probe did not read is not judged (a restart or rollback asks for none of it)."""
    refused, warnings = [], []
    enabled = [s for s in host.services if s.enabled]
    if "facts" in state:
        have, why = host_gpus(state.get("facts"))
        if have is None:
            warnings.append(f"WARNING GPU indices not checked ({why})")
        else:
            for s in enabled:
                for g in s.gpus:
                    if g not in have:
                        refused.append(f"{s.where.get('gpus' if s.tp > 1 else 'gpu') or host.name + ': gpus'}: "
                                       f"{s.instance}: {host.name} has no GPU {g} (nvidia-smi lists "
                                       + (", ".join(f"GPU {i}" for i in have) or "none") + ")")
        r, w = tp_refusals(host, state)
        refused += r
        warnings += w
    listeners = state.get("listeners")
    if isinstance(listeners, dict):
        for port, address, what, where in wanted_ports(host):
            held = [o for o in listeners.get(str(port)) or [] if isinstance(o, dict)
                    and overlaps(str(o.get("address")), address) and not ours(o.get("unit"))]
            if held:
                refused.append(f"{where}: port {port} ({what}, on {address}) is in use on {host.name} by "
                               + "; ".join(holder(o) for o in held))
    dirs = state.get("model_dirs")
    if isinstance(dirs, dict):
        seen: dict[tuple[str, str], list[str]] = {}
        for s in enabled:
            for key in ("model", "draft_model"):
                path = getattr(s, key)
                why = dirs.get(path, "ok") if path else "ok"
                if why != "ok":
                    seen.setdefault((s.where.get(key) or f"{host.name}: {s.instance}.{key}", str(why)),
                                    []).append(s.instance)
        for (where, why), insts in seen.items():
            refused.append(f"{where}: {why} ({', '.join(insts)})")
    return refused, warnings


def tp_refusals(host: Host, state: dict) -> tuple[list[str], list[str]]:
    """(refusals, warnings) of the host's TP groups: peer-to-peer between every pair of a group's GPUs per the
    facts' `nvidia-smi topo -m` (refused, unless the service accepts no P2P; a matrix that did not come back is
    refused too, never assumed fine), and tp against the model's and draft model's attention heads where the
    probe read their config.json (state["configs"]); where it did not, a warning says tp was not checked."""
    refused, warnings = [], []
    groups = [s for s in host.services if s.enabled and s.tp > 1]
    if not groups:
        return refused, warnings
    topo = (state.get("facts") or {}).get("nvidia_smi_topo")
    links = parse_topo_matrix(topo.get("out")).get("links") if isinstance(topo, dict) and topo.get("rc") == 0 \
        else None
    for s in groups:
        where = s.where.get("gpus") or f"{host.name}: {s.instance}.gpus"
        gpus = ", ".join(map(str, s.gpus))
        why = (tpmod.p2p_problem(links, s.gpus) if links is not None else
               "the GPUs' interconnect is unknown (nvidia-smi topo -m did not answer: "
               + (((topo or {}).get("err") or "no facts").strip()[:200] if isinstance(topo, dict) or topo is None
                  else "no facts") + ")")
        if why and s.accept_no_p2p:
            warnings.append(f"WARNING {s.instance} (GPUs {gpus}): {why}; deployed anyway (accept_no_p2p)")
        elif why:
            refused.append(f"{where}: {s.instance} (GPUs {gpus}): {why}; set accept_no_p2p: true on the service to "
                           "deploy it anyway")
        configs = state.get("configs") or {}
        for key in ("model", "draft_model"):
            path = getattr(s, key)
            c = configs.get(path) if path else None
            if not isinstance(c, dict) or "config" not in c:
                if path:
                    warnings.append(f"WARNING {s.instance}: tp {s.tp} not checked against {key} {path}'s attention "
                                    "heads (its config.json was not read)")
                continue
            problem = tpmod.heads_problem(c["config"], s.tp)
            if problem and problem.startswith("not checked"):
                warnings.append(f"WARNING {s.instance}: tp {s.tp} against {key} {path}: {problem}")
            elif problem:
                refused.append(f"{s.where.get(key) or where}: {s.instance}: {key} {path}: {problem}")
    return refused, warnings
