"""Verify walk: greedy is exact, sampling is lossless (synthetic logits)."""

import torch

from sglang_ddtree.tree import build_tree_batched
from sglang_ddtree.verify import verify_greedy, verify_sample, walk_tree


def _table_logits(prefix, vocab, scale=1.0, salt=0):
    code = salt
    for t in prefix:
        code = code * (vocab + 1) + (t + 1)
    g = torch.Generator().manual_seed(code % (2**62) + 17)
    return torch.randn(vocab, generator=g, dtype=torch.float64) * scale


def _slot_prefixes(tree_row_tokens, tree_row_parents):
    out = [()]
    for s in range(1, len(tree_row_tokens)):
        out.append(out[tree_row_parents[s]] + (tree_row_tokens[s],))
    return out


def test_greedy_equals_stepwise_argmax():
    vocab, n_pos, budget = 6, 5, 24
    agg_accept = 0
    for trial in range(40):
        ctx = (trial % vocab, (trial * 7) % vocab)
        # drafter correlated with the target so that trees accept something
        lp = []
        pref = ctx
        for _ in range(n_pos):
            lg = _table_logits(pref, vocab, 2.0)
            lp.append(torch.log_softmax(lg + torch.randn(vocab, dtype=torch.float64) * 0.5, -1))
            pref = pref + (int(lg.argmax()),)
        tree = build_tree_batched(torch.stack(lp).unsqueeze(0), budget)
        t = tree.unbind()[0]
        logits = torch.stack([_table_logits(ctx + p, vocab, 2.0) for p in _slot_prefixes(t.tokens, t.parents)])
        res = verify_greedy(tree, logits.unsqueeze(0))
        k = int(res.accept_length[0])
        agg_accept += k
        emitted = res.emitted_tokens[0, : k + 1].tolist()
        seq = ctx
        expect = []
        for _ in range(k + 1):
            nxt = int(_table_logits(seq, vocab, 2.0).argmax())
            expect.append(nxt)
            seq = seq + (nxt,)
        assert emitted == expect
        # the accepted path really is a root-to-node path of the tree
        slots = res.accept_slots[0, : k + 1].tolist()
        assert slots[0] == 0 and all(t.parents[slots[i + 1]] == slots[i] for i in range(k))
    assert agg_accept > 40  # the test exercises multi-token acceptance


def test_walk_padding_and_no_match():
    tokens = torch.tensor([[-1, 4, 5, 6]])
    parents = torch.tensor([[-1, 0, 0, 1]])
    pred = torch.tensor([[9, 0, 0, 0]])  # nothing matches at the root
    r = walk_tree(tokens, parents, pred, max_depth=2)
    assert r.accept_length.tolist() == [0]
    assert r.emitted_tokens.tolist() == [[9, -1, -1]]
    pred = torch.tensor([[4, 6, 0, 8]])
    r = walk_tree(tokens, parents, pred, max_depth=2)
    assert r.accept_length.tolist() == [2]
    assert r.accept_slots.tolist() == [[0, 1, 3]]
    assert r.emitted_tokens.tolist() == [[4, 6, 8]]
    assert r.last_slot.tolist() == [3]


def _generate(num_runs, n_tokens, vocab, budget, n_pos, seed, lossy=False):
    """Speculative generation with DDTree + target-only tree sampling, for many
    independent runs; returns the first n_tokens of each run and mean accepts."""
    gen = torch.Generator().manual_seed(seed)
    outs = [[] for _ in range(num_runs)]
    accepted = []
    while True:
        groups = {}
        for r, o in enumerate(outs):
            if len(o) < n_tokens:
                groups.setdefault(tuple(o), []).append(r)
        if not groups:
            break
        for ctx, runs in groups.items():
            # drafter: a different (wrong) distribution per position
            lp = torch.stack(
                [torch.log_softmax(_table_logits(ctx + (i,), vocab, 1.0, salt=99), -1) for i in range(n_pos)]
            )
            tree = build_tree_batched(lp.unsqueeze(0).expand(len(runs), -1, -1), budget)
            t = tree.unbind()[0]
            probs = torch.stack(
                [torch.softmax(_table_logits(ctx + p, vocab, 0.5), -1) for p in _slot_prefixes(t.tokens, t.parents)]
            )
            probs = probs.unsqueeze(0).expand(len(runs), -1, -1)
            if lossy:  # broken verifier: trust the draft's best child whenever it exists
                pred = torch.where(tree.first_child >= 0, torch.gather(tree.token_ids, 1, tree.first_child.clamp_min(0)), 0)
                res = verify_sample(tree, probs, gen)
                res = walk_tree(tree.token_ids, tree.parents, torch.where(tree.first_child >= 0, pred, res.emitted_tokens[:, :1].expand_as(pred)), tree.max_depth)
            else:
                res = verify_sample(tree, probs, gen)
            for j, r in enumerate(runs):
                k = int(res.accept_length[j])
                accepted.append(k)
                outs[r].extend(res.emitted_tokens[j, : k + 1].tolist())
    return [tuple(o[:n_tokens]) for o in outs], sum(accepted) / len(accepted)


def _chi2(samples, vocab, n_tokens):
    import itertools

    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    stat = 0.0
    for seq in itertools.product(range(vocab), repeat=n_tokens):
        p = 1.0
        for i in range(n_tokens):
            p *= float(torch.softmax(_table_logits(seq[:i], vocab, 0.5), -1)[seq[i]])
        e = p * len(samples)
        stat += (counts.get(seq, 0) - e) ** 2 / e
    return stat


# chi-square critical value, 26 degrees of freedom (27 cells), p = 0.001
CHI2_26_P001 = 54.05


def test_sampling_is_lossless_chi_square():
    vocab, n_tokens = 3, 3
    samples, mean_accept = _generate(30000, n_tokens, vocab, budget=4, n_pos=3, seed=1234)
    assert mean_accept > 0.3, "trees must accept tokens for the test to mean anything"
    assert _chi2(samples, vocab, n_tokens) < CHI2_26_P001


def test_chi_square_detects_a_lossy_verifier():
    vocab, n_tokens = 3, 3
    samples, _ = _generate(30000, n_tokens, vocab, budget=4, n_pos=3, seed=1234, lossy=True)
    assert _chi2(samples, vocab, n_tokens) > CHI2_26_P001
