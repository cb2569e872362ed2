"""ddtree_checks.serve_matrix's server set (the lossless matrix of issue 12 item 6 runs on the H200; here only what
it would start): each tree-verify budget on the scheduler --overlap asks, and with ``both`` on each of the two."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # graph_check's siblings import the plugin's smoke helpers
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree" / "gpu_checks"))
from ddtree_checks import serve_matrix as sm  # noqa: E402


def _specs(family, overlap, budgets=(63, 127)):
    import argparse

    a = argparse.Namespace(block=16, graphs=True, mem_fraction=0.85, max_total_tokens=32768, concurrency=8,
                           budgets=list(budgets), overlap=overlap)
    return sm._specs(family, {"target": "/t", "drafter": "/d"}, False, a)


@pytest.mark.parametrize("overlap,env", [("default", {}), ("on", {"SGLANG_DDTREE_OVERLAP": "1"}),
                                         ("off", {"SGLANG_DDTREE_OVERLAP": "0"})])
def test_one_scheduler(overlap, env):
    specs = _specs("dense", overlap)
    tv = {n: s for n, s in specs.items() if n.startswith("tree-verify")}
    assert sorted(tv) == ["tree-verify B=127", "tree-verify B=63"]
    for name, (spec, e) in tv.items():
        assert e == env and spec.mode == "tree-verify" and spec.budget == int(name.split("=")[1])
    # the reference servers never get the switch
    assert specs["dflash"][1] == {} and specs["plain"][1] == {}


def test_both_schedulers_each_budget_and_the_env_the_plugin_reads():
    from sglang_ddtree import config

    specs = _specs("hybrid", "both", budgets=(127,))
    assert specs["tree-verify B=127"][1] == {"SGLANG_DDTREE_OVERLAP": "0"}
    assert specs["tree-verify B=127 overlap"][1] == {"SGLANG_DDTREE_OVERLAP": "1"}
    assert specs["tree-verify B=127 overlap"][0].budget == 127
    # the leaky variant keeps its own env only (eager, default scheduler)
    assert specs["LEAKY tree-verify B=15"][1] == {"SGLANG_DDTREE_UNSAFE_CHAIN_STATE": "1"}
    # the env is what the plugin's decision reads: one server synchronous, the other overlap
    cfg = config.DDTreeConfig(mode=config.TREE_VERIFY, budget=127, num_draft_tokens=128, topk=1,
                              drafter_block_size=16)
    on = [config.overlap_decision(cfg, 16, True, environ=specs[n][1])[0]
          for n in ("tree-verify B=127", "tree-verify B=127 overlap")]
    assert on == [False, True]


def test_summary_names_the_scheduler_once():
    doc = {"gpu": "H200", "torch": "2.11.0", "sglang": "0.5.17", "sglang_ddtree": "x", "prompts": 1, "tokens": 1,
           "margin": 0.05, "families": {"dense": {"servers": {
               "tree-verify B=127": {"overlap_schedule": False, "error": "boom"},
               "tree-verify B=127 overlap": {"overlap_schedule": True, "error": "boom"},
               "tree-verify B=63": {"overlap_schedule": True, "error": "boom"}}}}}
    lines = sm.summary(doc).splitlines()
    assert any("tree-verify B=127 overlap " in ln and "ovl" not in ln for ln in lines)
    assert any("tree-verify B=63 ovl" in ln for ln in lines)
    assert not any("B=127 ovl" in ln for ln in lines)


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200_b127_lossless_both_schedulers"


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_the_h200_matrix_of_session_11_b127_both_schedulers(family):
    """Session 11's lossless matrix on the H200 (MATRIX_OVERLAP=both, B=127, 64 prompts x 128 tokens, one at a time
    and 8 at a time), as its closing note reads it: every DDTREE server on either scheduler within two bf16 steps
    (0.125 nats) of the target's argmax, as plain decoding against its own re-score is; the same tokens one at a time
    on both schedulers; a real share of accepted tokens off the first branch; the leaky variant off by whole nats."""
    import json

    doc = json.loads((RESULTS / f"matrix-{family}.json").read_text())
    assert doc["overlap"] == "both" and doc["prompts"] == 64 and doc["tokens"] == 128 and doc["graphs"]
    srv = doc["families"][family]["servers"]
    sync, ov = srv["tree-verify B=127"], srv["tree-verify B=127 overlap"]
    assert (sync["overlap_schedule"], ov["overlap_schedule"]) == (False, True)
    plain_gap = max(srv["plain"][r]["max_off_argmax_gap"] for r in ("sequential", "concurrent8"))
    for r in (sync, ov):
        for run in ("sequential", "concurrent8"):
            st = r[run]
            assert st["tokens"] == 64 * 128 and st["max_off_argmax_gap"] <= max(plain_gap, 0.125)
            assert st["off_argmax_gaps"][">0.5"] == 0 and st["off_argmax_gaps"]["<=0.5"] <= 1
        stats = r["log"]["accept_stats"]
        assert stats["off_first_branch_share"] > 0.3 and stats["own_rank_gt0"] > 0.1 * stats["accepted"]
        assert all(g["failures"] == 0 and g["eager_keys"] == 0 for g in stats["glue_graphs"].values())
        assert r["log"]["tree_mask_graph"]
        assert r["sampling"]["completed"] == r["sampling"]["requests"] == 32
        assert r["sequential"]["mean_accept_length"] > 1.3 * srv["dflash"]["sequential"]["mean_accept_length"]
    # one request at a time the two schedulers emitted the same tokens (same first divergences from plain, same
    # worst token), so the overlap scheduler's one-step lag changed nothing
    assert sync["sequential"]["worst_violation"] == ov["sequential"]["worst_violation"]
    assert sync["sequential"]["exact_match_vs_plain"] == ov["sequential"]["exact_match_vs_plain"]
    if family == "hybrid":
        leaky = srv["LEAKY tree-verify B=15"]["sequential"]
        assert leaky["off_argmax_gaps"][">0.5"] > 100 and leaky["max_off_argmax_gap"] >= 1.0
