"""Triton tree builder (``build_tree_triton``) == reference heap, bit for bit.

On CPU the kernels run through Triton's interpreter (``TRITON_INTERPRET=1``, in
a subprocess so that the flag is set before the kernels are defined); on a CUDA
machine the same fuzz runs on the GPU.  Run this file directly
(``python tests/plugin/test_tree_triton.py [cuda|cpu]``) where pytest is absent.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ddtree.tree import (
    _rank_draft_tokens_torch,
    build_tree_batched,
    build_tree_reference,
    build_tree_torch,
    triton_available,
)

FIELDS = ("token_ids", "parents", "depths", "scores", "ranks", "valid", "first_child", "next_sibling")


def _cases(rng, n_random, big_vocab):
    """(logprobs [N, L, V], budget, max_depth) covering ties, -inf, dtypes, K == V."""
    import random

    rnd = random.Random(rng)
    g = torch.Generator().manual_seed(rng)
    out = []
    # exact ties everywhere: uniform rows (boundary ties -> row scan), rounded logits
    out.append((torch.log_softmax(torch.zeros(2, 3, big_vocab), -1), 16, None))
    x = torch.randn(2, 4, big_vocab, generator=g)
    x[:, :, 7:] = float("-inf")  # fewer finite tokens than K: the -inf tail ties at the floor
    out.append((torch.log_softmax(x, -1), 20, None))
    out.append((torch.log_softmax(torch.round(torch.randn(3, 5, big_vocab, generator=g)), -1), 64, None))
    out.append((torch.log_softmax(torch.randn(1, 6, 40, generator=g), -1).double(), 40, 3))
    out.append((torch.log_softmax(torch.randn(2, 2, 1, generator=g), -1), 5, None))  # V = 1
    out.append((torch.log_softmax(torch.randn(2, 15, 3000, generator=g) * 4, -1).bfloat16(), 64, None))
    for _ in range(n_random):
        n, l, v, b = rnd.randint(1, 3), rnd.randint(1, 6), rnd.randint(2, 300), rnd.randint(1, 80)
        lp = torch.log_softmax(torch.randn(n, l, v, generator=g) * rnd.choice([0.3, 1, 4]), -1)
        if rnd.random() < 0.5:
            lp = torch.log_softmax(torch.round(lp * 2), -1)
        if rnd.random() < 0.3:
            lp = lp.double()
        out.append((lp, b, rnd.choice([None, None, 2])))
    return out


def run_fuzz(device, n_random=20, big_vocab=5000, seed=0):
    from sglang_ddtree.tree import build_tree_triton
    from sglang_ddtree.tree_kernels import rank_topk_triton

    checked = 0
    for lp, b, md in _cases(seed, n_random, big_vocab):
        lp_dev = lp.to(device)
        n = lp.shape[0]
        k = min(b, lp.shape[-1])
        vals, ids = rank_topk_triton(lp_dev[:, : min(lp.shape[1], b, md or lp.shape[1])], k)
        tv, ti = _rank_draft_tokens_torch(lp[:, : min(lp.shape[1], b, md or lp.shape[1])], k)
        assert torch.equal(vals.cpu(), tv) and torch.equal(ids.cpu(), ti), (tuple(lp.shape), b)
        tri = build_tree_triton(lp_dev, b, md)
        ref = [build_tree_reference(lp[i], b, md) for i in range(n)]
        assert tri.unbind() == ref, (tuple(lp.shape), lp.dtype, b, md)
        tor = build_tree_torch(lp, b, md)
        for f in FIELDS:
            assert torch.equal(getattr(tri, f).cpu(), getattr(tor, f)), f
        checked += 1
    return checked


def _topk_cases(seed, big_vocab):
    """(rows [N, L, V], k) for the threshold top-K: random rows, exact ties at
    the K-th value (fast path and overflow -> in-kernel fallback), uniform rows,
    -inf tails, the LOGPROB_FLOOR clamp boundary, -0.0, small V, 16-bit dtypes."""
    g = torch.Generator().manual_seed(seed)
    out = []
    out.append((torch.log_softmax(torch.randn(2, 3, big_vocab, generator=g) * 4, -1), 64))
    out.append((torch.log_softmax(torch.randn(1, 2, big_vocab, generator=g), -1), 511))
    out.append((torch.log_softmax(torch.randn(1, 3, big_vocab, generator=g) * 2, -1), 1))
    out.append((torch.log_softmax(torch.zeros(1, 2, big_vocab), -1), 16))  # all tied: overflow
    x = torch.log_softmax(torch.randn(1, 2, big_vocab, generator=g) * 4, -1)
    x[0, 0, 100:2100] = x[0, 0].max() - 0.5  # 2000 ties straddling the K-th value: overflow
    x[0, 1, 7:60] = x[0, 1].max() + 1.0  # a few ties at the boundary: fast path
    out.append((x, 20))
    x = torch.randn(2, 2, big_vocab, generator=g)
    x[:, :, 5:] = float("-inf")  # fewer finite tokens than K
    out.append((torch.log_softmax(x, -1), 30))
    x = torch.log_softmax(torch.randn(1, 2, big_vocab, generator=g), -1)
    x[0, 0, 3] = -0.0
    x[0, 0, 11] = 0.0  # -0.0 ties +0.0 (lower id first)
    x[0, 1, 40:] = -1.0e31  # below the floor: clamped, ties among themselves
    x[0, 1, 20] = -1.0e30  # float32(-1e30) < LOGPROB_FLOOR in float64: clamped too
    x[0, 1, 21] = -9.9e29  # above the floor
    out.append((x, 40))
    out.append((torch.log_softmax(torch.round(torch.randn(3, 2, big_vocab, generator=g)), -1), 64))
    out.append((torch.log_softmax(torch.randn(2, 4, big_vocab, generator=g) * 4, -1).bfloat16(), 64))
    out.append((torch.log_softmax(torch.randn(1, 2, 3000, generator=g) * 4, -1).half(), 100))
    for v, k in ((2, 1), (40, 7), (300, 80), (1000, 511), (5, 4)):
        out.append((torch.log_softmax(torch.randn(2, 2, v, generator=g), -1), k))
    return out


def run_topk_fuzz(device, big_vocab=5000, seed=1):
    """The Triton threshold top-K == the torch reference ranking, bit for bit."""
    from sglang_ddtree.tree_kernels import rank_topk_triton

    checked = 0
    for lp, k in _topk_cases(seed, big_vocab):
        vals, ids = rank_topk_triton(lp.to(device), k, method="select")
        tv, ti = _rank_draft_tokens_torch(lp, k)
        assert torch.equal(vals.cpu(), tv) and torch.equal(ids.cpu(), ti), (tuple(lp.shape), lp.dtype, k)
        # a strided view (positions sliced) goes through the same kernels
        vals, ids = rank_topk_triton(lp.to(device)[:, :1], k, method="select")
        assert torch.equal(vals.cpu(), tv[:, :1]) and torch.equal(ids.cpu(), ti[:, :1])
        checked += 1
    return checked


_needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@_needs_triton
def test_triton_interpreter_matches_reference():
    src = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(src)!r}); import test_tree_triton as t; "
            "print(t.run_topk_fuzz('cpu')); print(t.run_fuzz('cpu'))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.strip().splitlines()
    assert int(lines[-2]) >= 15 and int(lines[-1]) >= 20


@_needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_matches_reference():
    assert run_topk_fuzz("cuda", big_vocab=151936) >= 15
    assert run_fuzz("cuda", n_random=60, big_vocab=151936) >= 60


def test_dispatch_cpu_uses_torch_and_rejects_unknown_backend():
    lp = torch.log_softmax(torch.randn(2, 4, 30), -1)
    a = build_tree_batched(lp, 12)
    b = build_tree_torch(lp, 12)
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f))
    with pytest.raises(ValueError, match="backend"):
        build_tree_batched(lp, 12, backend="cupy")


if __name__ == "__main__":
    dev = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    big = 151936 if dev == "cuda" else 5000
    print("top-k checked", run_topk_fuzz(dev, big_vocab=big), "cases on", dev)
    print("checked", run_fuzz(dev, n_random=60 if dev == "cuda" else 20, big_vocab=big), "cases on", dev)
