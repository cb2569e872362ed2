"""Tree -> SGLang verify inputs; cross-checked against SGLang's own kernel."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_ddtree.compile import FULL_MASK, QLEN_ONLY, ancestor_mask, compile_tree
from sglang_ddtree.tree import build_tree_batched

HERE = Path(__file__).parent


def _tree(n=3, n_pos=5, vocab=30, budget=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return build_tree_batched(torch.log_softmax(torch.randn(n, n_pos, vocab, generator=g), -1), budget)


def test_layout_basics():
    tree = _tree()
    n, d = tree.token_ids.shape
    bonus = torch.tensor([5, 6, 7])
    prefix = torch.tensor([3, 0, 10])
    vin = compile_tree(tree, bonus, prefix, mask_mode=FULL_MASK)
    assert vin.draft_token_num == d == 13 and vin.topk >= 2
    ids = vin.draft_token.view(n, d)
    assert ids[:, 0].tolist() == [5, 6, 7]
    assert torch.equal(ids[:, 1:], tree.token_ids[:, 1:])
    assert torch.equal(vin.positions.view(n, d), prefix.view(n, 1) + tree.depths)
    assert vin.custom_mask.numel() == int(prefix.sum()) * d + n * d * d
    assert vin.max_tree_depth == 5
    # FULL_MASK rows: prefix columns True then the tree row
    off = 0
    for i in range(n):
        p = int(prefix[i])
        rows = vin.custom_mask[off : off + d * (p + d)].view(d, p + d)
        assert rows[:, :p].all()
        assert torch.equal(rows[:, p:], vin.tree_mask[i])
        off += d * (p + d)
    q = compile_tree(tree, bonus, prefix, mask_mode=QLEN_ONLY)
    assert torch.equal(q.custom_mask, vin.tree_mask.reshape(-1))


def test_ancestor_mask_is_ancestor_only():
    tree = _tree(n=2, budget=20)
    m = ancestor_mask(tree.parents, tree.max_depth)
    for b, t in enumerate(tree.unbind()):
        for s in range(len(t.tokens)):
            anc = set(t.path(s)) | {0, s}
            assert {j for j in range(len(t.tokens)) if m[b, s, j]} == anc


def test_topk_must_be_at_least_two():
    with pytest.raises(ValueError, match="topk >= 2"):
        compile_tree(_tree(), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), topk=1)


@pytest.mark.skipif(
    __import__("importlib.metadata").metadata.version("sglang") != "0.5.23",
    reason="SGLang 0.5.17 has no reconstruct_indices_from_tree_mask kernel; the 0.5.23 suite checks the "
    "compiled tree against it (the layout is the same EAGLE tree format in both)")
@pytest.mark.parametrize("budget,seed", [(6, 1), (15, 2), (40, 3)])
def test_matches_sglang_reconstruct_indices_from_tree_mask(budget, seed):
    tree = _tree(n=3, n_pos=6, vocab=12, budget=budget, seed=seed)
    n, d = tree.token_ids.shape
    prefix = torch.tensor([4, 9, 1])
    vin = compile_tree(tree, torch.tensor([1, 2, 3]), prefix, mask_mode=QLEN_ONLY)
    req = {"mask": vin.tree_mask.to(torch.int32).tolist(), "seq_lens": prefix.tolist(), "bs": n, "n": d}
    out = subprocess.run(
        [sys.executable, str(HERE / "_reconstruct_sglang.py")],
        input=json.dumps(req), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert got["positions"] == vin.positions.tolist()
    assert got["retrieve_index"] == vin.retrieve_index.reshape(-1).tolist()
    assert got["next_token"] == vin.retrieve_next_token.reshape(-1).tolist()
    assert got["next_sibling"] == vin.retrieve_next_sibling.reshape(-1).tolist()


def _one_hop_ancestor_mask(parents, max_depth):
    """The plain walk: one parent hop per round (what compile used before pointer jumping)."""
    n, d = parents.shape
    mask = torch.eye(d, dtype=torch.bool).unsqueeze(0).repeat(n, 1, 1)
    cur = parents.clone()
    for _ in range(max_depth):
        ok = cur >= 0
        mask |= torch.nn.functional.one_hot(cur.clamp_min(0), d).to(torch.bool) & ok.unsqueeze(-1)
        cur = torch.where(ok, torch.gather(parents, 1, cur.clamp_min(0)), cur)
    return mask


@pytest.mark.parametrize("n_pos,budget,vocab,seed", [(1, 4, 30, 0), (2, 9, 3, 1), (5, 12, 30, 2), (7, 31, 4, 3),
                                                     (15, 63, 2, 4), (15, 63, 50, 5), (16, 15, 2, 6), (3, 40, 40, 7)])
def test_pointer_jumping_ancestor_mask_equals_the_one_hop_walk(n_pos, budget, vocab, seed):
    tree = _tree(n=4, n_pos=n_pos, vocab=vocab, budget=budget, seed=seed)
    for depth in {tree.max_depth, max(1, tree.max_depth - 1), tree.max_depth + 3}:
        assert torch.equal(ancestor_mask(tree.parents, depth), _one_hop_ancestor_mask(tree.parents, depth)), depth
    # a deep chain (vocab 2 forces long paths): every node sees its whole root path
    m = ancestor_mask(tree.parents, tree.max_depth)
    for b in range(4):
        for s in range(tree.token_ids.shape[1]):
            path, cur = {s}, int(tree.parents[b, s])
            while cur >= 0:
                path.add(cur)
                cur = int(tree.parents[b, cur])
            if bool(tree.valid[b, s]):
                assert set(torch.nonzero(m[b, s]).flatten().tolist()) == path
