"""The pure core of the tree-verify decode step (sglang_ddtree.step), on CPU."""

import json
import subprocess
import sys

import pytest
import torch

from sglang_ddtree.compile import FULL_MASK, compile_tree
from sglang_ddtree.step import (
    ShadowStats,
    accept_slots_from_flat,
    build_tree_from_candidates,
    chain_nodes_of_tree,
    commit_from_accept,
    committed_tokens,
    draft_topk_candidates,
    mamba_track_steps,
    merge_vocab_shards,
    shadow_tree_accept,
    tree_accept_greedy_reference,
    window_permutation,
)
from sglang_ddtree.tree import build_tree_batched
from sglang_ddtree.verify import walk_tree


def _candidates(logits, budget, shards=None):
    """tp-sharded candidate path: logits [N, L, V] -> (logprobs, ids) [N, L, K]."""
    n, l, v = logits.shape
    k = min(budget, v)
    rows = logits.reshape(n * l, v)
    bounds = shards or [(0, v)]
    outs = [draft_topk_candidates(rows[:, a:b], k, vocab_start=a) for a, b in bounds]
    vals = torch.stack([o[0] for o in outs])
    ids = torch.stack([o[1] for o in outs])
    lse = torch.stack([o[2] for o in outs])
    lp, gid = merge_vocab_shards(vals, ids, lse, k)
    return lp.view(n, l, k), gid.view(n, l, k)


@pytest.mark.parametrize("budget", [1, 5, 16, 40])
@pytest.mark.parametrize("shards", [None, [(0, 7), (7, 14), (14, 23)]])
def test_candidate_tree_equals_dense_tree(budget, shards):
    g = torch.Generator().manual_seed(budget)
    logits = torch.randn(3, 5, 23, generator=g)
    dense = build_tree_batched(torch.log_softmax(logits.double(), -1), budget)
    lp, ids = _candidates(logits, budget, shards)
    comp = build_tree_from_candidates(lp, ids, budget)
    for f in ("token_ids", "parents", "depths", "valid", "first_child", "next_sibling"):
        assert torch.equal(getattr(comp, f), getattr(dense, f)), f
    assert torch.allclose(comp.scores[comp.valid], dense.scores[dense.valid], atol=1e-5)


def test_candidate_ties_go_to_lower_id_across_shards():
    # integer logits with many ties; shards of uneven width; smaller K than a tie group
    logits = torch.tensor([[0.0, 2, 2, 1, 2, 2, 0, 2, 1, 2]]).repeat(2, 1)
    lp, ids = _candidates(logits.view(1, 2, 10), 4, [(0, 3), (3, 4), (4, 10)])
    assert ids[0, 0].tolist() == [1, 2, 4, 5]
    full = torch.log_softmax(logits[0].double(), -1)
    assert torch.allclose(lp[0, 0], full[[1, 2, 4, 5]], atol=1e-6)


def test_shard_smaller_than_k_is_padded():
    v, i, lse = draft_topk_candidates(torch.tensor([[1.0, 3.0]]), 4, vocab_start=10)
    assert i.tolist() == [[11, 10, -1, -1]] and torch.isneginf(v[0, 2:]).all()


