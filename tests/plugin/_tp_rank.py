"""One rank of tests/plugin/test_tp_ranks.py's TP=2 group (run as its own process: `python _tp_rank.py RANK WORLD
STORE NOISE OUT`): its vocab shard's candidates, the plugin's gather-and-merge over gloo's real all_gather, the
tree, and the sampled accept after follow_rank0; what every rank decided, gathered, goes to OUT as JSON."""
from __future__ import annotations

import json
import sys

import torch

N, L, H, V, BUDGET = 3, 4, 16, 50, 12  # requests, draft depths, hidden size, vocab, node budget


def head_and_hidden():
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(V, H, generator=g)
    hidden = torch.randn(N * L, H, generator=g)
    weight[11] = weight[37]  # equal logits across the shard boundary (ids 11 | 37): the tie goes to the lower id
    return weight, hidden


def main(rank: int, world: int, store: str, noise: bool, out: str) -> None:
    import torch.distributed as dist

    from sglang_ddtree.step import build_tree_from_candidates, draft_topk_candidates, follow_rank0, tp_merged_candidates

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    weight, hidden = head_and_hidden()
    if noise:  # this rank's own drafter arithmetic differs (a rank must not decide from its local view)
        hidden = hidden + 1e-3 * torch.randn(hidden.shape, generator=torch.Generator().manual_seed(100 + rank))
    shard = V // world
    lo, hi = rank * shard, (V if rank == world - 1 else (rank + 1) * shard)
    v, i, lse = draft_topk_candidates(hidden @ weight[lo:hi].T, BUDGET, vocab_start=lo)
    lp, ids = tp_merged_candidates(v, i, lse, BUDGET, world, dist.all_gather_into_tensor)
    tree = build_tree_from_candidates(lp.view(N, L, -1), ids.view(N, L, -1), BUDGET)
    mine = torch.cat([t.to(torch.int64).reshape(-1) for t in (tree.token_ids, tree.parents, tree.depths, tree.valid)]
                     + [ids.reshape(-1)])
    every = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    # the sampled accept: coins drawn per rank differ; rank 0 decides
    coins = torch.rand(N, generator=torch.Generator().manual_seed(1000 + rank))
    accept = (coins * BUDGET).to(torch.int64)
    before = [torch.empty_like(accept) for _ in range(world)]
    dist.all_gather(before, accept)
    follow_rank0([accept], world, dist.broadcast)
    after = [torch.empty_like(accept) for _ in range(world)]
    dist.all_gather(after, accept)
    dist.destroy_process_group()
    with open(out, "w") as fh:
        json.dump({"every": [t.tolist() for t in every], "before": [t.tolist() for t in before],
                   "after": [t.tolist() for t in after], "ids": ids.tolist(), "lp": lp.tolist()}, fh)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "1", sys.argv[5])
