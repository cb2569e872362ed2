"""A budget schedule in the tree-verify step, on CPU: each step builds the tree of its batch size's budget
(``step.step_budget``, ``chain`` = the drafter's top-1 branch) and verifies it at that tree's own width, and a
request's output is the target's greedy continuation whatever budget each of its steps used (requests join and
leave, so the batch crosses the schedule's thresholds both ways)."""

import pytest
import torch

from sglang_ddtree import contract
from sglang_ddtree.compile import FULL_MASK, compile_tree
from sglang_ddtree.step import (
    build_tree_from_candidates,
    commit_from_accept,
    draft_topk_candidates,
    merge_vocab_shards,
    step_budget,
    tree_accept_greedy_reference,
)

V, BLK = 11, 6


def _target_next(ctx):
    """A deterministic 'target model': its greedy next token after a context."""
    h = 0
    for t in ctx[-3:]:
        h = (h * 31 + int(t) + 7) % 1000003
    return h % V


def _greedy(prompt, n):
    ctx, out = list(prompt), []
    for _ in range(n):
        out.append(_target_next(ctx))
        ctx.append(out[-1])
    return out


def _draft_logits(ctxs, g):
    """Drafter: per depth, noise with the target's own continuation on top 60% of the time, in the top few
    otherwise often, far down else (so chains break and siblings matter)."""
    out = torch.randn(len(ctxs), BLK - 1, V, generator=g)
    for b, ctx in enumerate(ctxs):
        ctx = list(ctx)
        for i in range(BLK - 1):
            t = _target_next(ctx)
            r = float(torch.rand((), generator=g))
            out[b, i, t] += 4.0 if r < 0.6 else (1.0 if r < 0.9 else -3.0)
            ctx.append(t)
    return out


def _step(ctxs, bonus, schedule, g):
    """One tree-verify step of the batch ``ctxs`` (committed tokens; ``bonus`` the root of each): the schedule's
    tree for this batch size, the target's predictions at every slot, the greedy accept and the commit.
    Returns (emitted tokens per request, verify width)."""
    n = len(ctxs)
    budget, k = step_budget(schedule, n, BLK, V)
    logits = _draft_logits([c + [b] for c, b in zip(ctxs, bonus)], g).reshape(n * (BLK - 1), V)
    vals, ids, lse = draft_topk_candidates(logits, k)
    lp, gid = merge_vocab_shards(vals[None], ids[None], lse[None], k)
    tree = build_tree_from_candidates(lp.view(n, BLK - 1, k), gid.view(n, BLK - 1, k), budget)
    prefix = torch.tensor([len(c) for c in ctxs])
    vin = compile_tree(tree, torch.tensor(bonus), prefix, mask_mode=FULL_MASK)
    d = vin.draft_token_num
    toks = vin.draft_token.view(n, d)
    predict = torch.zeros(n, d, dtype=torch.int64)
    for b in range(n):
        for s in range(d):
            path, x = [], s
            while x >= 0:
                path.append(int(toks[b, x]))
                x = int(tree.parents[b, x]) if x > 0 else -1
            predict[b, s] = _target_next(ctxs[b] + path[::-1])
    p, ai, num = tree_accept_greedy_reference(toks, vin.retrieve_index, vin.retrieve_next_token,
                                              vin.retrieve_next_sibling, predict, vin.max_tree_depth + 1)
    window = torch.arange(n * d).view(n, d)
    c = commit_from_accept(predicts=p, accept_index=ai, accept_token_num=num, d=d, prefix=prefix,
                           window_locs=window, draft_window_ids=window, out_width=d)
    return [c.out_tokens[b, : int(c.commit_lens[b])].tolist() for b in range(n)], d, tree


def test_step_budget_follows_the_schedule_and_chain_is_the_top1_branch():
    s = contract.parse_budget({1: 31, 3: 7, 5: "chain"})
    assert [step_budget(s, n, BLK, V) for n in (1, 2, 3, 4, 5, 9)] == [(31, 11), (31, 11), (7, 7), (7, 7),
                                                                       (BLK - 1, 1), (BLK - 1, 1)]
    assert step_budget(12, 40, BLK, V) == (12, 11)  # one budget: every batch size
    g = torch.Generator().manual_seed(3)
    _, d, tree = _step([[1, 2], [3], [4, 5, 6], [7], [8]], [0, 1, 2, 3, 4], s, g)
    assert d == BLK == contract.step_width(s, 5, BLK)
    # one branch: slot s at depth s, its parent s - 1, every token the drafter's top-1 at its depth
    assert tree.depths[:, 1:].tolist() == [list(range(1, BLK))] * 5
    assert tree.parents[:, 1:].tolist() == [list(range(0, BLK - 1))] * 5
    assert tree.ranks[:, 1:].eq(0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_output_is_the_greedy_continuation_across_schedule_switches(seed):
    schedule = contract.parse_budget("1:40,2:9,4:chain")
    g = torch.Generator().manual_seed(seed)
    prompts = {0: [1, 2, 3], 1: [4], 2: [5, 6, 7, 8, 0], 3: [9, 9], 4: [2, 7], 5: [3]}
    # which requests run at each step: 1 -> 2 -> 5 -> 3 -> 1 -> 4 requests (every entry, both directions)
    plan = [[0], [0], [0, 1], [0, 1], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1, 2, 3], [2], [2], [2, 3, 4, 5],
            [2, 3, 4, 5]]
    ctx = {r: list(p) for r, p in prompts.items()}
    bonus = {r: _target_next(p) for r, p in prompts.items()}
    emitted = {r: [bonus[r]] for r in prompts}
    widths = []
    for active in plan:
        outs, d, _ = _step([ctx[r] for r in active], [bonus[r] for r in active], schedule, g)
        widths.append(d)
        assert d == contract.step_width(schedule, len(active), BLK)
        for r, out in zip(active, outs):
            ctx[r] += [bonus[r]] + out[:-1]  # the root and the accepted drafts are now committed
            bonus[r] = out[-1]
            emitted[r] += out
    assert widths == [41, 41, 10, 10, BLK, BLK, 10, 41, 41, BLK, BLK]  # the steps did switch width
    for r, p in prompts.items():
        assert emitted[r] == _greedy(p, len(emitted[r])), r
    # and the tree accepted more than one token a step somewhere (a step that accepts nothing proves little)
    assert max(len(e) for e in emitted.values()) > len(plan) + 1
