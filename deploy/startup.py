"""How long a GPU server takes to start, by mode, node budget and model family: the one table the gate's start
timeout and `fab deploy`'s rollout estimate come from (pure).

The table is a documented default, seeded from H200 measurements (SGLang 0.5.17, tiny trained pair):

- a cold start (empty JIT caches) of a tree-verify server at B=15 was ready after 129 s (MEASUREMENTS.md: "server ready
  after 129 s"); the chain modes (`linear`, `shadow-linear`) capture no tree-verify graph and are given the same;
- tree-verify's target-verify CUDA-graph capture on the hybrid target took 44 s at B=31, 114 s at B=63 and 271 s at
  B=127; on the dense target 1.4 s at B=127. Each point is the cold start plus that capture.

Between points the expectation is interpolated linearly, past the last one extrapolated along the last segment,
below the first one the first point's. The inventory overrides it per service with `start_seconds: N` (any scope:
a fleet whose GPUs or caches start faster or slower says so once).

The gate waits `FACTOR x expected + SLACK` seconds for a restarted server, never more than the inventory's
`start_timeout` (the unit's own start timeout, which bounds the whole apply as well).
"""
from __future__ import annotations

import math

from .contract import LINEAR, SHADOW_LINEAR, TREE_VERIFY, is_schedule, largest_budget

COLD_START_S = 129.0   # tree-verify B=15 cold start on the H200, server ready (benchmarks/results/MEASUREMENTS.md)
# (mode, family) -> ((budget, expected start seconds), ...), budgets ascending; family None: any family
START_SECONDS: dict[tuple[str, str | None], tuple[tuple[int, float], ...]] = {
    (TREE_VERIFY, "hybrid"): ((15, COLD_START_S), (31, COLD_START_S + 44.0), (63, COLD_START_S + 114.0),
                              (127, COLD_START_S + 271.0)),
    (TREE_VERIFY, "dense"): ((15, COLD_START_S), (127, COLD_START_S + 1.4)),
    (SHADOW_LINEAR, None): ((1, COLD_START_S),),
    (LINEAR, None): ((1, COLD_START_S),),
}
FACTOR = 2.0           # the gate's start timeout: twice the expectation ...
SLACK_S = 60.0         # ... plus a minute
GATE_S = 15.0          # what a batch spends past the start: the health gate, the canary, the router's warm-up


def _interp(points, budget: int) -> float:
    if len(points) == 1 or budget <= points[0][0]:
        return points[0][1]
    for (b0, s0), (b1, s1) in zip(points, points[1:]):
        if budget <= b1:
            return s0 + (s1 - s0) * (budget - b0) / (b1 - b0)
    (b0, s0), (b1, s1) = points[-2], points[-1]
    return s1 + (s1 - s0) * (budget - b1) / (b1 - b0)


def expected_start(mode: str, budget: int, family: str | None = None, override: float | None = None) -> float:
    """Expected seconds from a (re)start to /health 200 for a server of `mode` at node budget `budget` on a
    target of `family` ("hybrid", "dense", or None when not known: the slower family's figure); `override`: the
    inventory's `start_seconds`. A budget schedule starts as its largest budget (the verify graphs are captured at
    its width)."""
    if override is not None:
        return float(override)
    if is_schedule(budget):
        budget = largest_budget(budget)
    if (mode, None) in START_SECONDS:
        return _interp(START_SECONDS[(mode, None)], budget)
    fams = [family] if (mode, family) in START_SECONDS else [f for (m, f) in START_SECONDS if m == mode]
    if not fams:
        return COLD_START_S
    return max(_interp(START_SECONDS[(mode, f)], budget) for f in fams)


def start_timeout(expected: float, cap: int | float) -> int:
    """The gate's start timeout for a server expected to start in `expected` s, at most `cap` (the inventory's
    start_timeout)."""
    return int(min(float(cap), math.ceil(FACTOR * expected + SLACK_S)))


def rollout_estimate(hosts: list[list[list[float]]], parallel: int) -> dict:
    """The expected wall time of a rollout. `hosts`: per host, its restart batches, each the expected start
    seconds of its GPUs; hosts run `parallel` at a time, a host's batches one after another, a batch as long as
    its slowest GPU plus GATE_S. Returns {seconds, gpus, batches, batch_seconds (mean)}."""
    per_host, batch_s = [], []
    for batches in hosts:
        t = 0.0
        for b in batches:
            if b:
                s = max(b) + GATE_S
                batch_s.append(s)
                t += s
        per_host.append(t)
    waves = [sorted(per_host, reverse=True)[i:i + max(1, parallel)] for i in range(0, len(per_host), max(1, parallel))]
    total = sum(w[0] for w in waves if w)
    return {"seconds": round(total), "gpus": sum(len(b) for bs in hosts for b in bs), "batches": len(batch_s),
            "batch_seconds": round(sum(batch_s) / len(batch_s)) if batch_s else 0}


def estimate_line(est: dict) -> str:
    """`expected rollout time ~N s (M GPUs in K batches x ~S s)`."""
    return (f"expected rollout time ~{est['seconds']} s ({est['gpus']} GPU{'s' if est['gpus'] != 1 else ''} in "
            f"{est['batches']} batch{'es' if est['batches'] != 1 else ''} x ~{est['batch_seconds']} s)")
