"""sglang_ddtree.paired: a mode against its peer round by round (never median against median), with the sign
test's distribution-free interval; tested on made-up reports and on the reports kept from the H200."""
import json
import math
from pathlib import Path

import pytest

from sglang_ddtree import paired

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
