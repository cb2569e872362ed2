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


FIXTURE = Path(__file__).resolve().parent / "fixtures" / "serve_matrix_hybrid.json"


def test_summary_of_a_real_matrix_says_what_each_server_measured():
    """A real H200 matrix (fixtures/serve_matrix_hybrid.json: five servers of a hybrid-family run, both schedulers
    at B=127): one line per server and run with the figures of its document (violations, off-argmax tokens, the
    largest gap, exact matches, accept length, tok/s, sampling, gap buckets), a counters line per tree-verify
    server, and each server named once by the scheduler it ran."""
    import json

    doc = json.loads(FIXTURE.read_text())
    lines = sm.summary(doc).splitlines()
    assert lines[0] == (f"# {doc['gpu']}; torch {doc['torch']}; SGLang {doc['sglang']}; "
                        f"sglang-ddtree {doc['sglang_ddtree']}")
    assert f"more than {doc['margin']} nats" in lines[1]
    rows = lines[3:]
    for name, r in doc["families"]["hybrid"]["servers"].items():
        runs = [k for k in r if k.startswith(("sequential", "concurrent"))]
        mine = [ln for ln in rows if ln.startswith(f"hybrid  {name:24} ")]
        for run in runs:
            st = r[run]
            (ln,) = [x for x in mine if x.split()[len(name.split()) + 1] == run]
            words = ln[len(f"hybrid  {name:24} "):].split()
            assert words[0] == run and int(words[1]) == st["violations"] and int(words[2]) == st["off_argmax"]
            assert float(words[3]) == round(st["max_off_argmax_gap"], 3)
            em = st["exact_match_vs_plain"]
            assert words[4] == f"{em['identical']}/{em['prompts']}"
            assert f"{st['tokens_per_s']:7.1f}".strip() in words
            assert all(f"{k}:{v}" in ln for k, v in (st.get("off_argmax_gaps") or {}).items())
            samp = r.get("sampling") or {}
            assert f"{samp.get('completed', '-')}/{samp.get('requests', '-')}" in words
        counters = [ln for ln in mine if " counters: " in ln]
        stats = (r.get("log") or {}).get("accept_stats")
        assert len(counters) == (1 if stats else 0)
        if stats:
            assert f"{stats['accepted']} accepted, {stats['off_first_branch']} off the first branch" in counters[0]
            for k, g in (stats.get("glue_graphs") or {}).items():
                assert f"{k} {g['replays']} replays / {g['failures']} failures" in counters[0]
        assert len(mine) == len(runs) + len(counters)
    # the overlap server is named once ("... overlap", never "... overlap ovl"), the synchronous one plainly
    assert not any(" ovl " in ln for ln in rows)
    srv = doc["families"]["hybrid"]["servers"]
    assert (srv["tree-verify B=127"]["overlap_schedule"], srv["tree-verify B=127 overlap"]["overlap_schedule"]) == \
        (False, True)


def test_summary_says_which_step_served_a_schedules_chain_entries():
    """A server whose accept-stats line counts its chain-entry steps (``chain_steps``: DFLASH's own step and the
    plugin's) has both counts on its counters line; a server whose line has none has no such words."""
    import copy
    import json

    doc = json.loads(FIXTURE.read_text())
    servers = doc["families"]["hybrid"]["servers"]
    name = next(n for n, r in servers.items() if (r.get("log") or {}).get("accept_stats"))
    other = copy.deepcopy(doc)
    servers[name]["log"]["accept_stats"]["chain_steps"] = {"dflash": 417, "plugin": 3}
    (ln,) = [x for x in sm.summary(doc).splitlines() if x.startswith(f"hybrid  {name:24} counters: ")]
    assert ln.endswith(", chain steps dflash 417, chain steps plugin 3")
    assert not any("chain steps" in x for x in sm.summary(other).splitlines())