def _compiled(n=3, l=5, vocab=11, budget=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tree = build_tree_batched(torch.log_softmax(torch.randn(n, l, vocab, generator=g), -1), budget)
    prefix = torch.tensor([4, 0, 9])[:n]
    vin = compile_tree(tree, torch.arange(n) + 100, prefix, mask_mode=FULL_MASK)
    return tree, vin, prefix


def _predict_following(tree, g, hit=0.7):
    """target predictions that follow some tree edge with prob `hit`."""
    n, d = tree.token_ids.shape
    pred = torch.randint(0, 11, (n, d), generator=g)
    for b in range(n):
        for s in range(d):
            kids = [c for c in range(d) if int(tree.parents[b, c]) == s and bool(tree.valid[b, c])]
            if kids and torch.rand((), generator=g) < hit:
                pred[b, s] = tree.token_ids[b, kids[int(torch.randint(len(kids), (), generator=g))]]
    return pred


@pytest.mark.parametrize("seed", range(6))
def test_greedy_reference_equals_walk(seed):
    tree, vin, _ = _compiled(seed=seed)
    pred = _predict_following(tree, torch.Generator().manual_seed(seed))
    cand = vin.draft_token.view(tree.token_ids.shape)
    m = vin.max_tree_depth + 1
    p, ai, num = tree_accept_greedy_reference(
        cand, vin.retrieve_index, vin.retrieve_next_token, vin.retrieve_next_sibling, pred, m)
    w = walk_tree(tree.token_ids, tree.parents, pred, tree.max_depth, tree.valid)
    slots, length = accept_slots_from_flat(ai, num, vin.draft_token_num)
    assert torch.equal(length, w.accept_length) and torch.equal(slots, w.accept_slots)
    out, commit, bonus = committed_tokens(p, ai, length, vin.draft_token_num)
    for b in range(tree.batch_size):
        a = int(length[b])
        assert out[b, : a + 1].tolist() == w.emitted_tokens[b, : a + 1].tolist()
        assert out[b, a + 1 :].eq(0).all()
    assert torch.equal(bonus, w.bonus_tokens) and torch.equal(commit, (length + 1).int())


SGLANG_GREEDY = r"""
import json, os, sys, types
os.environ["TRITON_INTERPRET"] = "1"
import torch
ph = types.ModuleType("sgl_kernel"); ph.__path__ = []
sp = types.ModuleType("sgl_kernel.speculative"); sp.reconstruct_indices_from_tree_mask = None
sys.modules.setdefault("sgl_kernel", ph); sys.modules.setdefault("sgl_kernel.speculative", sp)
try:  # SGLang 0.5.23
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton
except ImportError:  # SGLang 0.5.17 keeps the wrapper next to EAGLE
    from sglang.srt.speculative.eagle_utils import verify_tree_greedy_triton
r = json.load(sys.stdin)
t = {k: torch.tensor(v, dtype=torch.int64) for k, v in r.items() if k != "m"}
n, d = t["cand"].shape
pred = torch.zeros(n * d, dtype=torch.int64)
ai = torch.full((n, r["m"]), -1, dtype=torch.int64)
num = torch.zeros(n, dtype=torch.int64)
verify_tree_greedy_triton(pred, ai, num, t["cand"], t["ri"], t["nt"], t["ns"], t["tp"])
json.dump({"pred": pred.tolist(), "ai": ai.tolist(), "num": num.tolist()}, sys.stdout)
"""


def test_greedy_reference_equals_sglang_triton_kernel():
    """The installed SGLang's own verify_tree_greedy Triton kernel (Triton interpreter, CPU)."""
    pytest.importorskip("triton")
    reqs, refs = [], []
    for seed in range(3):
        tree, vin, _ = _compiled(seed=seed)
        pred = _predict_following(tree, torch.Generator().manual_seed(seed + 10))
        cand = vin.draft_token.view(tree.token_ids.shape)
        m = vin.max_tree_depth + 1
        reqs.append({"cand": cand.tolist(), "ri": vin.retrieve_index.tolist(), "nt": vin.retrieve_next_token.tolist(),
                     "ns": vin.retrieve_next_sibling.tolist(), "tp": pred.tolist(), "m": m})
        refs.append(tree_accept_greedy_reference(
            cand, vin.retrieve_index, vin.retrieve_next_token, vin.retrieve_next_sibling, pred, m))
    for req, (p, ai, num) in zip(reqs, refs):
        out = subprocess.run([sys.executable, "-c", SGLANG_GREEDY], input=json.dumps(req),
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0 and "triton" in out.stderr.lower() and "interpret" in out.stderr.lower():
            pytest.skip("Triton interpreter unavailable: " + out.stderr[-500:])
        assert out.returncode == 0, out.stderr[-3000:]
        got = json.loads(out.stdout)
        assert got["ai"] == ai.tolist() and got["num"] == num.tolist()
        # predicts agree on every accepted row (the rows the commit reads)
        rows = [x for row in ai.tolist() for x in row if x >= 0]
        assert [got["pred"][r] for r in rows] == [int(p[r]) for r in rows]


def test_window_permutation_is_path_first_then_rest():
    slots = torch.tensor([[0, 3, 4, -1], [0, -1, -1, -1]])
    length = torch.tensor([2, 0])
    perm = window_permutation(slots, length, 6)
    assert perm.tolist() == [[0, 3, 4, 1, 2, 5], [0, 1, 2, 3, 4, 5]]


def test_mamba_track_steps_map_through_path():
    slots = torch.tensor([[0, 3, 4, -1], [0, 2, -1, -1]])
    length = torch.tensor([2, 1])
    pre = torch.tensor([62, 10])
    commit = length + 1
    post = pre + commit
    # request 0 crosses 64 at chain step 1 (position 63) -> slot 3; request 1 crosses nothing
    got = mamba_track_steps(pre, post, commit, 64, slots, length)
    assert got.tolist() == [3, -1]


# ---------------------------------------------------------------- fake model e2e
V = 9


def _target_next(ctx):
    """deterministic 'target model': greedy next token of a context."""
    h = 0
    for t in ctx[-3:]:
        h = (h * 31 + int(t) + 7) % 1000003
    return h % V


def _state(ctx):
    """fake recurrent state after consuming ctx (order-sensitive)."""
    h = 17
    for t in ctx:
        h = (h * 131 + int(t) + 1) % 2**31
    return h


def _kv(pos, ctx):
    return (pos, _state(ctx))  # KV of the token at `pos` depends on the whole prefix through it


def _draft_logits(seqs, l, g, good=0.6):
    """drafter: per depth, a random distribution that puts the target's own
    greedy continuation on top with probability `good`, in the top 3 otherwise often."""
    out = torch.randn(len(seqs), l, V, generator=g)
    for b, seq in enumerate(seqs):
        ctx = list(seq)
        for i in range(l):
            t = _target_next(ctx)
            r = torch.rand((), generator=g)
            out[b, i, t] += 4.0 if r < good else (1.0 if r < 0.9 else -3.0)
            ctx.append(t)
    return out


@pytest.mark.parametrize("budget,blk", [(4, 4), (12, 6), (30, 8)])
def test_fake_model_end_to_end_matches_sequential_greedy(budget, blk):
    g = torch.Generator().manual_seed(budget * 7 + blk)
    n, d = 3, budget + 1
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 0]]
    # committed token ids with KV (`seq`), the bonus (emitted, no KV yet)
    seq = [list(p) for p in prompts]
    bonus = [_target_next(s) for s in seq]
    # KV pool + req_to_token (page size 1); per-request reserved window handed out by "the scheduler"
    pool, free = {}, list(range(10_000, 0, -1))
    r2t = {b: {} for b in range(n)}
    owner = {}
    for b in range(n):
        for pos, _ in enumerate(seq[b]):
            loc = free.pop()
            r2t[b][pos] = loc
            owner[loc] = b
            pool[loc] = _kv(pos, seq[b][: pos + 1])
    committed_state = [_state(s) for s in seq]
    emitted = [[t] for t in bonus]

    for step in range(4):
        prefix = torch.tensor([len(s) for s in seq])
        for b in range(n):  # reserve [prefix, prefix + 2D)
            for pos in range(len(seq[b]), len(seq[b]) + 2 * d):
                if pos not in r2t[b]:
                    loc = free.pop()
                    r2t[b][pos] = loc
                    owner[loc] = b
        window = torch.tensor([[r2t[b][int(prefix[b]) + j] for j in range(d)] for b in range(n)])
        draft_ids = window + 50_000  # drafter pool id space (translated ids)

        lp, ids = _candidates(_draft_logits([s + [bonus[b]] for b, s in enumerate(seq)], blk - 1, g), budget,
                              [(0, 4), (4, V)])
        tree = build_tree_from_candidates(lp, ids, budget)
        vin = compile_tree(tree, torch.tensor(bonus), prefix, mask_mode=FULL_MASK)
        toks = vin.draft_token.view(n, d)
        # target verify forward: per slot, the path context; write KV, intermediate state, hidden row id
        predict = torch.zeros(n, d, dtype=torch.int64)
        inter_state = torch.zeros(n, d, dtype=torch.int64)
        for b in range(n):
            for s in range(d):
                path, x = [], s
                while x >= 0:
                    path.append(int(toks[b, x]))
                    x = int(tree.parents[b, x]) if x > 0 else -1
                ctx = seq[b] + path[::-1]
                predict[b, s] = _target_next(ctx)
                inter_state[b, s] = _state(ctx)
                pool[int(window[b, s])] = _kv(int(prefix[b]) + int(vin.depths[b, s]), ctx)
        p, ai, num = tree_accept_greedy_reference(
            toks, vin.retrieve_index, vin.retrieve_next_token, vin.retrieve_next_sibling, predict,
            vin.max_tree_depth + 1)
        c = commit_from_accept(predicts=p, accept_index=ai, accept_token_num=num, d=d, prefix=prefix,
                               window_locs=window, draft_window_ids=draft_ids, out_width=d)
        hidden_row_id = torch.arange(n * d)  # hidden state of verify row r "is" r
        for b in range(n):
            a = int(c.accept_length[b])
            got = c.out_tokens[b, : a + 1].tolist()
            # 1. tokens == sequential greedy decode, and acceptance is maximal
            ctx = seq[b] + [bonus[b]]
            want = []
            for _ in range(a + 1):
                want.append(_target_next(ctx))
                ctx.append(want[-1])
            assert got == want
            if a < tree.max_depth:  # the next greedy token is not a child of the last node
                last = int(c.accept_slots[b, a])
                kids = [int(toks[b, x]) for x in range(1, d) if int(tree.parents[b, x]) == last and tree.valid[b, x]]
                assert got[a] not in kids
            # 2. committed recurrent state == sequential state after bonus + accepted drafts
            assert int(inter_state[b, int(c.state_step[b])]) == _state(seq[b] + [bonus[b]] + got[:a])
            # 3. KV: after the req_to_token rewrite positions prefix..prefix+a hold the sequential KV
            pre = int(prefix[b])
            new_window = c.window_locs[b].tolist()
            assert sorted(new_window) == sorted(window[b].tolist())  # a permutation: nothing lost or shared
            for j, loc in enumerate(new_window):
                r2t[b][pre + j] = loc
            full = seq[b] + [bonus[b]] + got[:a]
            for pos in range(pre, pre + a + 1):
                assert pool[r2t[b][pos]] == _kv(pos, full[: pos + 1])
            assert set(c.kept_kv_locs[b, : a + 1].tolist()) == set(new_window[: a + 1])
            recycled = window.reshape(-1)[c.recycled_kv_mask].tolist()
            assert set(new_window[a + 1 :]) == {x for x in recycled if owner[x] == b}
            # 4. drafter append: path rows in sequence order, positions prefix+k, drafter-pool locs
            m = c.append_cache_loc_2d.shape[1]
            rows = c.append_rows.view(n, m)[b, : a + 1]
            assert hidden_row_id[rows].tolist() == [b * d + int(x) for x in c.accept_slots[b, : a + 1]]
            assert c.append_positions.view(n, m)[b, : a + 1].tolist() == list(range(pre, pre + a + 1))
            assert c.append_cache_loc_2d[b, : a + 1].tolist() == [r2t[b][pos] + 50_000 for pos in range(pre, pre + a + 1)]
            # advance
            seq[b] = full
            committed_state[b] = _state(full)
            bonus[b] = got[a]
            emitted[b] += got
        assert c.new_seq_lens.tolist() == [len(s) for s in seq]
        assert c.bonus.tolist() == bonus
    # the whole run equals plain greedy decoding from the prompts
    for b in range(n):
        ctx, want = list(prompts[b]), []
        for _ in range(len(emitted[b])):
            want.append(_target_next(ctx))
            ctx.append(want[-1])
        assert emitted[b] == want
    locs = [loc for b in range(n) for loc in r2t[b].values()]
    assert len(locs) == len(set(locs))  # no location shared between positions/requests


