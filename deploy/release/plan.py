"""The deploy plan of one host, a pure value made from what its read-only probe saw: the release it gets (or that
it is unchanged), the manifest and files staged, which GPUs restart and why, which services stop, what refuses the
host (coherence, fit, secrets, hybrid models, its router) and the release.apply payload that carries it out."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import contract
from .. import facts as factsmod
from ..inventory import Host
from . import build, hostfit, hybrid, render
from . import router as routermod
from .changes import NO_DRAIN_WARNING, changed_services, interrupted_line, router_refusal, routed, secrets_refusals
from .payload import apply_commands, deploy_payload


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

