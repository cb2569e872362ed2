"""glue_graphs: what can be checked without a GPU (the capture itself runs on the H200: the worker logs each
graph's replays and eager fallbacks in its ``DDTREE accept stats`` line), and compile's FULL layout written
after a ``QLEN_ONLY`` compile being the FULL compile."""

import dataclasses
from pathlib import Path

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
    assert len(calls) == 3 and g.stats() == {"graphs": 0, "eager_keys": 0, "replays": 0, "failures": 0,
                                     "input_copies": 0}


@pytest.mark.parametrize("v", ["0", "false", "off"])
def test_env_switch(v):
    assert not G.glue_graphs_enabled({G.GLUE_GRAPHS_ENV: v}) and G.glue_graph_level({G.GLUE_GRAPHS_ENV: v}) == 0
    # unset or empty: what has served on the GPU for that kind of target (2 dense, 1 hybrid)
    assert G.glue_graphs_enabled({}) and G.glue_graph_level({}) == 1 == G.glue_graph_level({}, recurrent=True)
    assert G.glue_graph_level({}, recurrent=False) == 2 == G.glue_graph_level({G.GLUE_GRAPHS_ENV: " "}, False)
    assert G.glue_graph_level({G.GLUE_GRAPHS_ENV: "1"}, recurrent=False) == 1  # an explicit level wins
    assert G.glue_graph_level({G.GLUE_GRAPHS_ENV: "0"}, recurrent=False) == 0
    assert G.glue_graphs_enabled({G.GLUE_GRAPHS_ENV: "2"}) and G.glue_graph_level({G.GLUE_GRAPHS_ENV: " 2 "}) == 2
    for bad in ("maybe", "3", "-1"):
        with pytest.raises(ValueError, match="must be 0, 1 or 2"):
            G.glue_graphs_enabled({G.GLUE_GRAPHS_ENV: bad})


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
    # glue level 2: the scatter index comes with the QLEN_ONLY compile (inside graph 1), the same mask after it
    qi = C.compile_tree(tree, bonus, prefix, mask_mode=C.QLEN_ONLY, full_index=True)
    d = q.draft_token_num
    assert qi.full_mask_index.shape == (3 * d * d,) and q.full_mask_index is None
    assert torch.equal(qi.full_mask_index, C.full_mask_index(prefix, d))
    assert C.compile_tree(tree, bonus, prefix, mask_mode=C.FULL_MASK, full_index=True).full_mask_index is None
    for s in (None, int(prefix.sum())):
        assert torch.equal(C.with_full_mask(qi, prefix, s).custom_mask, full.custom_mask)
    # the index is the prefix's alone: another step's lengths with the same trees move it
    assert not torch.equal(C.full_mask_index(prefix + 1, d), qi.full_mask_index)


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


class _StandInGraphs:
    """A stand-in for the GPU's CUDA graphs (the real ones ran on the H200: ddtree_checks.glue_check): a "graph"
    replays by re-running the captured function on the static inputs and writing the results INTO the output
    tensors captured the first time - a CUDA graph's static-buffer semantics - so what GlueGraph does around
    capture and replay (keys, input copies, overwritten outputs, the first-replay check, the fallbacks) is tested
    on a CPU host. ``corrupt``: replays write a wrong value (a graph that does not compute what eager does)."""

    def __init__(self, corrupt=False):
        self.corrupt, self.captures, self.replays = corrupt, 0, 0

    @staticmethod
    def usable(inputs):
        return all(isinstance(t, torch.Tensor) for t in inputs)

    def new_graph(self):
        outer = self

        class _G:
            def record(self, fn, inputs, leaves):
                self.fn, self.inputs, self.leaves = fn, inputs, leaves
                outer.captures += 1

            def replay(self):
                outer.replays += 1
                fresh, _ = G.flatten(self.fn(*self.inputs))
                for dst, src in zip(self.leaves, fresh):
                    dst.copy_(src + 1 if outer.corrupt and dst.is_floating_point() else src)

        return _G()

    @staticmethod
    def new_pool():
        return object()

    @staticmethod
    def capture(graph, pool):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def synchronize():
        pass


def _fn(x, y):
    return {"s": x + y, "n": int(x.shape[0]), "box": _Box(x * y, 3, (y.sum(0, keepdim=True),))}


