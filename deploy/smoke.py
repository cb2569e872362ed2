"""`fab smoke HOST`: prove a fleet host's environment and the DDTree payload on one GPU.

Plan (pure, from the inventory and one read-only `release.probe`): which GPU (default: the host's first enabled
service), which mode (default: that service's), which tiny-model family (the family of the service's configured
model: `hybrid` when its config.json has recurrent layers, by the deploy's own hybrid gate), the budget, and the
active release whose venv and plugin run it. Refused before anything runs: no active release, a venv root must not
run, a GPU the host does not have, an unreadable model config. Then one `smoke.run` agent call carries this
checkout's tools wheel (:mod:`deploy.tools`: installed into the run's private directory on the host, never into the
venv) and runs its `python -m sglang_ddtree_tools.smoke` with the release's venv (transient `systemd-run` servers
as the service user, always torn down); its report comes back: the lossless statistic, the algorithm and accept
length the server reports, an unsupported request rejected alone. A host without a GPU (a CPU lab host) says so and the run fails.
"""
from __future__ import annotations

import re
import secrets
from dataclasses import asdict, dataclass

from . import contract
from .inventory import Host, Inventory
from .release import hybrid

SMOKE_MODES = contract.SMOKE_MODES
MAX_SMOKE_BUDGET = 63  # a smoke test proves the path, not the production budget's speed
EXIT_OK, EXIT_FAILED, EXIT_CANNOT_RUN = 0, 1, 2
PROBE_DEADLINE = 60.0


class SmokeRefused(ValueError):
    """The smoke test cannot run on this host as asked (nothing was started)."""


@dataclass(frozen=True)
class SmokePlan:
    host: str
    gpu: int
    instance: str | None
    mode: str
    family: str
    family_reason: str
    budget: int
    release: str
    venv: str
    user: str
    prompts: int
    tokens: int
    prefix: str
    deadline: float
    cache_key: str | None = None  # the active payload's JIT cache folder of the GPU's service (jit_source)
    env: tuple = ()  # the GPU's service environment, (name, value) pairs: the servers run with it (service_env)

    def agent_args(self) -> dict:
        return {"gpu": self.gpu, "mode": self.mode, "family": self.family, "budget": self.budget,
                "prompts": self.prompts, "tokens": self.tokens, "venv": self.venv, "user": self.user,
                "prefix": self.prefix, "env": dict(self.env)} | jit_args(self.instance, self.cache_key)

    def to_json(self) -> dict:
        return asdict(self)


def jit_source(svc, probe: dict) -> str | None:
    """The JIT cache folder (render.cache_dirs' payload key) the GPU's service keeps for the active release, which
    the transient servers' caches are seeded from; None where the GPU has no service or the release no payload."""
    man = probe.get("manifest") if isinstance(probe.get("manifest"), dict) else {}
    digest = man.get("payload_digest")
    if svc is None or not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
        return None
    return digest[:16]


def service_env(svc) -> tuple:
    """What the GPU's service sets in its unit from the inventory's `env` (e.g. a kernel check a trimmed wheel needs
    skipped), for the run's transient servers: they start as the service does. The names the run sets itself
    (its GPU, PATH, the mode and budget, the JIT caches, tree-verify's scheduler, which bench measures apart) are
    left out; the host checks the rest again."""
    from .remote.host.smoke import ENV_SET_BY_RUN  # the host op's own rule (imported where used)

    return tuple((k, v) for k, v in (svc.env if svc is not None else ()) if k not in ENV_SET_BY_RUN)


def jit_args(instance: str | None, cache_key: str | None) -> dict:
    """The host op's arguments naming the service caches to seed from (both null: the servers start cold)."""
    return {"instance": instance if cache_key else None, "cache_key": cache_key}


def jit_line(res: dict) -> str | None:
    """How the run's transient servers started (the host op's `jit_cache`), or None for an agent without it."""
    jit = res.get("jit_cache") if isinstance(res, dict) else None
    if not isinstance(jit, dict):
        return None
    from .remote.host.jitcache import line

    return "JIT caches " + line(jit)[:600]


def gpu_and_service(host: Host, gpu: int | None, refused: type, hint: str):
    """(gpu, its enabled service or None) for a one-GPU run on `host` (smoke, bench): the given GPU, else the
    first enabled service's. Raises `refused` (with `hint` when no GPU can be chosen)."""
    if gpu is not None and gpu not in host.gpus:
        raise refused(f"{host.name} has no GPU {gpu} (its GPUs: {', '.join(map(str, host.gpus)) or 'none'})")
    svc = next((s for s in host.services if s.enabled and (gpu is None or s.gpu == gpu)), None)
    if gpu is None:
        if svc is None:
            raise refused(f"{host.name} has no enabled service: {hint}")
        gpu = svc.gpu
    return gpu, svc


