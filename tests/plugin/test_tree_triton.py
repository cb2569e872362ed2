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


_needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


@_needs_triton
def test_triton_interpreter_matches_reference():
    src = Path(__file__).resolve().parent
    code = f"import sys; sys.path.insert(0, {str(src)!r}); import test_tree_triton as t; print(t.run_fuzz('cpu'))"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert int(res.stdout.strip().splitlines()[-1]) >= 20


@_needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_matches_reference():
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
    print("checked", run_fuzz(dev, n_random=60 if dev == "cuda" else 20, big_vocab=big), "cases on", dev)
