"""What each restarted GPU's gate is given, planned on the control side before anything changes: its start timeout
(from the expected start of its mode, budget and model family: deploy/startup.py) and its canary (deploy/canary.py)
-- at `fab deploy` (`plan`, with the rollout's expected wall time, before the confirmation) and at `fab restart` and
`fab rollback` (`runbook_canaries`: every GPU a runbook restarts proves itself before it goes back into the router)."""
from __future__ import annotations

from .. import bench, canary, startup
from . import hybrid
from . import router as routermod


def family(configs: dict, model: str | None) -> str | None:
    """"hybrid" or "dense" from the model's config.json as the plan's probe read it; None when not read."""
    c = (configs.get(model) or {}).get("config") if model else None
    if not isinstance(c, dict):
        return None
    return "hybrid" if hybrid.hybrid_reason(c) else "dense"


def expectations(host, configs: dict) -> dict[str, float]:
    """{instance: expected start seconds} of a host's enabled services (the inventory's start_seconds wins)."""
    override = host.vars.get("start_seconds")
    return {s.instance: startup.expected_start(s.mode, s.budget, family(configs, s.model), override)
            for s in host.services if s.enabled}


def timed_gates(gates: dict, host, manifest: dict | None) -> dict:
    """`gates` (instance -> gate) each with the start timeout of its service in `manifest` (its mode and budget;
    the family is not known here: the slower family's expectation). What restart and rollback send; a deploy's
    plan refines it with the family its probe read (`plan`)."""
    svcs = (manifest or {}).get("services") or {}
    for inst, g in gates.items():
        s = svcs.get(inst) or {}
        b = s.get("budget") or 0  # the manifest's: an int, or a budget schedule's canonical text
        exp = startup.expected_start(str(s.get("mode")), b if isinstance(b, str) else int(b), None,
                                     host.vars.get("start_seconds"))
        g["start_timeout"] = startup.start_timeout(exp, host.vars["start_timeout"])
    return gates


def outage_lines(host, batches: list[list[str]], expected: dict[str, float]) -> list[str]:
    """What clients of `host`'s router see while a restart batch takes out every worker it routes to (a one-GPU
    host's only server, or a batch as wide as the host): the router holds their requests for `router.hold_secs`
    (router.retry_policy), and one line says whether the batch's expected outage (its slowest start plus the
    gate) fits in the hold or how long past it requests get 503. Nothing for a host without a router, or whose
    every batch leaves a worker serving."""
    if not routermod.enabled(host):
        return []
    serving = {s.instance for s in host.services if s.enabled}
    hold = int(routermod.settings(host).get("hold_secs", 0))
    out = []
    for insts in batches:
        if not insts or not serving or not serving <= set(insts):
            continue
        outage = round(max(expected.get(i, startup.COLD_START_S) for i in insts) + startup.GATE_S)
        head = f"while {', '.join(insts)} restart{'s' if len(insts) == 1 else ''} no worker serves"
        if outage <= hold:
            out.append(f"{head}: the router holds new requests up to {hold} s (router.hold_secs; expected outage "
                       f"~{outage} s)")
        else:
            out.append(f"WARNING {head} for ~{outage} s, longer than the router holds a request "
                       f"({hold} s, router.hold_secs): requests waiting longer get 503 (raise router.hold_secs, or "
                       f"serve this model on a second GPU)")
    return out


def gate_lines(host_name: str, instances: list[str], line_of, out) -> None:
    """Print what each restarting GPU's gate checks, one line per distinct check (`gate of gpu0, gpu1: ...`)."""
    grouped: dict[str, list[str]] = {}
    for i in instances:
        grouped.setdefault(line_of(i), []).append(i)
    for line, insts in grouped.items():
        out(host_name, f"gate of {', '.join(insts)}: {line}")


def plan(inventory_path: str, plans: dict, plugin_digest: str | None, parallel: int, out) -> dict:
    """Give every restart batch's gates of `plans` ({host: HostPlan}) their start timeout and canary, print what
    each canary checks (and where its accept floor came from, or that it has none) and the expected rollout
    time. Returns the estimate (startup.rollout_estimate)."""
    per_host = []
    for n, p in plans.items():
        host = p.host
        results, _problems = bench.load_results(inventory_path, n)
        specs, notes = canary.plan_host(host, results, plugin_digest)
        expected = expectations(host, (p.probe or {}).get("configs") or {})
        timeouts = {i: startup.start_timeout(e, host.vars["start_timeout"]) for i, e in expected.items()}
        canary.attach(p.payload, specs, timeouts)
        batches = p.payload.get("batches") or []
        restarting = [i for b in batches for i in b["instances"]]
        gate_lines(n, restarting, lambda i: f"{notes.get(i, 'no canary')}; start timeout {timeouts.get(i)} s "
                                            f"(expected start ~{round(expected.get(i, 0))} s)", out)
        for line in outage_lines(host, [b["instances"] for b in batches], expected):
            out(n, line)
        per_host.append([[expected.get(i, startup.COLD_START_S) for i in b["instances"]] for b in batches])
    est = startup.rollout_estimate(per_host, parallel)
    if est["gpus"]:
        out("local", startup.estimate_line(est))
    return est


def runbook_canaries(inventory_path: str, host, manifest: dict | None, payload: dict, out) -> None:
    """Give the gates of a restart's or a rollback's `payload` their canary, from `manifest` (the release its GPUs
    come back on: its modes, budgets and plugin) and the inventory's `canary:` settings, and print what each one
    checks. The floor comes from the host's bench results as at a deploy."""
    results, _problems = bench.load_results(inventory_path, host.name)
    specs, notes = canary.plan_manifest(host, manifest or {}, results)
    canary.attach(payload, specs, {})
    gate_lines(host.name, [i for b in payload.get("batches") or [] for i in b["instances"]],
               lambda i: notes.get(i, "no canary (not in the release's manifest)"), out)
