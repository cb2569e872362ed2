"""DDTree build speed: reference heap (CPU, as in the paper's code) vs the batched
torch builder, at B = 16, 64, 256 and batch 1, 8, 32.  Asserts identical trees.

    python benchmarks/tree_build.py [--device cuda] [--vocab 151936] [--positions 15]
                                    [--iters 20] [--cuda-graph]

The reference timing includes what the paper's loop pays per step: ranking the
drafter's top-K tokens per position on the device, copying them to the host and
running the Python heap per request.  The batched timing is the whole on-device
build (ranking included).  With --cuda-graph (CUDA only) the batched builder is
captured once per shape and replayed.
"""

from __future__ import annotations

import argparse
import time

import torch

from sglang_ddtree.tree import build_tree_batched, build_tree_reference


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--positions", type=int, default=15, help="drafter positions L (block size - 1)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--budgets", default="16,64,256")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--cuda-graph", action="store_true")
    args = ap.parse_args()
    dev = torch.device(args.device)
    print(f"device={dev} vocab={args.vocab} positions={args.positions} iters={args.iters} "
          f"torch={torch.__version__} cuda_graph={args.cuda_graph}")
    hdr = f"{'B':>5} {'batch':>5} {'ref ms':>10} {'batched ms':>11} {'speedup':>8} identical"
    print(hdr)
    print("-" * len(hdr))
    g = torch.Generator(device=dev).manual_seed(0)
    for b in [int(x) for x in args.budgets.split(",")]:
        for n in [int(x) for x in args.batches.split(",")]:
            logits = torch.randn(n, args.positions, args.vocab, device=dev, generator=g) * 4
            lp = torch.log_softmax(logits.float(), dim=-1)

            def ref():
                return [build_tree_reference(lp[i], b) for i in range(n)]

            fn = lambda: build_tree_batched(lp, b)  # noqa: E731
            if args.cuda_graph and dev.type == "cuda":
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    build_tree_batched(lp, b)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = build_tree_batched(lp, b)
                fn = lambda: (graph.replay(), static_out)[1]  # noqa: E731
            out = fn()
            _sync(dev)
            identical = out.unbind() == ref()
            assert identical, f"batched tree differs from the reference heap at B={b} batch={n}"
            t_ref = _time(ref, dev, max(1, args.iters // 4))
            t_bat = _time(fn, dev, args.iters)
            print(f"{b:>5} {n:>5} {t_ref * 1e3:>10.3f} {t_bat * 1e3:>11.3f} {t_ref / t_bat:>7.1f}x {identical}")


if __name__ == "__main__":
    main()
