"""DDTree tree builders: reference heap == brute force == batched torch builder."""

import random

import pytest
import torch

from sglang_ddtree.tree import (
    build_tree_batched,
    build_tree_brute_force,
    build_tree_reference,
    child_sibling_links,
    rank_draft_tokens,
)


def _random_logprobs(rng, n_pos, vocab, ties):
    x = torch.randn(n_pos, vocab, generator=rng) * 2.0
    if ties:
        x = torch.round(x)  # many exact ties in log-probs and in cumulative scores
    return torch.log_softmax(x, dim=-1)


CASES = [(v, l, b) for v in (1, 2, 3, 4) for l in (1, 2, 3) for b in (1, 2, 5, 9, 14) if v**l <= 64]


@pytest.mark.parametrize("vocab,n_pos,budget", CASES)
@pytest.mark.parametrize("ties", [False, True])
def test_reference_equals_brute_force_and_batched(vocab, n_pos, budget, ties):
    rng = torch.Generator().manual_seed(1000 * vocab + 10 * n_pos + budget + ties)
    for _ in range(3):
        lp = _random_logprobs(rng, n_pos, vocab, ties)
        ref = build_tree_reference(lp, budget)
        assert ref == build_tree_brute_force(lp, budget)
        assert ref == build_tree_batched(lp, budget).unbind()[0]


def test_neg_inf_and_max_depth():
    lp = torch.log_softmax(torch.tensor([[0.0, 0.0, -50.0], [1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]), -1)
    lp[1, 2] = float("-inf")
    for md in (1, 2, 3):
        ref = build_tree_reference(lp, 7, max_depth=md)
        assert max(ref.depths) <= md
        assert ref == build_tree_brute_force(lp, 7, max_depth=md)
        assert ref == build_tree_batched(lp, 7, max_depth=md).unbind()[0]


def _check_structure(t):
    seen = set()
    for s in range(1, len(t.tokens)):
        p = t.parents[s]
        assert 0 <= p < s, "parent slot must precede child slot"
        assert t.depths[s] == t.depths[p] + 1
        prefix = t.prefix_tokens(s)
        assert prefix not in seen
        seen.add(prefix)
        assert prefix[:-1] in seen or len(prefix) == 1, "prefix-closed"
    # siblings: ascending slots in ascending rank
    by_parent = {}
    for s in range(1, len(t.tokens)):
        by_parent.setdefault(t.parents[s], []).append(s)
    for kids in by_parent.values():
        assert kids == sorted(kids)
        assert [t.ranks[k] for k in kids] == list(range(len(kids))), "siblings are ranks 0..k-1"
        # scores never increase along the slot order
    assert all(t.scores[i] >= t.scores[i + 1] for i in range(1, len(t.scores) - 1))


@pytest.mark.parametrize("budget", [1, 16, 64, 256])
def test_batched_large_vocab_matches_reference(budget):
    rng = torch.Generator().manual_seed(budget)
    n, n_pos, vocab = 4, 15, 1000
    lp = torch.log_softmax(torch.randn(n, n_pos, vocab, generator=rng) * 3, dim=-1)
    batch = build_tree_batched(lp, budget)
    assert batch.token_ids.shape == (n, budget + 1)
    for i, t in enumerate(batch.unbind()):
        ref = build_tree_reference(lp[i], budget)
        assert t == ref
        assert t.num_nodes == budget
        _check_structure(t)


def test_first_child_next_sibling_links():
    rng = torch.Generator().manual_seed(7)
    lp = torch.log_softmax(torch.randn(3, 6, 50, generator=rng), -1)
    batch = build_tree_batched(lp, 40)
    for i, t in enumerate(batch.unbind()):
        fc = batch.first_child[i].tolist()
        ns = batch.next_sibling[i].tolist()
        for s in range(len(t.tokens)):
            kids = [k for k in range(1, len(t.tokens)) if t.parents[k] == s]
            assert fc[s] == (kids[0] if kids else -1)
            if s == 0:
                assert ns[s] == -1
            else:
                sibs = [k for k in range(s + 1, len(t.tokens)) if t.parents[k] == t.parents[s]]
                assert ns[s] == (sibs[0] if sibs else -1)


def test_child_sibling_links_handles_padding():
    parents = torch.tensor([[-1, 0, 0, 1, -1]])
    fc, ns = child_sibling_links(parents)
    assert fc.tolist() == [[1, 3, -1, -1, -1]]
    assert ns.tolist() == [[-1, 2, -1, -1, -1]]


def test_small_search_space_pads():
    lp = torch.log_softmax(torch.randn(2, 2), -1)  # 2 + 4 = 6 prefixes < B
    ref = build_tree_reference(lp, 10)
    assert ref.num_nodes == 6
    batch = build_tree_batched(lp, 10)
    assert batch.valid[0].tolist() == [True] * 7 + [False] * 4
    assert batch.unbind()[0] == ref
    assert ref == build_tree_brute_force(lp, 10)


def test_rank_tie_rule_lower_token_id_first():
    lp = torch.log(torch.tensor([[0.1, 0.3, 0.1, 0.3, 0.2]]))
    vals, ids = rank_draft_tokens(lp, 4)
    assert ids.tolist() == [[1, 3, 4, 0]]


def test_reference_rejects_logits_and_nan():
    with pytest.raises(ValueError, match="log-probabilities"):
        build_tree_reference(torch.tensor([[1.0, 2.0]]), 2)
    with pytest.raises(ValueError, match="NaN"):
        build_tree_reference(torch.tensor([[float("nan"), -1.0]]), 2)


def test_random_fuzz_mixed_batches():
    rnd = random.Random(3)
    for _ in range(20):
        n, l, v, b = rnd.randint(1, 5), rnd.randint(1, 6), rnd.randint(2, 40), rnd.randint(1, 70)
        lp = torch.log_softmax(torch.randn(n, l, v) * rnd.choice([0.3, 1, 4]), -1)
        if rnd.random() < 0.5:
            lp = torch.log_softmax(torch.round(lp * 2), -1)
        batch = build_tree_batched(lp, b)
        assert batch.unbind() == [build_tree_reference(lp[i], b) for i in range(n)]
