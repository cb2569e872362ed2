"""sglang_ddtree_tools.paired: a mode against its peer round by round (never median against median), with the sign
test's distribution-free interval; tested on made-up reports and on real H200 reports trimmed to what it reads
(fixtures/paired): every expectation is computed from the report's own rounds, never a figure copied from a run."""
import json
import math
from pathlib import Path

import pytest

from sglang_ddtree_tools import paired

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_median_interval_is_the_sign_tests_order_statistics():
    assert paired.median_interval([1, 2, 3, 4, 5]) is None  # 2 / 2**5 = 6.25% > 5%: no 95% interval from 5
    assert paired.median_interval([3, 1, 2, 6, 5, 4]) == (1, 6)  # 2 / 64 = 3.1% <= 5%
    xs = list(range(1, 11))
    assert paired.median_interval(xs[::-1]) == (2, 9)  # the textbook ranks for n = 10
    assert paired.median_interval(list(range(1, 21))) == (6, 15)  # and for n = 20
    # the interval's coverage, computed the other way: P(x_(k) <= median <= x_(n+1-k)) = 1 - 2 P(Bin <= k-1)
    n, (lo, _) = 20, paired.median_interval(list(range(1, 21)))
    assert 1 - 2 * sum(math.comb(n, i) for i in range(lo)) / 2 ** n >= 0.95
    assert paired.median([3, 1, 2]) == 2 and paired.median([4, 1, 2, 3]) == 2.5


def _run(mode, per_round, graphs=True, status="ok", budget=None, block=None):
    rounds = [{"status": status if v else "failed", "levels": [{"concurrency": 1, "output_tok_s": v or 0.0,
                                                                "errors": 0}]} for v in per_round]
    return {"mode": mode, "graphs": graphs, "budget": budget, "block": block, "status": status, "rounds": rounds,
            "levels": rounds[0]["levels"]}


def _doc(runs, env=None, cpus=None):
    return {"model": {"target": "/t"}, "runs": runs,
            "settings": {"max_new_tokens": 8, "prompts": {"count": 2}, "requests_per_level": {"1": 2},
                         "server_args": "", "server_cpus": cpus, "ddtree_env": env or {}}}


def test_rounds_pair_within_a_report_pool_across_reports_and_never_across_conditions():
    a = _doc([_run("dflash", [100, 200, None], block=16), _run("tree-verify", [120, 180, 300], budget=31)])
    b = _doc([_run("dflash", [50], block=16), _run("tree-verify", [75], budget=31)])
    c = _doc([_run("dflash", [100], block=16), _run("tree-verify", [500], budget=31)], cpus=[0, 1])
    rows = paired.pairs([a, b, c])
    pooled = next(r for r in rows if r["conditions"]["cpus"] is None)
    # round 3 of report a: dflash failed -> no pair; b's one round pairs with nothing but b's own dflash
    assert [p["ratio"] for p in pooled["pairs"]] == [1.2, 0.9, 1.5]
    assert (pooled["n"], pooled["median_ratio"], pooled["ahead"], pooled["interval"]) == (3, 1.2, 2, None)
    assert (pooled["median_tok_s"], pooled["peer_median_tok_s"]) == (120.0, 100.0)
    pinned = next(r for r in rows if r["conditions"]["cpus"] == [0, 1])
    assert [p["ratio"] for p in pinned["pairs"]] == [5.0]
    text = paired.format_pairs(rows)
    assert "tree-verify B=31 graphs=on / dflash blk=16 graphs=on at c=1: median paired ratio 1.20x (95% interval " \
           "none with 3 pairs (6 needed)), ahead in 2 of 3 rounds; ratios 1.20 0.90 1.50" in text
    assert "[server CPUs [0, 1]]" in text and "[defaults]" in text
    # a run is only compared with its peer at the same graphs setting
    d = _doc([_run("dflash", [100], graphs=False, block=16), _run("tree-verify", [150], budget=31)])
    assert paired.pairs([d]) == []
    assert [r["run"] for r in paired.pairs([a], peer="tree-verify")] == ["dflash blk=16 graphs=on"]


def test_what_a_ratio_is_made_of_accept_and_step_paired_like_the_ratio():
    """Each pair also says how many tokens a step bought (accept) and what a step cost (bench's step_ms p50)
    against the peer's; the row takes their medians, and the line prints them."""
    def run(mode, rounds, **kw):
        r = _run(mode, [t for t, _, _ in rounds], **kw)
        for rnd, (_, acc, step) in zip(r["rounds"], rounds):
            rnd["levels"][0].update(accept_length=acc, step_ms={"p50": step, "p99": step}, ttft_ms={"p50": 9.0})
        return r
    doc = _doc([run("dflash", [(100, 5.0, 2.0), (90, 5.0, 2.5)], block=16),
                run("tree-verify", [(120, 7.5, 2.4), (99, 7.5, 2.5)], budget=63)])
    (row,) = paired.pairs([doc])
    assert [(p["accept_ratio"], p["step_ratio"]) for p in row["pairs"]] == [(1.5, 1.2), (1.5, 1.0)]
    assert (row["median_accept_ratio"], row["median_step_ratio"], row["median_step_ms"],
            row["median_peer_step_ms"], row["step_estimated"]) == (1.5, 1.1, 2.45, 2.25, False)
    assert "; accept 1.50x, step 1.10x the peer's (2.45 vs 2.25 ms) [defaults]" in paired.format_pairs([row])
    # plain's accept is one token a step
    plain = _doc([run("dflash", [(100, 5.0, 2.0)], block=16), _run("plain", [40])])
    assert paired.pairs([plain])[0]["median_accept_ratio"] == 0.2


