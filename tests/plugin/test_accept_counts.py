"""The tree-verify accept counters (sglang_ddtree.step.tree_accept_counts / TreeAcceptStats) on trees built
by the plugin's own builder and accepted by the reference of SGLang's greedy tree kernel."""

import torch

from sglang_ddtree.compile import compile_tree
from sglang_ddtree.step import (
    TreeAcceptStats,
    build_tree_from_candidates,
    tree_accept_counts,
    tree_accept_greedy_reference,
)


def _tree(n=2, L=3, k=4, budget=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(n, L, k, generator=g, dtype=torch.float64), -1)
    lp, order = torch.sort(lp, dim=-1, descending=True)
    ids = torch.gather(torch.arange(100, 100 + k).expand(n, L, k), 2, order)
    return build_tree_from_candidates(lp, ids, budget)


def _accept(tree, predict):
    vin = compile_tree(tree, torch.tensor([7] * tree.batch_size), torch.tensor([5] * tree.batch_size))
    n, d = tree.token_ids.shape
    cand = vin.draft_token.view(n, d)
    return tree_accept_greedy_reference(cand, vin.retrieve_index, vin.retrieve_next_token,
                                        vin.retrieve_next_sibling, predict, tree.max_depth + 1), cand


def test_chain_acceptance_counts_nothing_off_the_first_branch():
    tree = _tree()
    n, d = tree.token_ids.shape
    # the target predicts, at every node, the rank-0 child's token: the walk follows the first branch
    predict = torch.full((n, d), -5, dtype=torch.int64)
    for b in range(n):
        for s in range(d):
            c = int(tree.first_child[b, s])
            if c >= 0:
                predict[b, s] = tree.token_ids[b, c]
    (_, accept_index, accept_num), _ = _accept(tree, predict)
    c = tree_accept_counts(tree.ranks, accept_index, accept_num, tree.max_depth)
    steps, reqs, accepted, own, off = c[:5].tolist()
    assert (steps, reqs) == (1, n) and accepted == int(accept_num.sum()) > 0
    assert own == 0 and off == 0
    assert sum(c[5:].tolist()) == n


def test_a_rank1_sibling_and_everything_below_it_count():
    tree = _tree(n=1, budget=10)
    d = tree.token_ids.shape[1]
    # pick a depth-1 node of rank 1 and accept it, then its first child
    s1 = next(s for s in range(d) if int(tree.depths[0, s]) == 1 and int(tree.ranks[0, s]) == 1)
    predict = torch.full((1, d), -5, dtype=torch.int64)
    predict[0, 0] = tree.token_ids[0, s1]
    child = int(tree.first_child[0, s1])
    depth_expected = 1
    if child >= 0:
        predict[0, s1] = tree.token_ids[0, child]
        depth_expected = 2
    (_, accept_index, accept_num), _ = _accept(tree, predict)
    assert int(accept_num[0]) == depth_expected
    c = tree_accept_counts(tree.ranks, accept_index, accept_num, tree.max_depth).tolist()
    assert c[2] == depth_expected and c[3] >= 1 and c[4] == depth_expected
    assert c[5 + depth_expected] == 1


def test_stats_fold_steps_and_log_every_n():
    tree = _tree()
    n, d = tree.token_ids.shape
    predict = torch.full((n, d), -5, dtype=torch.int64)
    (_, ai, an), _ = _accept(tree, predict)  # nothing accepted: only the bonus token
    st = TreeAcceptStats(tree.max_depth, every=3)
    assert st.add(tree_accept_counts(tree.ranks, ai, an, tree.max_depth)) is None
    assert st.add(tree_accept_counts(tree.ranks, ai, an, tree.max_depth)) is None
    t = st.add(tree_accept_counts(tree.ranks, ai, an, tree.max_depth))
    assert t["steps"] == 3 and t["requests"] == 3 * n and t["accepted"] == 0
    assert t["accept_length"] == 1.0 and t["depth_hist"][0] == 3 * n
