"""Bounded-memory target-only tree sampling (sglang_ddtree.tree_sampling)."""

import torch

from sglang_ddtree import tree_sampling as ts
from sglang_ddtree.compile import FULL_MASK, compile_tree
from sglang_ddtree.tree import build_tree_batched


def test_target_probs_order_and_min_p():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    t = torch.full((6, 1), 0.7)
    p = ts.target_probs(logits, t, None, None, None)
    assert torch.allclose(p, torch.softmax(logits / 0.7, -1), atol=1e-6)
    k = ts.target_probs(logits, t, torch.tensor([1, 3, 50, 2, 5, 1]), None, None)
    assert (k > 0).sum(-1).tolist() == [1, 3, 50, 2, 5, 1]
    assert torch.allclose(k.sum(-1), torch.ones(6))
    m = ts.target_probs(logits, t, None, None, torch.full((6,), 0.2))
    kept = p >= 0.2 * p.max(-1, keepdim=True).values
    assert torch.equal(m > 0, kept) and torch.allclose(m.sum(-1), torch.ones(6))
    tp = ts.target_probs(logits, t, None, torch.full((6,), 0.5), None)
    srt = torch.sort(p, -1, descending=True).values
    need = ((torch.cumsum(srt, -1) - srt) < 0.5).sum(-1)
    assert ((tp > 0).sum(-1) == need).all()


def test_requests_per_chunk_bounds_memory():
    assert ts.requests_per_chunk(48, 64, 151936, 256 << 20) == 1
    assert ts.requests_per_chunk(48, 8, 1000, 256 << 20) == 48
    n = ts.requests_per_chunk(48, 16, 32000, 64 << 20)
    assert n * 16 * 32000 * 4 * 4 <= 64 << 20 < (n + 1) * 16 * 32000 * 4 * 4


def _kernel(*, predicts, accept_index, accept_token_num, candidates, retrive_index, retrive_next_token,
            retrive_next_sibling, uniform_samples, uniform_samples_for_final_sampling, target_probs, draft_probs,
            threshold_single, threshold_acc, deterministic):
    """A CPU stand-in with the SGLang kernel's indexing contract (flat rows through retrive_index,
    per-request probs [n, D, V]): target-only sampling, siblings tried in order."""
    n, d = candidates.shape
    for b in range(n):
        cur, cnt = 0, 0
        accept_index[b, 0] = retrive_index[b, 0]
        resid = target_probs[b, 0].clone()
        while True:
            child = int(retrive_next_token[b, cur])
            took = False
            while child != -1:
                tok = int(candidates[b, child])
                mass = float(resid.sum())
                if mass > 0 and float(uniform_samples[b, child]) < float(resid[tok]) / mass:
                    predicts[int(retrive_index[b, cur])] = tok
                    cnt += 1
                    accept_index[b, cnt] = retrive_index[b, child]
                    cur, took = child, True
                    resid = target_probs[b, cur].clone()
                    break
                resid[tok] = 0
                child = int(retrive_next_sibling[b, child])
            if not took:
                break
        cdf = torch.cumsum(resid / resid.sum(), 0)
        predicts[int(retrive_index[b, cur])] = int(torch.searchsorted(cdf, uniform_samples_for_final_sampling[b]))
        accept_token_num[b] = cnt


def _run(max_bytes):
    g = torch.Generator().manual_seed(3)
    n, depth, v, budget = 5, 4, 40, 9
    lp = torch.log_softmax(torch.randn(n, depth, v, generator=g), -1)
    tree = build_tree_batched(lp, budget)
    vin = compile_tree(tree, torch.arange(n), torch.full((n,), 10), mask_mode=FULL_MASK, topk=2)
    d = vin.draft_token_num
    logits = torch.randn(n * d, v, generator=g) * 2
    cand = vin.draft_token.view(n, d)
    predicts = torch.zeros(n * d, dtype=torch.int32)
    ai = torch.full((n, vin.max_tree_depth + 1), -1, dtype=torch.int32)
    num = torch.zeros(n, dtype=torch.int32)
    coins = torch.rand(n, d, generator=g)
    final = torch.rand(n, generator=g)
    groups = ts.sample_tree_accept(
        logits=logits, d=d, temperatures=torch.full((n, 1), 0.8), top_ks=None, top_ps=torch.full((n,), 0.95),
        min_ps=None, candidates=cand, retrieve_index=vin.retrieve_index, retrieve_next_token=vin.retrieve_next_token,
        retrieve_next_sibling=vin.retrieve_next_sibling, coins=coins, coins_final=final, predicts=predicts,
        accept_index=ai, accept_num=num, kernel=_kernel, max_bytes=max_bytes)
    return groups, predicts, ai, num, d, v


def test_chunked_sampling_equals_one_pass():
    g1, p1, a1, n1, d, v = _run(1 << 40)
    per_req = d * v * 4 * 4
    g2, p2, a2, n2, _, _ = _run(per_req * 2)  # two requests per group
    g3, p3, a3, n3, _, _ = _run(1)  # one request per group
    assert (g1, g2, g3) == (1, 3, 5)
    for p, a, n in ((p2, a2, n2), (p3, a3, n3)):
        assert torch.equal(p, p1) and torch.equal(a, a1) and torch.equal(n, n1)
    assert int(n1.sum()) > 0  # something was accepted, so the row offsets were exercised
