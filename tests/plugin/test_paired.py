"""sglang_ddtree_tools.paired: a mode against its peer round by round (never median against median), with the sign
test's distribution-free interval; tested on made-up reports and on the reports kept from the H200."""
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


def test_the_h200_reports_of_session_7_read_as_the_closing_note_says():
    """Session 7's unpinned reports (2 + 2 rounds, DFLASH then DDTREE each round): paired ratios 1.12, 0.87
    (nopin), 0.86, 1.97 (r4): a median of 1.00x, no 95% interval from 4 pairs. The pinned report is its own row;
    glue level 3's report has no pair (its DDTREE server crashed in both rounds)."""
    s7 = RESULTS / "h200_s7"
    docs = [json.loads((s7 / f"bench-dense-{n}.json").read_text()) for n in ("gdef-nopin", "gdef-r4", "gdef-pin", "g3")]
    rows = paired.pairs(docs)
    assert len(rows) == 2
    unpinned = next(r for r in rows if not r["conditions"]["cpus"])
    assert [round(p["ratio"], 2) for p in unpinned["pairs"]] == [1.12, 0.87, 0.86, 1.97]
    assert round(unpinned["median_ratio"], 2) == 1.00 and unpinned["interval"] is None and unpinned["ahead"] == 2
    pinned = next(r for r in rows if r["conditions"]["cpus"])
    assert [round(p["ratio"], 2) for p in pinned["pairs"]] == [1.43, 1.22]


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


def test_the_h200_reports_of_session_9_b63_race():
    """Session 9's three calls (REQUESTS=32, unpinned, DFLASH block 16 against DDTREE B=31 and B=63 at one
    request): 10 B=63 pairs, median 1.21x, the sign test's interval 0.96-1.51, ahead in 8; accept 1.47x and a
    step ~1.21x DFLASH's (estimated: these reports predate step_ms)."""
    docs = [json.loads(p.read_text()) for p in sorted((RESULTS / "h200_s9").glob("bench-dense-gdef-s9*.json"))]
    rows = {r["run"]: r for r in paired.pairs(docs)}
    b63 = rows["tree-verify B=63 graphs=on"]
    assert [round(p["ratio"], 2) for p in b63["pairs"]] == [1.39, 1.60, 1.16, 0.96, 0.84, 1.22, 1.28, 1.19, 1.20,
                                                             1.51]
    assert (round(b63["median_ratio"], 2), b63["ahead"]) == (1.21, 8)
    assert [round(x, 2) for x in b63["interval"]] == [0.96, 1.51]
    assert round(b63["median_accept_ratio"], 2) == 1.47 and 1.1 < b63["median_step_ratio"] < 1.3
    assert b63["step_estimated"] and rows["tree-verify B=31 graphs=on"]["n"] == 2


def test_the_h200_reports_of_session_10_pool_with_session_9():
    """Session 10 (step_ms measured): B=127 on the synchronous scheduler (s10a, s10c: 3 pairs) and on the overlap
    one (s10b, SGLANG_DDTREE_OVERLAP=1: its own row, 3 pairs); s10a's two B=63 pairs pool with session 9's ten
    (the same conditions): 12 pairs, median 1.20x, interval 0.96-1.39, ahead in 9."""
    paths = sorted((RESULTS / "h200_s9").glob("bench-dense-gdef-s9*.json")) + \
        sorted((RESULTS / "h200_s10").glob("bench-dense-*.json"))
    rows = paired.pairs([json.loads(p.read_text()) for p in paths])
    # s10b set SGLANG_DDTREE_OVERLAP=1 for the whole call: its DDTREE server is named by the scheduler it ran (its
    # /server_info), and the switch is not a condition that keeps its DFLASH pairs apart
    by = {r["run"]: r for r in rows if r["concurrency"] == 1}
    assert sorted(by) == ["tree-verify B=127 graphs=on", "tree-verify B=127 overlap graphs=on",
                          "tree-verify B=31 graphs=on", "tree-verify B=63 graphs=on"]
    b63 = by["tree-verify B=63 graphs=on"]
    assert b63["n"] == 12 and (round(b63["median_ratio"], 2), b63["ahead"]) == (1.20, 9)
    assert [round(x, 2) for x in b63["interval"]] == [0.96, 1.39]
    sync, ov = by["tree-verify B=127 graphs=on"], by["tree-verify B=127 overlap graphs=on"]
    assert [round(p["ratio"], 2) for p in sync["pairs"]] == [1.56, 1.14, 0.98]
    assert [round(p["ratio"], 2) for p in ov["pairs"]] == [1.28, 1.14, 1.33]
    # accept 8.24 against 5.17 in both; the step measured (not estimated) in these reports
    assert round(sync["median_accept_ratio"], 2) == round(ov["median_accept_ratio"], 2) == 1.60
    assert not ov["step_estimated"] and round(ov["median_step_ratio"], 2) == 1.15
    assert [p["step_ms"] for p in ov["pairs"]] == [3.524, 4.02, 4.185]


