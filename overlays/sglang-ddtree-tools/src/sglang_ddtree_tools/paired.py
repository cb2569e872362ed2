"""Paired speed comparisons over bench rounds: is a mode ahead of its peer, and how sure is that?

On the H200's host one server's tok/s moved up to 2x from one start to the next (the same code: 1030 and 2154
tok/s), more than the gaps being measured, and the move was shared by servers started close together. So a mode
is compared with its peer round by round, never median against median: in round i of a report, the two servers
ran one right after the other (``bench --rounds``), and their ratio is one paired figure. Pairs from several
reports (several calls, machines or days) pool; each report's rounds are paired only within that report, and
reports pool only under the same conditions (target, prompts, tokens, requests, server arguments, server CPUs and
the plugin's SGLANG_DDTREE_* switches as the report recorded them, but the scheduler's: a DDTREE run is named by the
scheduler its server ran, :func:`run_label`): other conditions are other rows.

For each (run, peer, concurrency): every round's ratio, their median, a distribution-free 95% interval of that
median (order statistics of the sign test: with n pairs, the k-th smallest and k-th largest ratio, k the largest
with P(Binomial(n, 1/2) < k) <= 2.5%; none below 6 pairs), and in how many rounds the run was ahead. A failed
round (a server that did not start or measured nothing) pairs with nothing. Where the reports say, each pair also
has what its ratio is made of (the accept and step ratios) and how fast each side's host CPU was: the before-start
loop time of the CPU each scheduler ran on (``host.sched_cpu_ms``; a pair whose run had the slower CPU is a pair
the host weighed on).

    python -m sglang_ddtree_tools.paired REPORT.json [REPORT.json ...] [--peer dflash] [--json]

Exit status: 0 a comparison was made, 1 none could be (no round where both ran), 2 a report could not be read.
Pure functions, tested on CPU and on the reports kept from the H200 (benchmarks/results/h200_scheduler_ab_lossless_b15_b63, h200_dense_race_cpu_pinning).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_ddtree import contract  # noqa: F401
from sglang_ddtree.contract import DFLASH, OVERLAP_ENV, PLAIN

LEVEL = 0.95


def _label(run: dict) -> str:
    from .report import run_label  # the one way a run is named, as bench's table names it (with its scheduler)
    return run_label(run)


def round_levels(run: dict) -> Dict[int, List[Optional[dict]]]:
    """Per concurrency, the run's measured level in each round, in round order (None: that round did not measure
    it: a failed server, an error, no tok/s). A report of one round (no ``rounds`` list) is one round of its
    ``levels``."""
    rounds = run.get("rounds")
    if rounds is None:
        rounds = [{"status": run.get("status"), "levels": run.get("levels") or []}]
    out: Dict[int, List[Optional[dict]]] = {}
    for i, r in enumerate(rounds):
        for lv in r.get("levels") or []:
            v = lv.get("output_tok_s")
            good = r.get("status") == "ok" and not lv.get("errors") and _pos(v)
            col = out.setdefault(lv["concurrency"], [None] * len(rounds))
            col[i] = lv if good else None
    return out


def _pos(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _step(lv: dict, max_new) -> Tuple[Optional[float], bool]:
    """A level's decode step in ms and whether it is estimated: bench's ``step_ms`` p50 where the report has it;
    in reports from before it, at one request, estimated from what they kept: a request's time (max_new / tok/s)
    less its TTFT p50, over its steps (max_new / accept: SGLang's accept is tokens over verify steps; plain: a
    step a token after the first)."""
    v = (lv.get("step_ms") or {}).get("p50")
    if _pos(v):
        return float(v), False
    ttft, tok_s, acc = (lv.get("ttft_ms") or {}).get("p50"), lv.get("output_tok_s"), lv.get("accept_length")
    if lv.get("concurrency") != 1 or not (type(max_new) is int and max_new > 1 and _pos(ttft) and _pos(tok_s)):
        return None, False
    steps = max_new / acc if _pos(acc) else max_new - 1 if acc is None else 0
    decode_ms = max_new / tok_s * 1000.0 - ttft
    return (round(decode_ms / steps, 4), True) if steps > 0 and decode_ms > 0 else (None, False)


def _sched_cpu(lv: dict) -> Optional[float]:
    v = (lv.get("host") or {}).get("sched_cpu_ms")
    return float(v) if _pos(v) else None


def _accept(lv: dict) -> Optional[float]:
    v = lv.get("accept_length")
    return float(v) if _pos(v) else 1.0 if v is None else None  # plain: one token a step


def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def median_interval(xs: Sequence[float], level: float = LEVEL) -> Optional[Tuple[float, float]]:
    """A distribution-free interval of the median covering it with probability >= level: (x_(k), x_(n+1-k)),
    k the largest with P(Binomial(n, 1/2) <= k - 1) <= (1 - level) / 2. None when n is too small for one."""
    n, tail = len(xs), (1 - level) / 2
    k, cdf = 0, 0.0
    while k < n:
        p = cdf + math.comb(n, k) / 2 ** n  # P(Binomial <= k)
        if p > tail:
            break
        cdf, k = p, k + 1
    if k == 0:
        return None
    s = sorted(xs)
    return s[k - 1], s[n - k]


def conditions(doc: dict) -> Dict[str, object]:
    """What must be the same for two reports' rounds to pool (as the report recorded it)."""
    s = doc.get("settings") or {}
    # the scheduler a DDTREE server ran is in its name (run_label), whether a switch here or --overlap asked
    # for it: reports that set it either way pool
    env = {k: v for k, v in (s.get("ddtree_env") or {}).items() if k != OVERLAP_ENV}
    return {"target": (doc.get("model") or {}).get("target"), "max_new_tokens": s.get("max_new_tokens"),
            "prompts": s.get("prompts"), "requests": s.get("requests_per_level"),
            "server_args": s.get("server_args") or "", "cpus": s.get("server_cpus"), "env": env}


