"""CPU tests of the hybrid (GDN) tree-verify check's float64 reference and path logic.

The check itself (``ddtree_checks.hybrid_gdn``, outside the serving wheel) launches SGLang's Triton
kernels and needs a GPU; everything it compares them against is tested here.
"""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SRC = Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree" / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree" / "gpu_checks"))
from ddtree_checks import hybrid_gdn as hg  # noqa: E402


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _random_tree(rng: random.Random, D: int) -> list[int]:
    """Random flat parents with parent < child and siblings created in index order."""
    return [-1] + [rng.randrange(0, i) for i in range(1, D)]


SHAPE = hg.LayerShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_width=4)


def _layer_and_inputs(D, seed=0, dtype=torch.float64):
    g = _gen(seed)
    layer = hg.make_layer(g, SHAPE, dtype)
    x = torch.randn(D, SHAPE.dim, generator=g, dtype=torch.float64).to(dtype)
    a = 0.5 * torch.randn(D, SHAPE.num_v_heads, generator=g, dtype=torch.float64)
    b = torch.randn(D, SHAPE.num_v_heads, generator=g, dtype=torch.float64)
    cs0 = torch.randn(SHAPE.dim, SHAPE.conv_width - 1, generator=g, dtype=torch.float64)
    S0 = torch.randn(SHAPE.num_v_heads, SHAPE.head_v_dim, SHAPE.head_k_dim, generator=g, dtype=torch.float64)
    return layer, x, a, b, cs0, S0


# ------------------------------------------------------------------ tree / path logic


def test_private_builder_matches_brute_force_top_b():
    g = _gen(3)
    for _ in range(20):
        L, V, B = 3, 3, random.Random(0).randint(1, 12)
        logp = torch.log_softmax(torch.randn(L, V, generator=g, dtype=torch.float64) * 2, -1)
        parents, tokens = hg.private_build_tree(logp, B)
        # every prefix (token sequence) with its score, brute force
        prefixes = []
        for d in range(1, L + 1):
            for seq in itertools.product(range(V), repeat=d):
                prefixes.append((sum(float(logp[i, t]) for i, t in enumerate(seq)), seq))
        prefixes.sort(key=lambda e: -e[0])
        best = {seq for _, seq in prefixes[:B]}
        # reconstruct the chosen prefixes from the tree
        seqs = []
        for i in range(len(parents)):
            seq, j = [], i
            while j >= 0:
                seq.append(tokens[j])
                j = parents[j]
            seqs.append(tuple(reversed(seq)))
        assert set(seqs) == best  # random floats: no ties


def test_private_builder_structure():
    g = _gen(5)
    for B in (1, 7, 16, 64):
        logp = hg.random_draft_logp(g, 16, 64)
        node_parents, _ = hg.private_build_tree(logp, B)
        parents = hg.flat_parents(node_parents)
        assert len(parents) == B + 1
        assert all(0 <= p < c for c, p in enumerate(parents) if c > 0)
        fc, ns = hg.tree_links(parents)
        # siblings ascend
        for s, n in enumerate(ns):
            assert n == -1 or n > s


def test_links_and_kernel_parent_derivation_roundtrip():
    rng = random.Random(7)
    for D in (2, 3, 17, 65, 129):
        for _ in range(10):
            parents = _random_tree(rng, D)
            fc, ns = hg.tree_links(parents)
            assert hg.derive_parents_like_kernel(fc, ns)[1:] == parents[1:]


def test_tree_links_matches_plugin_builder_links():
    tree = pytest.importorskip("sglang_ddtree.tree")
    g = _gen(11)
    logps = torch.stack([hg.random_draft_logp(g, 16, 256) for _ in range(4)])
    trees, desc = hg.build_trees(logps, 64)
    assert "build_tree_batched" in desc and desc.endswith("True")
    for t in trees:
        assert hg.tree_links(t["parents"]) == (t["first_child"], t["next_sibling"])
        ref = tree.build_tree_reference(logps[trees.index(t)], 64)
        assert t["parents"] == list(ref.parents)


def test_sglang_docstring_example():
    # The example in SGLang's kernels: next_token=[1,3,-1,-1], next_sibling=[-1,2,-1,-1]
    parents = [-1, 0, 0, 1]
    assert hg.tree_links(parents) == ([1, 3, -1, -1], [-1, 2, -1, -1])
    assert hg.derive_parents_like_kernel([1, 3, -1, -1], [-1, 2, -1, -1]) == [0, 0, 0, 1]
    assert hg.root_paths(parents) == [[0], [0, 1], [0, 2], [0, 1, 3]]


def test_root_and_chain_paths_and_structural_share():
    parents = [-1, 0, 1, 1, 0]  # 0 -> 1 -> {2, 3}; 0 -> 4
    assert hg.root_paths(parents) == [[0], [0, 1], [0, 1, 2], [0, 1, 3], [0, 4]]
    assert hg.chain_paths(3) == [[0], [0, 1], [0, 1, 2]]
    conv, state = hg.structural_affected(parents, 4)
    assert state == [False, False, False, True, True]
    assert conv == [False, False, False, True, True]
    # a pure chain is never affected
    conv, state = hg.structural_affected([-1, 0, 1, 2, 3], 4)
    assert not any(conv) and not any(state)
    # conv only looks back width-1 tokens: deep in a shared prefix the windows agree
    parents = [-1, 0, 1, 2, 3, 4, 1]  # 6 branches off 1; flat predecessors of 6 are 3,4,5
    conv, state = hg.structural_affected(parents, 2)
    assert state[6] and conv[6]


# ------------------------------------------------------------------ float64 reference