# ---------------------------------------------------------------- shadow-linear
def test_shadow_tree_accept_exact_on_chain_and_lower_bound_off_chain():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 10, generator=g)
    lp, ids = _candidates(logits, 8)
    tree = build_tree_from_candidates(lp, ids, 8)
    chain = torch.cat([torch.tensor([[7]]), logits.argmax(-1)], 1)  # [1, blk=5]: bonus + greedy chain
    on = chain_nodes_of_tree(tree, chain)
    # the chain prefix is in the tree: rank-0 path
    assert on[0, 0] and on[0, 1] and int(tree.token_ids[0, 1]) == int(chain[0, 1])
    # target agrees with the chain for 2 tokens then predicts chain token again -> exact
    pred = torch.tensor([[int(chain[0, 1]), int(chain[0, 2]), 99, 0, 0]])
    acc, exact = shadow_tree_accept(tree, chain, pred)
    d_chain = int(on[0].logical_and(tree.depths[0] <= 2).sum()) - 1
    assert acc.tolist() == [min(2, d_chain)] and exact.tolist() == [True]
    # target predicts a non-chain sibling at the root -> tree accepts >= 1 (lower bound)
    kids = [int(tree.token_ids[0, s]) for s in range(1, 9) if int(tree.parents[0, s]) == 0]
    if len(kids) > 1:
        pred2 = torch.tensor([[kids[1], 0, 0, 0, 0]])
        acc2, exact2 = shadow_tree_accept(tree, chain, pred2)
        assert acc2.tolist() == [1] and exact2.tolist() == [False]