def conditions_text(cond: Dict[str, object]) -> str:
    """The conditions a reader must see beside a figure: server CPUs, arguments and plugin switches when set."""
    parts = []
    if cond.get("cpus"):
        parts.append(f"server CPUs {cond['cpus']}")
    if cond.get("server_args"):
        parts.append(f"server args {cond['server_args']!r}")
    parts += [f"{k}={v}" for k, v in sorted(dict(cond.get("env") or {}).items())]
    return ", ".join(parts) or "defaults"


def pairs(docs: Sequence[dict], peer: str = DFLASH) -> List[dict]:
    """Every run that is not `peer`, against the report's first `peer` run with the same graphs setting, per
    concurrency: the paired rounds of every report under the same conditions pooled (a run is known by its
    label)."""
    pooled: Dict[Tuple[str, str, str, int], dict] = {}
    for d_i, doc in enumerate(docs):
        cond = conditions(doc)
        max_new = cond["max_new_tokens"]
        fp = json.dumps(cond, sort_keys=True)
        runs = [r for r in doc.get("runs") or [] if r.get("mode")]
        for run in runs:
            if run["mode"] == peer:
                continue
            base = next((r for r in runs if r["mode"] == peer and bool(r.get("graphs")) == bool(run.get("graphs"))),
                        None)
            if base is None:
                continue
            mine, theirs = round_levels(run), round_levels(base)
            for c, col in mine.items():
                other = theirs.get(c) or []
                key = (fp, _label(run), _label(base), c)
                row = pooled.setdefault(key, {"run": key[1], "peer": key[2], "concurrency": c, "conditions": cond,
                                              "pairs": []})
                for i, lv in enumerate(col):
                    pv = other[i] if i < len(other) else None
                    if lv is None or pv is None:
                        continue
                    v, w = float(lv["output_tok_s"]), float(pv["output_tok_s"])
                    pair = {"report": d_i, "round": i, "tok_s": v, "peer_tok_s": w, "ratio": round(v / w, 4)}
                    # why the ratio is what it is: what a step buys (accept) and what it costs (step_ms)
                    a, pa = _accept(lv), _accept(pv)
                    (st, est), (pst, pest) = _step(lv, max_new), _step(pv, max_new)
                    if a and pa:
                        pair["accept_ratio"] = round(a / pa, 4)
                    if st and pst:
                        pair.update(step_ms=st, peer_step_ms=pst, step_ratio=round(st / pst, 4),
                                    step_estimated=est or pest)
                    cpu, pcpu = _sched_cpu(lv), _sched_cpu(pv)
                    if cpu and pcpu:  # how fast the CPU each scheduler ran on was (loop ms: more is slower)
                        pair.update(cpu_ms=cpu, peer_cpu_ms=pcpu, cpu_ratio=round(cpu / pcpu, 4))
                    row["pairs"].append(pair)
    out = []
    for key in sorted(pooled, key=lambda k: (k[3], k[1], k[0])):
        row = pooled[key]
        ratios = [p["ratio"] for p in row["pairs"]]
        if not ratios:
            continue
        iv = median_interval(ratios)
        row.update(n=len(ratios), median_ratio=round(median(ratios), 4),
                   interval=None if iv is None else [iv[0], iv[1]], level=LEVEL,
                   ahead=sum(r > 1 for r in ratios),
                   median_tok_s=round(median([p["tok_s"] for p in row["pairs"]]), 1),
                   peer_median_tok_s=round(median([p["peer_tok_s"] for p in row["pairs"]]), 1))
        for k in ("accept_ratio", "step_ratio", "step_ms", "peer_step_ms", "cpu_ratio"):  # over the pairs with it
            xs = [p[k] for p in row["pairs"] if k in p]
            if xs:
                row["median_" + k] = round(median(xs), 4)
        if "median_step_ratio" in row:
            row["step_estimated"] = any(p.get("step_estimated") for p in row["pairs"])
        out.append(row)
    return out


