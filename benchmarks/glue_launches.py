"""Eager ops left around the tree-verify step's glue graphs, per glue level (a CPU proxy for GPU launches).

A decode step of a small model is launch-bound (benchmarks/results/MEASUREMENTS.md: the GPU idle for
more than 90% of every step), so what the step runs eagerly outside its CUDA graphs is what costs. This counts,
with torch's dispatcher (every ATen op that reaches a kernel; views, which launch nothing, left out), the ops
of the two pieces ``SGLANG_DDTREE_GLUE_GRAPHS=2`` moves into the glue graphs, eagerly at level 1 and level 2:

* compile's FULL-mask write after graph 1 (``compile.with_full_mask``): level 2 gets the scatter index from
  graph 1 (``full_mask_index``) and keeps the fill and the scatter;
* the recurrent commit's indices (``indexing.recurrent_state_step`` and ``step.mamba_track_steps`` with the
  int32 casts SGLang's scatter wrappers make): level 2 gets them, int32, from graph 2 and runs none.

On the GPU each counted op is one kernel launch (plus what a launch costs the host); SGLang's own scatter
kernels are the same at both levels and not counted. The GPU profile (``python -m sglang_ddtree_tools.bench
--profile-steps``) is the measurement; this is the arithmetic that says what to expect of it.

    python benchmarks/glue_launches.py [--batch 1,4,16] [--budgets 15,31,63] [--block 16] [--interval 256]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:  # the installed plugin (a venv of scripts/bootstrap), else this checkout's
    import sglang_ddtree  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "overlays", "sglang-ddtree", "src"))

from sglang_ddtree import compile as C  # noqa: E402
from sglang_ddtree import step as S  # noqa: E402
from sglang_ddtree.indexing import recurrent_state_step  # noqa: E402
from sglang_ddtree.tree import rank_draft_tokens  # noqa: E402


class CountOps(TorchDispatchMode):
    """ATen ops dispatched to a kernel (view ops, which alias and launch nothing, are not counted)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not getattr(func, "is_view", False) and func.__name__.split(".")[0] not in ("detach", "alias"):
            self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def count(fn):
    with CountOps() as c:
        fn()
    return c.ops


def case(bs: int, budget: int, block: int, interval: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(bs, block - 1, 256, generator=g) * 3, -1).double()
    vals, ids = rank_draft_tokens(lp, budget)
    bonus = torch.randint(0, 256, (bs,), generator=g)
    prefix = torch.randint(1, 2000, (bs,), generator=g)
    tree, q1 = S.tree_verify_inputs(vals, ids, bonus, prefix, budget, 2)
    _, q2 = S.tree_verify_inputs(vals, ids, bonus, prefix, budget, 2, full_index=True)
    d = q1.draft_token_num
    psum = int(prefix.sum())
    pred = torch.roll(q1.draft_token.view(bs, d), -1, 1)
    predicts, acc, num = S.tree_accept_greedy_reference(q1.draft_token.view(bs, d), q1.retrieve_index,
                                                        q1.retrieve_next_token, q1.retrieve_next_sibling, pred,
                                                        q1.max_tree_depth + 1)
    window = torch.arange(bs * d).view(bs, d)
    _, c1 = S.accept_commit(predicts, acc, num, tree.ranks, prefix, window, window, q1.max_tree_depth)
    _, c2 = S.accept_commit(predicts, acc, num, tree.ranks, prefix, window, window, q1.max_tree_depth,
                            recurrent=True, track_interval=interval)
    assert torch.equal(C.with_full_mask(q1, prefix, psum).custom_mask, C.with_full_mask(q2, prefix, psum).custom_mask)
    seq_pre = prefix.clone()

    def recurrent_l1():  # what the commit ran eagerly at level 1 (worker._commit_tree_recurrent_state)
        s = recurrent_state_step(c1.accept_slots, c1.accept_length)
        t = S.mamba_track_steps(seq_pre, c1.new_seq_lens, c1.commit_lens, interval, c1.accept_slots,
                                c1.accept_length)
        s.to(torch.int32).contiguous(), t.to(torch.int32).contiguous()  # SGLang's wrapper casts to int32

    def recurrent_l2():
        c2.recurrent_step.to(torch.int32).contiguous(), c2.track_steps.to(torch.int32).contiguous()

    return {
        "full_mask": (count(lambda: C.with_full_mask(q1, prefix, psum)), count(lambda: C.with_full_mask(q2, prefix, psum))),
        "recurrent": (count(recurrent_l1), count(recurrent_l2)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--budgets", default="15,31,63")
    ap.add_argument("--block", type=int, default=16, help="the drafter's block (depths = block - 1)")
    ap.add_argument("--interval", type=int, default=256, help="the mamba track interval")
    ap.add_argument("--verbose", action="store_true", help="also list the ops")
    a = ap.parse_args(argv)
    print(f"{'batch':>5} {'B':>3} | {'FULL mask L1':>12} {'L2':>3} | {'recurrent idx L1':>16} {'L2':>3} | saved")
    for bs in [int(x) for x in a.batch.split(",")]:
        for b in [int(x) for x in a.budgets.split(",")]:
            r = case(bs, b, a.block, a.interval)
            (f1, f2), (r1, r2) = r["full_mask"], r["recurrent"]
            print(f"{bs:>5} {b:>3} | {len(f1):>12} {len(f2):>3} | {len(r1):>16} {len(r2):>3} | "
                  f"{len(f1) + len(r1) - len(f2) - len(r2)}")
            if a.verbose:
                print("   FULL mask L1:", " ".join(f1), "\n   FULL mask L2:", " ".join(f2))
                print("   recurrent L1:", " ".join(r1), "\n   recurrent L2:", " ".join(r2) or "-")
    return 0


if __name__ == "__main__":
    sys.exit(main())