def test_replays_copy_inputs_in_and_overwrite_the_same_output_buffers():
    dev = _StandInGraphs()
    g = G.GlueGraph("t", _fn, device=dev)
    a, b = torch.arange(4.0), torch.ones(4)
    first = g(a, b)  # eager: the step's own result, then captured
    assert dev.captures == 1 and dev.replays == 0 and G.same(first, _fn(a, b))
    second = g(a * 2, b)  # replayed (and checked against eager once)
    assert dev.replays == 1 and G.same(second, _fn(a * 2, b))
    kept = G.clone_out(second)
    third = g(a * 3, b)
    assert G.same(third, _fn(a * 3, b)) and third["s"] is second["s"]  # the same buffer, overwritten ...
    assert not G.same(second, kept) and G.same(kept, _fn(a * 2, b))  # ... so what outlives a step is cloned
    g(torch.ones(2), torch.ones(2))  # another batch size: its own graph
    assert dev.captures == 2 and g.stats() == {"graphs": 2, "eager_keys": 0, "replays": 2, "failures": 0,
                                                  "input_copies": 4}


def test_a_replay_that_differs_from_eager_returns_eager_and_keeps_that_key_eager():
    dev = _StandInGraphs(corrupt=True)
    g = G.GlueGraph("t", _fn, device=dev)
    a, b = torch.arange(4.0), torch.ones(4)
    g(a, b)
    assert G.same(g(a, b), _fn(a, b))  # the check caught the replay: eager's result, not the graph's
    for k in range(3):
        assert G.same(g(a + k, b), _fn(a + k, b))
    assert dev.replays == 1 and g.stats()["eager_keys"] == 1 and g.stats()["failures"] == 1


def test_a_capture_that_fails_keeps_the_key_eager_and_the_step_going():
    dev = _StandInGraphs()
    calls = {"n": 0}

    def fn(x):
        calls["n"] += 1
        if calls["n"] == 2:  # the capture's run (the first call is the eager step)
            raise RuntimeError("operation not permitted when stream is capturing")
        return x + 1

    g = G.GlueGraph("t", fn, device=dev)
    x = torch.zeros(3)
    assert [int(g(x).sum()) for _ in range(3)] == [3, 3, 3]
    assert dev.captures == 0 and g.stats() == {"graphs": 0, "eager_keys": 1, "replays": 0, "failures": 1,
                                                  "input_copies": 0}


def test_disabled_or_off_device_inputs_run_the_function():
    dev = _StandInGraphs()
    g = G.GlueGraph("t", lambda x: x + 1, device=dev, enabled=False)
    for _ in range(3):
        g(torch.zeros(2))
    assert dev.captures == 0
    assert G.GlueGraph("t", lambda x: x, device=dev)(3) == 3  # not a tensor: never captured


def test_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(G, "MAX_KEYS", 2)
    dev = _StandInGraphs()
    g = G.GlueGraph("t", lambda x: x * 2, device=dev)
    for n in (1, 2, 3, 3):
        assert torch.equal(g(torch.ones(n)), torch.full((n,), 2.0))
    assert dev.captures == 2  # the third size runs eagerly: no graph beyond the bound


def test_the_two_glue_halves_are_the_steps_they_stand_for():
    from sglang_ddtree import step as S
    from sglang_ddtree.tree import rank_draft_tokens

    g = torch.Generator().manual_seed(4)
    lp = torch.log_softmax(torch.randn(2, 7, 50, generator=g) * 3, -1).double()
    vals, ids = rank_draft_tokens(lp, 15)
    bonus, prefix = torch.tensor([3, 4]), torch.tensor([10, 2])
    tree, vin = S.tree_verify_inputs(vals, ids, bonus, prefix, 15, 2)
    ref_tree = S.build_tree_from_candidates(vals, ids, 15)
    assert G.same((tree, vin), (ref_tree, C.compile_tree(ref_tree, bonus, prefix, mask_mode=C.QLEN_ONLY)))
    d = vin.draft_token_num
    pred = torch.roll(vin.draft_token.view(2, d), -1, 1)
    predicts, acc, num = S.tree_accept_greedy_reference(vin.draft_token.view(2, d), vin.retrieve_index,
                                                        vin.retrieve_next_token, vin.retrieve_next_sibling, pred,
                                                        vin.max_tree_depth + 1)
    window = torch.arange(2 * d).view(2, d) + 100
    counts, c = S.accept_commit(predicts, acc, num, tree.ranks, prefix, window, window, vin.max_tree_depth)
    assert torch.equal(counts, S.tree_accept_counts(tree.ranks, acc, num, vin.max_tree_depth))
    assert G.same(c, S.commit_from_accept(predicts=predicts, accept_index=acc, accept_token_num=num, d=d,
                                          prefix=prefix, window_locs=window, draft_window_ids=window, out_width=d))