PEERS = (DFLASH, PLAIN)


def report_section(doc: dict) -> List[dict]:
    """The ``paired`` section of a bench report of 2+ rounds: every run against DFLASH and plain, per concurrency,
    without the conditions (one report has one) and with the ratios in round order."""
    out = []
    for peer in PEERS:
        for r in pairs([doc], peer):
            out.append({"run": r["run"], "peer": r["peer"], "concurrency": r["concurrency"], "n": r["n"],
                        "median_ratio": r["median_ratio"], "interval": r["interval"], "ahead": r["ahead"],
                        "ratios": [p["ratio"] for p in r["pairs"]]})
    return out


def section_line(r: dict) -> str:
    """One line of a report's ``paired`` section (the table's footer, here and in ``fab bench``)."""
    iv = (f"{r['interval'][0]:.2f}-{r['interval'][1]:.2f}" if r["interval"]
          else f"none with {r['n']} pairs (6 needed)")
    return (f"{r['run']} / {r['peer']} at c={r['concurrency']}: median paired ratio {r['median_ratio']:.2f}x (95% "
            f"interval {iv}), ahead in {r['ahead']} of {r['n']} rounds; ratios "
            + " ".join(f"{x:.2f}" for x in r["ratios"]))


def why_text(r: dict) -> str:
    """What a comparison's ratio is made of, where the reports say: the accept ratio (tokens a step) and the step
    ratio (what a decode step costs, paired medians; estimated at one request in reports from before ``step_ms``).
    Their quotient is the decode ratio; the request's fixed time to its first token moves tok/s off it."""
    parts = []
    if "median_accept_ratio" in r:
        parts.append(f"accept {r['median_accept_ratio']:.2f}x")
    if "median_step_ratio" in r:
        parts.append(f"step {r['median_step_ratio']:.2f}x the peer's ({r['median_step_ms']:.2f} vs "
                     f"{r['median_peer_step_ms']:.2f} ms" + (", estimated from tok/s and TTFT" if
                                                             r.get("step_estimated") else "") + ")")
    if "median_cpu_ratio" in r:
        n = sum(1 for p in r["pairs"] if "cpu_ratio" in p)
        slower = sum(1 for p in r["pairs"] if p.get("cpu_ratio", 1.0) > 1.0)
        parts.append(f"its scheduler's CPU {r['median_cpu_ratio']:.2f}x the peer's loop time (slower in {slower} "
                     f"of {n})")
    return "; " + ", ".join(parts) if parts else ""


def format_pairs(rows: Sequence[dict]) -> str:
    """One line per comparison: the median paired ratio, its interval, rounds ahead, every ratio, the medians,
    what the ratio is made of (:func:`why_text`) and the conditions."""
    return "\n".join(section_line(dict(r, ratios=[p["ratio"] for p in r["pairs"]]))
                     + f"; medians {r['median_tok_s']:.1f} vs {r['peer_median_tok_s']:.1f} tok/s" + why_text(r)
                     + f" [{conditions_text(r['conditions'])}]" for r in rows)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.paired", description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="bench JSON reports (schema ddtree-bench/1)")
    ap.add_argument("--peer", default=DFLASH, help="the mode every other run is compared with (default dflash)")
    ap.add_argument("--json", action="store_true", help="print the comparisons as JSON")
    a = ap.parse_args(argv)
    docs = []
    for path in a.reports:
        try:
            with open(path) as fh:
                doc = json.load(fh)
            if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
                raise ValueError("not a bench report (no runs list)")
        except (OSError, ValueError) as e:
            print(f"{path}: {e}", file=sys.stderr)
            return 2
        docs.append(doc)
    rows = pairs(docs, a.peer)
    print(json.dumps(rows, indent=1) if a.json else (format_pairs(rows) or f"no round where {a.peer} and another "
                                                                           f"run both measured"))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