def test_the_h200_reports_of_session_11_pool_with_session_10():
    """Session 11: both schedulers in the same rounds against the same DFLASH server (bench --overlap both, s11a and
    s11b) and one round with plain (s11c). Pooled with session 10: B=127 synchronous 8 pairs, median 1.44x,
    interval 0.98-1.84, ahead in 7; overlap 7 pairs, median 1.32x, interval 1.14-1.77, ahead in 7; plain 0.51x
    DFLASH in its round (DDTREE 2.65x plain there)."""
    paths = sorted((RESULTS / "h200_s10").glob("bench-dense-*.json")) + \
        sorted((RESULTS / "h200_s11").glob("bench-dense-*.json"))
    docs = [json.loads(p.read_text()) for p in paths]
    by = {r["run"]: r for r in paired.pairs(docs) if r["concurrency"] == 1}
    sync, ov = by["tree-verify B=127 graphs=on"], by["tree-verify B=127 overlap graphs=on"]
    assert [round(p["ratio"], 2) for p in sync["pairs"]] == [1.56, 1.14, 0.98, 1.51, 1.84, 1.53, 1.31, 1.36]
    assert (sync["n"], round(sync["median_ratio"], 2), sync["ahead"]) == (8, 1.44, 7)
    assert [round(x, 2) for x in sync["interval"]] == [0.98, 1.84]
    assert [round(p["ratio"], 2) for p in ov["pairs"]] == [1.28, 1.14, 1.33, 1.35, 1.77, 1.32, 1.22]
    assert (ov["n"], round(ov["median_ratio"], 2), ov["ahead"]) == (7, 1.32, 7)
    assert [round(x, 2) for x in ov["interval"]] == [1.14, 1.77]
    # session 11's own rounds: DDTREE ahead in every one, on either scheduler
    s11 = [p for r in (sync, ov) for p in r["pairs"] if p["ratio"] > 0 and p["report"] >= 3]
    assert len(s11) == 9 and min(p["ratio"] for p in s11) > 1.2
    # the same rounds, the two schedulers: the synchronous DDTREE server served more in each of the 4
    both = [doc for p, doc in zip(paths, docs) if "-ovboth-" in p.name]
    assert len(both) == 2
    for doc in both:
        tv = {run["overlap_schedule"]: [r["levels"][0]["output_tok_s"] for r in run["rounds"]]
              for run in doc["runs"] if run["mode"] == "tree-verify"}
        assert all(s > o for s, o in zip(tv[False], tv[True])) and len(tv[False]) == 2
    plain = by["plain graphs=on"]
    assert plain["n"] == 1 and round(plain["median_ratio"], 2) == 0.51


def test_cli_exit_codes(tmp_path, capsys):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(_doc([_run("dflash", [100], block=16), _run("tree-verify", [150], budget=31)])))
    assert paired.main([str(good)]) == 0
    assert "median paired ratio 1.50x" in capsys.readouterr().out
    assert paired.main([str(good), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["median_ratio"] == 1.5
    assert paired.main([str(good), "--peer", "plain"]) == 1
    assert "no round where plain and another run both measured" in capsys.readouterr().out
    bad = tmp_path / "b.json"
    bad.write_text("[1, 2]")
    assert paired.main([str(good), str(bad)]) == 2
    assert "not a bench report" in capsys.readouterr().err
    assert paired.main([str(tmp_path / "none.json")]) == 2
