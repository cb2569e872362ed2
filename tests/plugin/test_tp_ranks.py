"""Tree-verify under tensor parallelism: every rank builds the same tree and accepts the same path.

Two real torch.distributed processes (gloo, on CPU) play a TP=2 group: each rank holds its own vocab shard of the
target's LM head and, on purpose, its own local noise in the drafter's hidden states (as ranks whose local
arithmetic differs would). They run the plugin's own step functions (sglang_ddtree.step: draft_topk_candidates,
tp_merged_candidates over the real all_gather_into_tensor, build_tree_from_candidates, follow_rank0 over the real
broadcast), then gather what each rank decided and compare: the trees must be equal bit for bit on both ranks,
and the sampled accept (drawn from per-rank random coins) must be rank 0's on both after follow_rank0.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ddtree.step import (
    build_tree_from_candidates,
    draft_topk_candidates,
    follow_rank0,
    merge_vocab_shards,
    tp_merged_candidates,
)

sys.path.insert(0, str(Path(__file__).parent))
from _tp_rank import BUDGET, L, N, V, head_and_hidden  # noqa: E402

RANK = Path(__file__).parent / "_tp_rank.py"


def _run_group(tmp_path, noise: bool, world: int = 2):
    """Each rank as its own Python process (tests/plugin/_tp_rank.py: no fork of this process's thread pools)."""
    store = tmp_path / f"store-{noise}"
    outs = [tmp_path / f"rank{r}-{noise}.json" for r in range(world)]
    ps = [subprocess.Popen([sys.executable, str(RANK), str(r), str(world), str(store), str(int(noise)), str(outs[r])],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = []
    for p in ps:
        try:
            logs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            for q in ps:
                q.kill()
            pytest.fail("a rank did not finish in 120 s")
    for r, p in enumerate(ps):
        assert p.returncode == 0, f"rank {r}:\n{logs[r]}"
    return {r: json.loads(outs[r].read_text()) for r in range(world)}


@pytest.mark.parametrize("noise", [False, True])
def test_tp2_ranks_build_the_same_tree_and_follow_rank0s_sampled_accept(tmp_path, noise):
    got = _run_group(tmp_path, noise)
    every = got[0]["every"]
    assert every == got[1]["every"]  # both ranks saw the same gathered decisions
    assert every[0] == every[1], "the two ranks built different trees"
    before, after = got[0]["before"], got[0]["after"]
    assert before[0] != before[1]  # the per-rank coins differed (the test can see a divergence)
    assert after[0] == after[1] == before[0]  # and rank 0's accept is the one every rank commits
    if not noise:  # without noise the merged shards are the dense head's own top-k (the tie to the lower id)
        weight, hidden = head_and_hidden()
        v, i, lse = draft_topk_candidates(hidden @ weight.T, BUDGET)
        dense_lp, dense_ids = merge_vocab_shards(v.unsqueeze(0), i.unsqueeze(0), lse.unsqueeze(0), BUDGET)
        assert got[0]["ids"] == dense_ids.tolist()
        assert torch.allclose(torch.tensor(got[0]["lp"], dtype=torch.float64), dense_lp, atol=1e-5)


def test_a_rank_deciding_from_its_own_shard_would_diverge():
    """The failure the gather prevents: a rank that built its tree from its own shard's candidates alone (no
    all_gather) gets another tree than its peer -- so the equality above is a real check, not a tautology."""
    weight, hidden = head_and_hidden()
    trees = []
    for lo, hi in ((0, V // 2), (V // 2, V)):
        v, i, lse = draft_topk_candidates(hidden @ weight[lo:hi].T, BUDGET, vocab_start=lo)
        lp, ids = tp_merged_candidates(v, i, lse, BUDGET, 1)
        trees.append(build_tree_from_candidates(lp.view(N, L, -1), ids.view(N, L, -1), BUDGET).token_ids)
    assert not torch.equal(trees[0], trees[1])


def test_one_rank_needs_no_collective():
    called = []
    follow_rank0([torch.zeros(2)], 1, lambda *a, **k: called.append(a))
    v, i, lse = draft_topk_candidates(torch.randn(2, 9), 4)
    lp, ids = tp_merged_candidates(v, i, lse, 4, 1, lambda *a: called.append(a))
    assert called == [] and lp.shape == ids.shape == (2, 4)