def plan_smoke(host: Host, probe: dict, gpu: int | None = None, mode: str | None = None, budget: int | None = None,
               prompts: int = 8, tokens: int = 32, deadline: float = 900.0) -> SmokePlan:
    """The smoke run for `host` from its inventory entry and a `release.probe` result. Raises SmokeRefused."""
    gpu, svc = gpu_and_service(host, gpu, SmokeRefused, "pass --gpu and --mode")
    configured = svc.mode if svc else None
    if configured == contract.AUTO:  # what the last deploy chose for it (mode auto is resolved at deploy from bench)
        man = probe.get("manifest") if isinstance(probe.get("manifest"), dict) else {}
        configured = ((man.get("services") or {}).get(svc.instance) or {}).get("mode")
        if not (mode or configured):
            raise SmokeRefused(f"{svc.instance} has mode auto and no deployed choice yet (fab deploy picks it from "
                               "fab bench): pass --mode")
    mode = mode or configured
    if mode not in SMOKE_MODES:
        raise SmokeRefused(f"mode {mode!r}: choose one of {', '.join(SMOKE_MODES)}")
    if not probe.get("current"):
        raise SmokeRefused(f"{host.name} has no active release: run `fab deploy` first (the smoke test runs the "
                           f"release's plugin from {host.vars['venv']})")
    if probe.get("venv_trust") != "ok":
        raise SmokeRefused(f"{host.name}: {host.vars['venv']}: root will not run it: {probe.get('venv_trust')}")
    family, reason = "dense", "no model configured for this GPU: the dense tiny model"
    if svc is not None and svc.model:
        got = (probe.get("configs") or {}).get(svc.model) or {}
        if "config" not in got:
            raise SmokeRefused(f"{host.name}: the model of {svc.instance} ({svc.model}) has no readable config.json "
                               f"({got.get('error', 'not probed')}): its family decides the tiny model")
        why = hybrid.hybrid_reason(got["config"])
        family, reason = ("hybrid", f"{svc.model}: {why}") if why else ("dense", f"{svc.model}: no recurrent layers")
    # a schedule's service: its budget at one request (what the smoke's sequential prompts mostly run at)
    b = budget if budget is not None else (contract.budget_for(svc.budget, 1) if svc else 15)
    b = max(contract.BUDGET_MIN, min(int(b), MAX_SMOKE_BUDGET))
    return SmokePlan(host=host.name, gpu=gpu, instance=svc.instance if svc else None, mode=mode, family=family,
                     family_reason=reason, budget=b, release=probe["current"], venv=host.vars["venv"],
                     user=host.vars["service_user"], prompts=int(prompts), tokens=int(tokens),
                     prefix=f"ddtree-smoke-{secrets.token_hex(6)}", deadline=float(deadline),
                     cache_key=jit_source(svc, probe), env=service_env(svc))


def outcome(res: dict) -> tuple[int, str]:
    """(exit code, one line) from the smoke.run result."""
    rep = res.get("report") or {}
    if rep.get("cannot_run"):
        return EXIT_CANNOT_RUN, f"cannot run: {rep['cannot_run']}"
    if res.get("timed_out"):
        tail = (res.get("stderr") or "").strip().splitlines()[-2:]
        return EXIT_FAILED, ("the smoke test did not finish within its deadline (its servers were stopped; raise "
                             "--timeout)" + (f"; it had said: {' | '.join(tail)}" if tail else ""))
    if not rep:
        tail = (res.get("stderr") or "").strip().splitlines()[-3:]
        return EXIT_FAILED, f"the smoke module exited {res.get('rc')} without a report: {' | '.join(tail)}"
    if rep.get("error"):
        return EXIT_FAILED, f"smoke failed: {rep['error']}"
    if not rep.get("ok"):
        return EXIT_FAILED, "smoke failed: " + "; ".join(rep.get("problems") or ["see the report"])
    lo = rep["checks"]["lossless"]
    rp = rep["checks"].get("reports") or {}
    return EXIT_OK, (f"ok: {lo['tokens']} tokens, {lo['violations']} lossless violations (margin {lo['margin']}), "
                     f"algorithm {rp.get('algorithm') or 'none'}, accept length {rp.get('mean_accept_length')}")


def run(inv: Inventory, host: Host, gpu: int | None = None, mode: str | None = None, budget: int | None = None,
        prompts: int = 8, tokens: int = 32, deadline: float = 900.0, on_plan=None) -> dict:
    """Plan and run the smoke test on `host`: {plan, result, exit, line} (plan None when refused or unreachable)."""
    from .release.layout import host_args
    from .remote.client import Remote
    from .ssh import run_per_host

    models = sorted({s.model for s in host.services if s.enabled and s.model})

    def one(conn, h):
        remote = Remote(conn, h.name)
        probe = remote.call("release.probe", host_args(h) | {"models": models}, deadline=PROBE_DEADLINE)
        try:
            plan = plan_smoke(h, probe, gpu, mode, budget, prompts, tokens, deadline)
        except SmokeRefused as exc:
            return None, str(exc)
        if on_plan:
            on_plan(plan)
        from . import tools

        w = tools.wheel()  # the measurement tools travel with the call, for this run only
        return plan, remote.call("smoke.run", plan.agent_args() | {"tools": w.agent_args()}, deadline=plan.deadline,
                                 data=w.data)

    (r,) = run_per_host(inv, [host], one, label="smoke")
    if not r.ok:
        return {"plan": None, "result": None, "exit": EXIT_FAILED, "line": f"{r.kind}: {r.error}"}
    plan, res = r.value
    if plan is None:
        return {"plan": None, "result": None, "exit": EXIT_CANNOT_RUN, "line": f"refused: {res}"}
    code, line = outcome(res)
    return {"plan": plan.to_json(), "result": res, "exit": code, "line": line, "jit": jit_line(res)}