def test_each_pair_says_how_fast_each_sides_scheduler_cpu_was():
    """host.sched_cpu_ms (the loop time, before the server started, of the CPU its scheduler ran on): per pair the
    run's over the peer's, the median, and in how many pairs the run had the slower CPU; the overlap scheduler's
    DDTREE server is a row of its own (named by what its server said it ran), paired with the same DFLASH."""
    def run(mode, per_round, cpu_ms, **kw):
        r = _run(mode, per_round, **kw)
        for rnd, ms in zip(r["rounds"], cpu_ms):
            if ms is not None:
                rnd["levels"][0]["host"] = {"busy_pct": 8.0, "steal_pct": 0.0, "procs": [], "sched_cpu_ms": ms}
        return r
    ov = run("tree-verify", [260, 240, 250], [200.0, 400.0, 300.0], budget=127)
    ov["overlap_schedule"] = True
    doc = _doc([run("dflash", [200, 200, 200], [200.0, 200.0, None], block=16),
                run("tree-verify", [300, 150, 250], [300.0, 400.0, 200.0], budget=127), ov])
    rows = {r["run"]: r for r in paired.pairs([doc])}
    sync, over = rows["tree-verify B=127 graphs=on"], rows["tree-verify B=127 overlap graphs=on"]
    assert [p.get("cpu_ratio") for p in sync["pairs"]] == [1.5, 2.0, None]  # round 3: DFLASH's CPU not read
    assert sync["median_cpu_ratio"] == 1.75 and [p["ratio"] for p in over["pairs"]] == [1.3, 1.2, 1.25]
    assert "its scheduler's CPU 1.75x the peer's loop time (slower in 2 of 2)" in paired.format_pairs([sync])
    assert "its scheduler's CPU 1.50x the peer's loop time (slower in 1 of 2)" in paired.format_pairs([over])
    bare = _doc([_run("dflash", [100], block=16), _run("tree-verify", [150], budget=31)])
    assert "median_cpu_ratio" not in paired.pairs([bare])[0] and "CPU" not in paired.format_pairs(paired.pairs([bare]))


def test_reports_from_before_step_ms_get_an_estimate_at_one_request_only():
    """Without step_ms, a one-request level's step is estimated from what it kept: (max_new / tok/s - TTFT p50)
    over max_new / accept steps; said so in the line. At higher concurrency there is no such estimate."""
    def run(mode, tok_s, acc, conc=1, **kw):
        r = _run(mode, [tok_s], **kw)
        r["rounds"][0]["levels"][0].update(accept_length=acc, ttft_ms={"p50": 10.0}, concurrency=conc)
        return r
    (row,) = paired.pairs([_doc([run("dflash", 400.0, 4.0, block=16), run("tree-verify", 500.0, 8.0, budget=63)])])
    # max_new 8: dflash 20 ms a request, 10 after the TTFT, over 2 steps: 5 ms; DDTREE 6 ms over 1 step
    assert (row["pairs"][0]["step_ms"], row["pairs"][0]["peer_step_ms"], row["step_estimated"]) == (6.0, 5.0, True)
    assert "step 1.20x the peer's (6.00 vs 5.00 ms, estimated from tok/s and TTFT)" in paired.format_pairs([row])
    (c4,) = paired.pairs([_doc([run("dflash", 400.0, 4.0, conc=4, block=16),
                                run("tree-verify", 500.0, 8.0, conc=4, budget=63)])])
    assert "median_step_ratio" not in c4 and "step " not in paired.format_pairs([c4])


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "paired"


def fixture(name: str) -> dict:
    """A real H200 report trimmed to what paired reads (fixtures/paired/*.json: each names its source)."""
    return json.loads((FIXTURES / name).read_text())


def round_tok_s(doc: dict, label: str, concurrency: int = 1) -> list:
    """A run's tok/s in each round at one concurrency, read straight from the report (None: no figure)."""
    run = next(r for r in doc["runs"] if paired._label(r) == label)
    out = []
    for rnd in run["rounds"]:
        lv = next((x for x in rnd["levels"] if x["concurrency"] == concurrency), None)
        out.append(lv["output_tok_s"] if lv and rnd["status"] == "ok" and lv["output_tok_s"] > 0 else None)
    return out


def expected_ratios(doc: dict, label: str, peer: str, concurrency: int = 1) -> list:
    """Each round's ratio of `label` to `peer` where both have a figure: what a pair must be."""
    mine, theirs = round_tok_s(doc, label, concurrency), round_tok_s(doc, peer, concurrency)
    return [round(a / b, 4) for a, b in zip(mine, theirs) if a and b]