def test_shadow_matches_full_tree_walk_when_exact():
    g = torch.Generator().manual_seed(11)
    for _ in range(20):
        logits = torch.randn(2, 5, 8, generator=g)
        lp, ids = _candidates(logits, 10)
        tree = build_tree_from_candidates(lp, ids, 10)
        chain = torch.cat([torch.zeros(2, 1, dtype=torch.int64), logits.argmax(-1)], 1)
        full_pred = torch.randint(0, 8, (2, 11), generator=g)
        on = chain_nodes_of_tree(tree, chain)
        # chain-slot predictions consistent with the full predictions on chain nodes
        chain_pred = torch.full((2, 6), 0, dtype=torch.int64)
        for b in range(2):
            for s in range(11):
                if on[b, s]:
                    chain_pred[b, int(tree.depths[b, s])] = full_pred[b, s]
        acc, exact = shadow_tree_accept(tree, chain, chain_pred)
        w = walk_tree(tree.token_ids, tree.parents, full_pred, tree.max_depth, tree.valid)
        for b in range(2):
            if exact[b]:
                assert int(acc[b]) == int(w.accept_length[b])
            else:
                assert int(acc[b]) <= int(w.accept_length[b])


def test_shadow_stats():
    s = ShadowStats()
    s.update([3, 1], [4, 0], [True, False])
    s.skip("sampling", 2)
    out = s.summary()
    assert out["chain_accept_length"] == 2.0 and out["tree_would_accept_length"] == 3.0
    assert out["tree_inexact_share"] == 0.5 and out["skip_reasons"] == {"sampling": 2}


def test_merge_of_one_shard_is_the_shards_own_order():
    """TP = 1 takes the no-sort path: same log-probs and ids as the general merge (a 2-way split of the
    same logits merged the general way), ties in ascending id order."""
    from sglang_ddtree.step import draft_topk_candidates, merge_vocab_shards

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g).round(decimals=1)  # rounded: ties across the vocab
    k = 9
    v, i, l = draft_topk_candidates(logits, k)
    lp1, id1 = merge_vocab_shards(v.unsqueeze(0), i.unsqueeze(0), l.unsqueeze(0), k)
    halves = [draft_topk_candidates(logits[:, :20], k), draft_topk_candidates(logits[:, 20:], k, vocab_start=20)]
    lp2, id2 = merge_vocab_shards(*(torch.stack([h[j] for h in halves]) for j in range(3)), k)
    assert torch.equal(id1, id2) and torch.allclose(lp1, lp2, atol=1e-6)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(lp1, torch.gather(ref, 1, id1), atol=1e-5)
