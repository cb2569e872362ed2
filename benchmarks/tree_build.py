"""DDTree build speed: reference heap (CPU, as in the paper's code) vs the batched
GPU builders, at B = 16, 64, 256 and batch 1, 8, 32.  Asserts identical trees.

    PYTHONPATH=overlays/sglang-ddtree/src python benchmarks/tree_build.py \
        [--device cuda] [--vocab 151936] [--positions 15] [--iters 20] [--cuda-graph]

Columns:

* ``ref ms`` - ``[build_tree_reference(lp[i], B) for i in range(batch)]``: per
  request, rank the drafter's top-K tokens per position on the device (the same
  exact tie-rule ranking the Triton builder uses: the Triton threshold top-K
  on CUDA), copy them to the host and run the Python heap.  (Before the
  threshold top-K this ranking was ``torch.topk`` + one Triton kernel; set
  ``SGLANG_DDTREE_TOPK=torch`` to measure that path, for both columns.)
* ``torch ms`` - :func:`build_tree_torch` (per-depth beam with torch ops).
* ``triton ms`` - :func:`build_tree_triton` (Triton top-K: 4 launches, + the
  tree kernel; what ``build_tree_batched`` uses on CUDA).  ``speedup`` = ref / triton.
* ``identical`` - both batched builders' trees (tokens, parents, depths, scores,
  ranks) equal the reference's, and the Triton builder's first-child /
  next-sibling / validity tensors equal the torch builder's.

Both batched builders run the whole build on the device, ranking over the full
vocabulary included.  With --cuda-graph (CUDA only) each batched builder is
captured once per shape and replayed.  Times are wall-clock per call after a
warm-up, averaged over --iters calls (the reference over iters/4).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from sglang_ddtree.tree import build_tree_reference, build_tree_torch, build_tree_triton, triton_available


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, dev, iters):
    fn()
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(dev)
    return (time.perf_counter() - t0) / iters


def _graphed(builder, lp, b):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            builder(lp, b)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = builder(lp, b)
    return lambda: (graph.replay(), static_out)[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--positions", type=int, default=15, help="drafter positions L (block size - 1)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--candidates", action="store_true",
                    help="the worker's shape: V = B pre-selected candidates per depth, float64 "
                         "(step.build_tree_from_candidates); overrides --vocab/--dtype")
    args = ap.parse_args()
    dev = torch.device(args.device)
    use_triton = triton_available() and (dev.type == "cuda")
    graph = args.cuda_graph and dev.type == "cuda"
    print(f"device={dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}) "
          f"vocab={'B (candidates, float64)' if args.candidates else args.vocab} positions={args.positions} dtype={args.dtype} iters={args.iters} "
          f"torch={torch.__version__} triton={use_triton} cuda_graph={graph} "
          f"topk={os.environ.get('SGLANG_DDTREE_TOPK', 'select')}")
    hdr = (f"{'B':>5} {'batch':>5} {'ref ms':>9} {'torch ms':>9} {'triton ms':>10} "
           f"{'speedup':>8} {'vs torch':>8} identical")
    print(hdr)
    print("-" * len(hdr))
    g = torch.Generator(device=dev).manual_seed(0)
    fields = ("token_ids", "parents", "depths", "scores", "ranks", "valid", "first_child", "next_sibling")
    for b in [int(x) for x in args.budgets.split(",")]:
        for n in [int(x) for x in args.batches.split(",")]:
            vocab = b if args.candidates else args.vocab
            logits = torch.randn(n, args.positions, vocab, device=dev, generator=g) * 4
            lp = torch.log_softmax(logits.float(), dim=-1).to(getattr(torch, args.dtype))
            if args.candidates:  # sorted top-B log-probs of a 151936 vocab, as merge_vocab_shards gives
                lp = torch.sort(lp.double() - 6.0, dim=-1, descending=True).values

            def ref():
                return [build_tree_reference(lp[i], b) for i in range(n)]

            f_torch = (lambda: build_tree_torch(lp, b)) if not graph else _graphed(build_tree_torch, lp, b)
            f_tri = None
            if use_triton:
                f_tri = (lambda: build_tree_triton(lp, b)) if not graph else _graphed(build_tree_triton, lp, b)
            ref_trees = ref()
            out_torch = f_torch()
            _sync(dev)
            identical = out_torch.unbind() == ref_trees
            if f_tri is not None:
                out_tri = f_tri()
                _sync(dev)
                identical = identical and out_tri.unbind() == ref_trees
                identical = identical and all(torch.equal(getattr(out_tri, f), getattr(out_torch, f)) for f in fields)
            assert identical, f"batched tree differs from the reference heap at B={b} batch={n}"
            t_ref = _time(ref, dev, max(1, args.iters // 4))
            t_torch = _time(f_torch, dev, args.iters)
            t_new = _time(f_tri, dev, args.iters) if f_tri is not None else float("nan")
            print(f"{b:>5} {n:>5} {t_ref * 1e3:>9.3f} {t_torch * 1e3:>9.3f} {t_new * 1e3:>10.3f} "
                  f"{t_ref / t_new:>7.1f}x {t_torch / t_new:>7.1f}x {identical}", flush=True)


if __name__ == "__main__":
    main()