def check_row(row: dict) -> None:
    """What every pooled row must be whatever the figures: its statistics computed from its own pairs."""
    ratios = [p["ratio"] for p in row["pairs"]]
    assert row["n"] == len(ratios) and row["ahead"] == sum(r > 1 for r in ratios)
    assert row["median_ratio"] == round(paired.median(ratios), 4)
    assert row["median_tok_s"] == round(paired.median([p["tok_s"] for p in row["pairs"]]), 1)
    for p in row["pairs"]:
        assert p["ratio"] == round(p["tok_s"] / p["peer_tok_s"], 4)
    if len(ratios) < 6:
        assert row["interval"] is None
    else:  # two of the ratios themselves, bracketing the median
        lo, hi = row["interval"]
        assert lo in ratios and hi in ratios and lo <= row["median_ratio"] <= hi


def test_a_real_reports_rounds_pair_by_round_and_its_statistics_follow_from_the_pairs():
    """Both DDTREE schedulers against the same DFLASH server in the same rounds (bench --overlap both): each
    scheduler has its own row, named by the scheduler its server ran; a pair is the two servers' tok/s of one
    round; accept and step ratios come from the same round's levels."""
    doc = fixture("sync-overlap-same-rounds.json")
    rows = {r["run"]: r for r in paired.pairs([doc]) if r["concurrency"] == 1}
    peer = "dflash blk=16 graphs=on"
    assert sorted(rows) == ["tree-verify B=127 graphs=on", "tree-verify B=127 overlap graphs=on"]
    for label, row in rows.items():
        assert row["peer"] == peer
        assert [p["ratio"] for p in row["pairs"]] == expected_ratios(doc, label, peer)
        check_row(row)
        run = next(r for r in doc["runs"] if paired._label(r) == label)
        base = next(r for r in doc["runs"] if r["mode"] == "dflash")
        for p in row["pairs"]:
            mine, theirs = run["rounds"][p["round"]]["levels"][0], base["rounds"][p["round"]]["levels"][0]
            assert p["accept_ratio"] == round(mine["accept_length"] / theirs["accept_length"], 4)
            assert p["step_ms"] == mine["step_ms"]["p50"] and not p["step_estimated"]  # measured, not estimated
    assert all(r["overlap_schedule"] == ("overlap" in paired._label(r)) for r in doc["runs"] if r["mode"] != "dflash")


def test_reports_of_the_same_conditions_pool_and_other_conditions_stay_apart():
    """Two reports of the same target, prompts and settings pool their pairs (n adds up); a report whose servers
    were pinned to CPUs is its own row; a report whose DDTREE server crashed in every round adds no pair."""
    a, b = fixture("sync-overlap-same-rounds.json"), fixture("b63-b127-sync.json")
    assert paired.conditions(a) == paired.conditions(b)
    label, peer = "tree-verify B=127 graphs=on", "dflash blk=16 graphs=on"
    pooled = next(r for r in paired.pairs([b, a]) if r["run"] == label and r["concurrency"] == 1)
    assert [p["ratio"] for p in pooled["pairs"]] == expected_ratios(b, label, peer) + expected_ratios(a, label, peer)
    assert [p["report"] for p in pooled["pairs"]] == [0] * len(expected_ratios(b, label, peer)) + \
        [1] * len(expected_ratios(a, label, peer))
    check_row(pooled)
    # with six pairs or more the sign test's interval exists and brackets the median (check_row); here: below six
    assert (pooled["interval"] is None) == (pooled["n"] < 6)

    unpinned, pinned, crashed = fixture("unpinned.json"), fixture("pinned.json"), fixture("ddtree-crashed.json")
    assert paired.conditions(pinned)["cpus"] and not paired.conditions(unpinned)["cpus"]
    rows = paired.pairs([unpinned, pinned, crashed])
    assert len(rows) == 2 and {bool(r["conditions"]["cpus"]) for r in rows} == {True, False}
    for r in rows:
        doc = pinned if r["conditions"]["cpus"] else unpinned
        assert [p["ratio"] for p in r["pairs"]] == expected_ratios(doc, r["run"], r["peer"])
        assert {p["report"] for p in r["pairs"]} == {1 if doc is pinned else 0}  # nothing from the crashed one
        check_row(r)
    assert all(x is None for x in round_tok_s(crashed, next(paired._label(r) for r in crashed["runs"]
                                                             if r["mode"] == "tree-verify")))


def test_every_pooled_row_of_the_kept_reports_follows_from_its_pairs():
    """Over every fixture together: each row's statistics are those of its own pairs, at every concurrency."""
    docs = [fixture(p.name) for p in sorted(FIXTURES.glob("*.json"))]
    rows = paired.pairs(docs)
    assert rows
    for r in rows:
        check_row(r)
    text = paired.format_pairs(rows)
    for r in rows:
        assert f"{r['run']} / {r['peer']} at c={r['concurrency']}: median paired ratio {r['median_ratio']:.2f}x" in text