def test_the_accept_can_carry_the_recurrent_commits_indices():
    """Glue level 2: accept_commit(recurrent=True) computes the recurrent commit's indices (the deepest accepted
    node's slot, the tracked state's slot) in the accept, equal to what the commit computed eagerly, int32 as
    SGLang's scatter reads them, and replayable as graph outputs (a stand-in graph here)."""
    from sglang_ddtree import step as S
    from sglang_ddtree.indexing import recurrent_state_step
    from sglang_ddtree.tree import rank_draft_tokens

    g = torch.Generator().manual_seed(9)
    lp = torch.log_softmax(torch.randn(3, 7, 50, generator=g) * 3, -1).double()
    vals, ids = rank_draft_tokens(lp, 15)
    bonus = torch.tensor([3, 4, 5])
    tree, vin = S.tree_verify_inputs(vals, ids, bonus, torch.tensor([10, 2, 7]), 15, 2)
    d = vin.draft_token_num
    window = torch.arange(3 * d).view(3, d) + 100

    def accept(prefix, pred, interval):
        predicts, acc, num = S.tree_accept_greedy_reference(vin.draft_token.view(3, d), vin.retrieve_index,
                                                            vin.retrieve_next_token, vin.retrieve_next_sibling,
                                                            pred, vin.max_tree_depth + 1)
        return S.accept_commit(predicts, acc, num, tree.ranks, prefix, window, window, vin.max_tree_depth,
                               recurrent=True, track_interval=interval)

    # the target agrees with the first branch for a while (deep accepts), then with nothing
    pred = torch.roll(vin.draft_token.view(3, d), -1, 1)
    crossed = 0
    for prefix in (torch.tensor([10, 2, 7]), torch.tensor([15, 13, 1])):
        for interval in (0, 4):
            _, c = accept(prefix, pred, interval)
            eager_state = recurrent_state_step(c.accept_slots, c.accept_length)
            assert c.recurrent_step.dtype == torch.int32 and torch.equal(c.recurrent_step.long(), eager_state)
            assert torch.equal(c.state_step.long(), eager_state)
            if interval == 0:
                assert c.track_steps is None
                continue
            eager_track = S.mamba_track_steps(prefix, prefix + c.commit_lens.long(), c.commit_lens, interval,
                                              c.accept_slots, c.accept_length)
            assert c.track_steps.dtype == torch.int32 and torch.equal(c.track_steps.long(), eager_track)
            crossed += int((eager_track >= 0).sum())
    assert crossed > 0  # a track boundary fell inside an accepted path: the case the indices are for
    # without recurrent=True the commit is what it was (the indices stay in the commit, eager)
    predicts, acc, num = S.tree_accept_greedy_reference(vin.draft_token.view(3, d), vin.retrieve_index,
                                                        vin.retrieve_next_token, vin.retrieve_next_sibling, pred,
                                                        vin.max_tree_depth + 1)
    _, plain = S.accept_commit(predicts, acc, num, tree.ranks, torch.tensor([10, 2, 7]), window, window,
                               vin.max_tree_depth)
    assert plain.recurrent_step is None and plain.track_steps is None
    # as graph outputs: captured once, replayed for other prefixes, equal to the eager accept every time
    dev = _StandInGraphs()
    gg = G.GlueGraph("accept_commit", lambda p, t: accept(p, t, 4), device=dev)
    for prefix in (torch.tensor([10, 2, 7]), torch.tensor([15, 13, 1]), torch.tensor([3, 8, 12])):
        out = gg(prefix, pred)
        assert G.same(out, accept(prefix, pred, 4)) and out[1].track_steps is not None
    assert dev.captures == 1 and dev.replays == 2 and gg.stats()["failures"] == 0


