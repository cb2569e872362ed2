"""glue_graphs: what can be checked without a GPU (the capture itself runs on the H200: the worker logs each
graph's replays and eager fallbacks in its ``DDTREE accept stats`` line), and compile's FULL layout written
after a ``QLEN_ONLY`` compile being the FULL compile."""

import dataclasses

import pytest
import torch

from sglang_ddtree import compile as C
from sglang_ddtree import glue_graphs as G
from sglang_ddtree.step import TreeAcceptStats
from sglang_ddtree.tree import build_tree_batched


@dataclasses.dataclass
class _Box:
    a: torch.Tensor
    n: int
    rest: tuple


def test_flatten_round_trips_nested_results_and_keeps_constants():
    obj = (torch.arange(3), {"x": _Box(torch.ones(2), 7, (torch.zeros(1), "s"))}, [5])
    leaves, spec = G.flatten(obj)
    assert len(leaves) == 3
    back = G.unflatten(leaves, spec)
    assert back[1]["x"].n == 7 and back[1]["x"].rest[1] == "s" and back[2] == [5]
    assert G.same(obj, back)


def test_same_sees_one_element_a_dtype_a_shape_and_a_constant():
    a = (torch.tensor([1.0, float("nan")]), 3)
    assert G.same(a, (torch.tensor([1.0, float("nan")]), 3))
    assert not G.same(a, (torch.tensor([1.0, 2.0]), 3))
    assert not G.same(a, (torch.tensor([1.0, float("nan")]), 4))
    assert not G.same((torch.tensor([1, 2]),), (torch.tensor([1, 2], dtype=torch.int32),))
    assert not G.same((torch.zeros(2),), (torch.zeros(3),))


def test_clone_out_does_not_alias():
    t = torch.zeros(2)
    c = G.clone_out({"t": t})
    t.add_(1)
    assert c["t"].sum() == 0


def test_off_cuda_the_graph_is_the_function_itself():
    calls = []

    def fn(x):
        calls.append(1)
        return x * 2

    g = G.GlueGraph("t", fn)
    for _ in range(3):
        assert torch.equal(g(torch.ones(2)), torch.full((2,), 2.0))
    assert len(calls) == 3 and g.stats() == {"graphs": 0, "eager_keys": 0, "replays": 0, "failures": 0}


@pytest.mark.parametrize("v", ["0", "false", "off"])
def test_env_switch(v):
    assert not G.glue_graphs_enabled({G.GLUE_GRAPHS_ENV: v})
    assert G.glue_graphs_enabled({})
    with pytest.raises(ValueError):
        G.glue_graphs_enabled({G.GLUE_GRAPHS_ENV: "maybe"})


def _trees(seed=0, n=3, depth=7, v=40, b=15):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(n, depth, v, generator=g) * 3, -1)
    return build_tree_batched(lp, b, backend="torch")


def test_qlen_compile_then_full_layout_equals_the_full_compile():
    tree = _trees()
    bonus = torch.tensor([5, 6, 7])
    prefix = torch.tensor([3, 0, 11])
    full = C.compile_tree(tree, bonus, prefix, mask_mode=C.FULL_MASK)
    q = C.compile_tree(tree, bonus, prefix, mask_mode=C.QLEN_ONLY)
    for s in (None, int(prefix.sum())):
        w = C.with_full_mask(q, prefix, s)
        assert w.mask_mode == C.FULL_MASK and torch.equal(w.custom_mask, full.custom_mask)
        assert torch.equal(w.draft_token, full.draft_token) and torch.equal(w.positions, full.positions)
    with pytest.raises(ValueError):
        C.with_full_mask(full, prefix)


def test_accept_stats_keep_their_own_copy_of_the_first_counts():
    st = TreeAcceptStats(max_depth=3, every=10)
    buf = torch.tensor([1, 2, 3, 1, 2, 0, 1, 1, 0])  # a replay buffer: the next replay overwrites it
    st.add(buf)
    buf.zero_()
    t = st.flush()
    assert t["steps"] == 1 and t["requests"] == 2 and t["accepted"] == 3


def test_0517_drafter_graph_width_is_its_block_only_where_the_verify_buffers_hold_it():
    from sglang_ddtree.adapters import v0_5_17 as A

    A.DRAFTER_GRAPH_WIDTH["value"] = None
    try:
        assert A.num_tokens_per_req_for_target_verify(None, 32, True) == 32  # not set: SGLang's own answer
        A.DRAFTER_GRAPH_WIDTH["value"] = 16
        assert A.num_tokens_per_req_for_target_verify(None, 32, True) == 16  # B = 31, block-16 drafter
        assert A.num_tokens_per_req_for_target_verify(None, 32, False) == 32  # the target verifies D
        assert A.num_tokens_per_req_for_target_verify(None, 8, True) == 8  # blk > D: buffers sized at D
    finally:
        A.DRAFTER_GRAPH_WIDTH["value"] = None