def test_reference_conv_matches_rolling_window_loop():
    rng = random.Random(1)
    D = 17
    parents = _random_tree(rng, D)
    paths = hg.root_paths(parents)
    layer, x, a, b, cs0, S0 = _layer_and_inputs(D)
    out, win = hg.reference_conv(x, cs0, layer.weight, paths)
    W = SHAPE.conv_width
    for i, path in enumerate(paths):
        window = cs0.clone()
        for t in path:
            full = torch.cat([window, x[t][:, None]], 1)
            y = (full * layer.weight).sum(1)
            window = full[:, 1:]
        y = y * torch.sigmoid(y)
        torch.testing.assert_close(out[i], y, rtol=0, atol=1e-12)
        torch.testing.assert_close(win[i], window.t(), rtol=0, atol=0)
        assert win[i].shape == (W - 1, SHAPE.dim)


def test_reference_gdn_batched_equals_per_path_sequential():
    rng = random.Random(2)
    D = 33
    parents = _random_tree(rng, D)
    paths = hg.root_paths(parents)
    layer, x, a, b, cs0, S0 = _layer_and_inputs(D, seed=2)
    out, _ = hg.reference_conv(x, cs0, layer.weight, paths)
    q, k, v = hg.split_qkv(out, layer.params)
    S, o = hg.reference_gdn(q, k, v, a, b, S0, layer.params, paths)
    for i in (0, 1, D // 2, D - 1):
        win_i, S_i, o_i = hg.sequential_reference_single(x, cs0, layer.weight, a, b, S0, layer.params, paths[i])
        torch.testing.assert_close(S[i], S_i, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o[i], o_i, rtol=1e-12, atol=1e-12)


def test_gdn_step_matches_textbook_delta_rule():
    """One head, one step: S' = a S (I - b k k^T) + b v k^T in state[v, k] layout."""
    g = _gen(4)
    p = hg.GDNParams(
        A_log=torch.tensor([0.3], dtype=torch.float64),
        dt_bias=torch.tensor([-1.0], dtype=torch.float64),
        num_k_heads=1, num_v_heads=1, head_k_dim=4, head_v_dim=3
    )
    S = torch.randn(1, 1, 3, 4, generator=g, dtype=torch.float64)
    q = torch.randn(1, 1, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, 1, 3, generator=g, dtype=torch.float64)
    a = torch.tensor([[0.2]], dtype=torch.float64)
    b = torch.tensor([[0.7]], dtype=torch.float64)
    S1, o = hg._gdn_step(S, q, k, v, a, b, p)
    kn = k[0, 0] / torch.sqrt((k[0, 0] ** 2).sum() + 1e-6)
    qn = q[0, 0] / torch.sqrt((q[0, 0] ** 2).sum() + 1e-6) * 4 ** -0.5
    f64 = torch.float64
    gate = torch.exp(torch.tensor(0.3, dtype=f64)) * torch.nn.functional.softplus(torch.tensor(-0.8, dtype=f64))
    alpha = torch.exp(-gate)
    beta = torch.sigmoid(torch.tensor(0.7, dtype=torch.float64))
    M = alpha * S[0, 0]
    expect = M @ (torch.eye(4, dtype=torch.float64) - beta * torch.outer(kn, kn)) + beta * torch.outer(v[0, 0], kn)
    torch.testing.assert_close(S1[0, 0], expect, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o[0, 0], expect @ qn, rtol=1e-12, atol=1e-12)


def test_chain_order_differs_exactly_where_paths_differ():
    rng = random.Random(9)
    D = 20
    parents = _random_tree(rng, D)
    layer, x, a, b, cs0, S0 = _layer_and_inputs(D, seed=9)
    true_paths, chain = hg.root_paths(parents), hg.chain_paths(D)
    out_t, win_t = hg.reference_conv(x, cs0, layer.weight, true_paths)
    out_c, win_c = hg.reference_conv(x, cs0, layer.weight, chain)
    S_t, _ = hg.reference_gdn(*hg.split_qkv(out_t, layer.params), a, b, S0, layer.params, true_paths)
    S_c, _ = hg.reference_gdn(*hg.split_qkv(out_c, layer.params), a, b, S0, layer.params, chain)
    err = hg.node_rel_err(S_c, S_t)
    conv_aff, state_aff = hg.structural_affected(parents, SHAPE.conv_width)
    for i in range(D):
        assert (err[i] > 1e-9) == state_aff[i]
        assert bool((win_c[i] != win_t[i]).any()) == conv_aff[i]


def test_argmax_flips_and_errors():
    head = torch.eye(3, dtype=torch.float64)
    o_ref = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]]).view(2, 1, 3)
    o_got = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 3.0]]).view(2, 1, 3)
    assert hg.argmax_flips(o_got, o_ref, head).tolist() == [False, True]
    assert hg.node_rel_err(o_got, o_ref).tolist() == [0.0, 1.5]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_end_to_end_dry_run(dtype):
    """The whole evaluation on the torch stand-in of the kernels (no GPU): the
    tree path is within tolerance and the chain order is measurably wrong."""
    shape = hg.LayerShape(num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, conv_width=4)
    r = hg.evaluate_budget(16, dtype, 3, shape, 0, 8, 64, 64, "cpu", backend="emulate")
    assert r["tree_path"]["within_tolerance"]
    assert r["tree_path"]["parents_exact"]
    assert r["tree_path"]["conv_window_max_abs_err"] == 0.0
    u = r["unsafe_chain"]
    assert u["state_max_rel_err"] > 0.1
    assert u["state_nodes_affected_share"] == pytest.approx(u["state_structural_share"])
    assert 0 < u["state_nodes_affected_share"] <= 1
    table = hg.format_table([r])
    assert f"| {dtype} | 16 |" in table