def test_level_two_takes_the_mask_index_and_the_recurrent_indices_off_the_eager_path():
    """benchmarks/glue_launches.py's count (ATen ops that reach a kernel, views left out): at glue level 2 the
    FULL-mask write after graph 1 is its fill and its scatter alone, and the recurrent commit runs no index op."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "glue_launches.py"
    spec = importlib.util.spec_from_file_location("glue_launches", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for bs, b in ((1, 15), (4, 31)):
        r = mod.case(bs, b, 16, 8)
        (f1, f2), (r1, r2) = r["full_mask"], r["recurrent"]
        assert f2 == ["ones", "index_put_"] and len(f1) > 10 and f1[-1] == "index_put_", f1
        assert r2 == [] and {"gather", "where"} <= set(r1), r1


def test_the_gpu_glue_check_runs_both_levels_on_cpu():
    """ddtree_checks.glue_check (run on the H200 before any server): on CPU its graphs are the functions
    themselves, so this checks the check - level 2's replayed indices against level 1's after-accept ones, and
    that track boundaries do fall inside accepted paths there."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree" / "gpu_checks"))
    from ddtree_checks import glue_check

    dev = torch.device("cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    copies = {}
    for level in (1, 2):
        r = glue_check.run_case(15, 8, 4, 64, 256, 7, dev, gen, level, interval=2)
        assert r["mismatches"] == 0 and r["level"] == level, r
        # and through graphs (the stand-in's), chained as the worker chains them at that level
        r = glue_check.run_case(15, 8, 4, 64, 256, 7, dev, gen, level, interval=2, graphs=_StandInGraphs())
        assert r["mismatches"] == 0 and r["commit"]["replays"] >= 3 and r["commit"]["failures"] == 0, r
        copies[level] = r["commit"]["input_copies"] / r["commit"]["replays"]
    assert r["track_crossings"] > 0
    # level 2's commit reads the build's four outputs (tokens, parents, valid, ranks) in place: 4 copies fewer
    assert copies[1] - copies[2] >= 4 - 1e-9, copies


def test_shared_graphs_read_each_others_buffers_in_place_and_copy_only_what_moved():
    """share=True (glue level 2): graph 1 returns its own buffers from the first call on, graph 2 reads them (and
    a tensor passed twice) where they lie, so a replay copies only the input from elsewhere; results stay the
    eager ones, also when graph 1's buffer is not what graph 2 gets (fresh tensors are copied into it)."""
    dev = _StandInGraphs()
    f1 = lambda x: {"a": x * 2, "b": x + 1}
    f2 = lambda a, b, w, w2: a.view(2, 2) @ b.view(2, 2) + w.sum() + w2.sum()
    g1 = G.GlueGraph("one", f1, device=dev, share=True)
    g2 = G.GlueGraph("two", f2, device=dev, share=True)
    plain1, plain2 = G.GlueGraph("one-plain", f1, device=dev), G.GlueGraph("two-plain", f2, device=dev)
    for k in range(4):
        x, w = torch.arange(4.0) + k, torch.full((3,), float(k))
        o = g1(x)
        got = g2(o["a"].view(2, 2), o["b"], w, w)  # a view of graph 1's buffer, a buffer, one tensor twice
        assert torch.equal(got, f2(x * 2, x + 1, w, w))
        po = plain1(x)
        assert torch.equal(plain2(po["a"].view(2, 2), po["b"], w, w), got)
        if k:
            assert o["a"] is first["a"]  # graph 1's own buffer every time, the first call's too
        else:
            first = o
    # graph 2: replayed at every call (the first right after its capture); only w copied, once a call after it
    assert g2.stats() == {"graphs": 1, "eager_keys": 0, "replays": 4, "failures": 0, "input_copies": 3}
    assert plain2.stats()["replays"] == 3 and plain2.stats()["input_copies"] == 4 * 3  # every input, every replay
    # fresh tensors where graph 2 reads graph 1's buffer: copied in, and still the eager result
    a, b, w = torch.arange(4.0) * 5, torch.arange(4.0) - 3, torch.ones(3)
    assert torch.equal(g2(a.view(2, 2), b, w, w), f2(a, b, w, w)) and g2.stats()["input_copies"] == 6


def test_a_shared_graph_checks_its_first_replay_at_the_first_call():
    dev = _StandInGraphs(corrupt=True)
    g = G.GlueGraph("t", _fn, device=dev, share=True)
    a, b = torch.arange(4.0), torch.ones(4)
    assert G.same(g(a, b), _fn(a, b))  # the corrupted replay was caught at once: the eager result
    assert g.stats()["failures"] == 1 and g.stats()["eager_keys"] == 1
    assert G.same(g(a * 2, b), _fn(a * 2, b)) and dev.replays == 1  # that key stays eager
