"""Hybrid (Gated DeltaNet) tree-verify correctness against SGLang's own Triton kernels.

What it checks, for random GDN layer parameters and DDTree trees built from random
draft distributions at each budget B (D = B + 1 verify tokens: ``[bonus, nodes...]``):

* **tree path** -- SGLang's ``causal_conv1d_update`` (tree mode: it derives every
  token's parent from ``retrieve_next_token`` / ``retrieve_next_sibling`` and writes
  ``retrieve_parent_token``), then ``fused_sigmoid_gating_delta_rule_update`` (the
  Triton GDN target-verify kernel, reading the parent's intermediate state).  Every
  node's conv window (``intermediate_conv_window``) and recurrent state
  (``intermediate_states_buffer``) is compared with a float64 torch reference that
  runs that node's root-to-node path sequentially from the same initial state.
* **unsafe chain order** -- the same kernels in chain mode (no tree arrays), i.e.
  the flat token order processed as if it were one sequence, each node starting
  from the previous flat token's state (what a ``hybrid-unsafe`` override gets).
  Reported: max error against the true-path reference, share of nodes affected,
  and how often the next-token argmax of a random output head flips.

Only SGLang's Triton kernels are imported (``sglang.kernels.ops...``); no server,
no model.  The reference, tree and path logic is pure torch and runs on a CPU (it
is unit-tested in ``tests/plugin/test_hybrid_reference.py``).

Run on a GPU host::

    python -m ddtree_checks.hybrid_gdn --budgets 16 64 128 --json out.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from sglang_ddtree import contract

# Stated tolerances (relative to the per-node max |reference|; see README of the
# figures).  Chosen before the run from the arithmetic, not fitted to it:
#  * conv window: the kernel only copies inputs into the window -> must be exact.
#  * conv output: one rounding to the activation dtype (bf16 eps 2^-8 => 2^-7
#    leaves room for the silu); fp32 accumulates 4 products -> 1e-5.
#  * recurrent state fed the kernel's own conv output: fp32 accumulation over at
#    most depth+1 <= 17 steps of K=128 dot products against float64 -> 1e-4.
#  * recurrent state end to end (reference does its own float64 conv): bf16
#    rounding of q/k/v (2^-8) through l2norm and the recurrence -> 5e-2; fp32 1e-4.
TOLERANCES = {
    "float32": {"conv_window": 0.0, "conv_out": 1e-5, "state_iso": 1e-4, "state_e2e": 1e-4},
    "bfloat16": {"conv_window": 0.0, "conv_out": 2.0 ** -7, "state_iso": 1e-4, "state_e2e": 5e-2},
}


# --------------------------------------------------------------------------- trees


def private_build_tree(logp: torch.Tensor, budget: int) -> tuple[list[int], list[int]]:
    """Paper-exact DDTree best-first build (fallback when ``sglang_ddtree.tree`` is absent).

    ``logp`` is ``[L, V]`` per-depth draft log-probs.  Returns ``(parents, tokens)``
    for the B nodes in pop order; ``parents[i] == -1`` means a child of the root
    (the bonus token).  Top-K per depth with K = min(B, V); pop B times; after a
    pop push the next sibling and the first child.
    """
    L, V = logp.shape
    K = min(budget, V)
    vals, idx = torch.topk(logp.double(), K, dim=-1)
    vals = vals.tolist()
    idx = idx.tolist()
    heap: list[tuple[float, int, int, int, int]] = []
    counter = 0
    heapq.heappush(heap, (-vals[0][0], counter, 0, 0, -1))
    parents: list[int] = []
    tokens: list[int] = []
    while heap and len(parents) < budget:
        neg, _, d, r, par = heapq.heappop(heap)
        node = len(parents)
        parents.append(par)
        tokens.append(idx[d][r])
        score = -neg
        if r + 1 < K:
            counter += 1
            heapq.heappush(heap, (-(score - vals[d][r] + vals[d][r + 1]), counter, d, r + 1, par))
        if d + 1 < L:
            counter += 1
            heapq.heappush(heap, (-(score + vals[d + 1][0]), counter, d + 1, 0, node))
    return parents, tokens


def build_trees(logps: torch.Tensor, budget: int, device: str = "cpu") -> tuple[list[dict], str]:
    """Build one DDTree per request from ``logps`` ``[N, L, V]``.

    Uses the plugin's own builders (``sglang_ddtree.tree``) when importable: the
    batched tensor builder on ``device`` (the one the worker uses), cross-checked
    against the reference heap.  Falls back to :func:`private_build_tree`.
    Returns per request ``{"parents", "tokens", "first_child", "next_sibling"}``
    (flat layout, slot 0 = bonus) and a description of the builder used.
    """
    try:
        from sglang_ddtree import tree as _tree  # type: ignore

        batched = _tree.build_tree_batched(logps.to(device), budget)
        out = []
        same = True
        for r in range(logps.shape[0]):
            ref = _tree.build_tree_reference(logps[r], budget)
            valid = batched.valid[r].cpu()
            n = int(valid.sum())
            par = batched.parents[r, :n].cpu().tolist()
            tok = batched.token_ids[r, :n].cpu().tolist()
            same &= par == list(ref.parents) and tok == list(ref.tokens)
            out.append(
                {
                    "parents": par,
                    "tokens": tok,
                    "first_child": batched.first_child[r, :n].cpu().tolist(),
                    "next_sibling": batched.next_sibling[r, :n].cpu().tolist(),
                }
            )
        return out, f"sglang_ddtree.tree.build_tree_batched(device={device}); equals build_tree_reference: {same}"
    except ImportError:
        pass
    out = []
    for r in range(logps.shape[0]):
        node_parents, tokens = private_build_tree(logps[r], budget)
        parents = flat_parents(node_parents)
        fc, ns = tree_links(parents)
        out.append({"parents": parents, "tokens": [-1] + tokens, "first_child": fc, "next_sibling": ns})
    return out, "private_build_tree (sglang_ddtree.tree not importable)"


def random_draft_logp(gen: torch.Generator, depth: int, vocab: int) -> torch.Tensor:
    """Random per-depth drafter distributions: Zipf-like over a random token
    permutation, exponent ~ U(1, 3) per position (top-1 prob ~0.25..0.85), with
    log-normal noise, so trees are a mix of deep chains and bushy levels."""
    alpha = 1.0 + 2.0 * torch.rand(depth, 1, generator=gen, dtype=torch.float64)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)[None]
    logits = -alpha * torch.log(ranks) + 0.3 * torch.randn(depth, vocab, generator=gen, dtype=torch.float64)
    perm = torch.argsort(torch.rand(depth, vocab, generator=gen), dim=-1)
    logits = torch.gather(logits, 1, perm)
    return torch.log_softmax(logits, dim=-1)


def flat_parents(node_parents: Sequence[int]) -> list[int]:
    """Node parents (-1 = root child) -> flat verify layout parents ([bonus, nodes...]).

    Flat index 0 is the bonus token (root, parent -1); node i is flat i + 1.
    """
    return [-1] + [p + 1 for p in node_parents]


def tree_links(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """Flat parents -> (retrieve_next_token, retrieve_next_sibling): first child and
    next sibling, children linked in ascending index order, -1 where none."""
    D = len(parents)
    first_child = [-1] * D
    next_sibling = [-1] * D
    last_child = [-1] * D
    for c in range(1, D):
        p = parents[c]
        if not (0 <= p < c):
            raise ValueError(f"parent of {c} is {p}: parents must precede children")
        if first_child[p] == -1:
            first_child[p] = c
        else:
            next_sibling[last_child[p]] = c
        last_child[p] = c
    return first_child, next_sibling


def derive_parents_like_kernel(first_child: Sequence[int], next_sibling: Sequence[int]) -> list[int]:
    """Python model of the parent derivation in SGLang's ``_causal_conv1d_update_kernel``
    (tree mode): tokens visited in index order; a token's first child gets it as
    parent, its next sibling gets its parent; unset entries stay 0."""
    D = len(first_child)
    par = [0] * D
    for i in range(D):
        if first_child[i] != -1:
            par[first_child[i]] = i
        if next_sibling[i] != -1:
            par[next_sibling[i]] = par[i]
    return par


def root_paths(parents: Sequence[int]) -> list[list[int]]:
    """Flat parents -> every token's root-to-token path of flat indices (root first)."""
    paths: list[list[int]] = []
    for i, p in enumerate(parents):
        paths.append([i] if p < 0 else paths[p] + [i])
    return paths


def chain_paths(D: int) -> list[list[int]]:
    """Paths the chain (``hybrid-unsafe``) order implies: token i after tokens 0..i-1."""
    return [list(range(i + 1)) for i in range(D)]


def structural_affected(parents: Sequence[int], width: int) -> tuple[list[bool], list[bool]]:
    """Which tokens the chain order gets wrong by construction.

    Returns (conv_affected, state_affected): conv differs when the last ``width-1``
    path tokens differ from the last ``width-1`` flat predecessors (history columns
    padded equally); the recurrent state differs whenever the path != 0..i.
    """
    paths = root_paths(parents)
    conv, state = [], []
    for i, path in enumerate(paths):
        chain = list(range(i + 1))
        state.append(path != chain)
        conv.append(path[-width:] != chain[-width:])
    return conv, state


# ---------------------------------------------------------------- float64 reference


def _path_gather_index(paths: Sequence[Sequence[int]], width: int) -> torch.Tensor:
    """[D, width] indices into ``cat(history (width-1 cols), x (D rows))`` giving each
    token's conv input window along its path (oldest first, token itself last)."""
    hist = list(range(width - 1))
    rows = []
    for path in paths:
        seq = hist + [width - 1 + t for t in path]
        rows.append(seq[-width:])
    return torch.tensor(rows, dtype=torch.long)


def reference_conv(
    x: torch.Tensor,
    conv_state0: torch.Tensor,
    weight: torch.Tensor,
    paths: Sequence[Sequence[int]],
    bias: Optional[torch.Tensor] = None,
    silu: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv along each token's path, in float64.

    x: [D, dim] token inputs; conv_state0: [dim, W-1] history, oldest column first;
    weight: [dim, W], last column multiplies the current token.
    Returns (out [D, dim], window [D, W-1, dim]) where window is the conv state after
    consuming the token (oldest first) -- the layout of SGLang's
    ``intermediate_conv_window[slot, step, dim, :]`` transposed.
    """
    W = weight.shape[1]
    x = x.double()
    ext = torch.cat([conv_state0.double().t(), x], dim=0)  # [W-1+D, dim]
    idx = _path_gather_index(paths, W).to(x.device)
    win = ext[idx]  # [D, W, dim]
    out = (win * weight.double().t()[None]).sum(1)
    if bias is not None:
        out = out + bias.double()[None]
    if silu:
        out = out * torch.sigmoid(out)
    return out, win[:, 1:, :]


@dataclass
class GDNParams:
    A_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    scale: Optional[float] = None
    softplus_threshold: float = 20.0


def split_qkv(mixed: torch.Tensor, p: GDNParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[D, dim] conv output -> q [D,H,K], k [D,H,K], v [D,HV,V] (SGLang's split order)."""
    H, HV, K, V = p.num_k_heads, p.num_v_heads, p.head_k_dim, p.head_v_dim
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    return q.reshape(-1, H, K), k.reshape(-1, H, K), v.reshape(-1, HV, V)


def _gdn_step(S, q, k, v, a, b, p: GDNParams):
    """One gated-delta-rule step, float64, batched over nodes.

    S: [n, HV, V, K] (SGLang's memory layout: state[hv, v, k]); q,k: [n, H, K];
    v: [n, HV, V]; a, b: [n, HV].  Mirrors fused_sigmoid_gating_delta_rule_update
    (GDN, softplus gate, sigmoid beta, q/k l2norm in kernel).
    Returns (S_new, o [n, HV, V]).
    """
    H, HV, K = p.num_k_heads, p.num_v_heads, p.head_k_dim
    scale = p.scale if p.scale is not None else K ** -0.5
    rep = HV // H
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    qn = qn.repeat_interleave(rep, dim=1)
    kn = kn.repeat_interleave(rep, dim=1)
    x = a + p.dt_bias.to(S.dtype)[None]
    sp = torch.where(x <= p.softplus_threshold, torch.log1p(torch.exp(x)), x)
    g = -torch.exp(p.A_log.to(S.dtype))[None] * sp
    beta = torch.sigmoid(b)
    S = S * torch.exp(g)[..., None, None]
    vn = (v - torch.einsum("nhvk,nhk->nhv", S, kn)) * beta[..., None]
    S = S + vn[..., :, None] * kn[..., None, :]
    o = torch.einsum("nhvk,nhk->nhv", S, qn)
    return S, o


def reference_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    S0: torch.Tensor,
    p: GDNParams,
    paths: Sequence[Sequence[int]],
    out_of: Optional[Sequence[int]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every token's root-to-token path sequentially from S0, in float64.

    Paths are independent: token i's state is the result of feeding only the tokens
    of ``paths[i]`` in order (no state is shared between tokens).  The loop runs by
    step index across all tokens at once, which changes nothing mathematically.
    Returns (states [D, HV, V, K], outputs [D, HV, V]) after each token.
    """
    q, k, v, a, b = (t.double() for t in (q, k, v, a, b))
    D = len(paths)
    S = S0.double()[None].expand(D, *S0.shape).clone()
    o = torch.zeros(D, p.num_v_heads, p.head_v_dim, dtype=torch.float64, device=S.device)
    lens = torch.tensor([len(pt) for pt in paths])
    maxlen = int(lens.max())
    padded = torch.full((D, maxlen), -1, dtype=torch.long)
    for i, pt in enumerate(paths):
        padded[i, : len(pt)] = torch.tensor(pt, dtype=torch.long)
    for t in range(maxlen):
        act = (lens > t).nonzero().flatten()
        tok = padded[act, t]
        act_d, tok_d = act.to(S.device), tok.to(S.device)
        S_new, o_new = _gdn_step(S[act_d], q[tok_d], k[tok_d], v[tok_d], a[tok_d], b[tok_d], p)
        S[act_d] = S_new
        last = (lens[act] == t + 1).to(S.device)
        o[act_d[last]] = o_new[last]
    return S, o


def sequential_reference_single(
    x: torch.Tensor,
    conv_state0: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    S0: torch.Tensor,
    p: GDNParams,
    path: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain one-token-at-a-time loop over one path (conv with a rolling window, then
    the GDN step).  Used by the tests to validate the batched reference."""
    win = conv_state0.double().clone()  # [dim, W-1]
    S = S0.double()[None].clone()
    o = None
    for t in path:
        full = torch.cat([win, x[t].double()[:, None]], dim=1)  # [dim, W]
        y = (full * weight.double()).sum(1)
        y = y * torch.sigmoid(y)
        win = full[:, 1:]
        qq, kk, vv = split_qkv(y[None], p)
        S, o = _gdn_step(S, qq, kk, vv, a[t].double()[None], b[t].double()[None], p)
    return win.t().clone(), S[0], o[0]


# --------------------------------------------------------------------- metrics


def node_rel_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-node max|got-ref| / max|ref| (leading dim = node)."""
    d = (got.double() - ref.double()).abs().flatten(1).amax(1)
    s = ref.double().abs().flatten(1).amax(1).clamp_min(1e-30)
    return d / s


def node_abs_err(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got.double() - ref.double()).abs().flatten(1).amax(1)


def argmax_flips(o_got: torch.Tensor, o_ref: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """Bool per node: does argmax(head @ o) differ between got and ref?"""
    lg = o_got.double().flatten(1) @ head.double().t()
    lr = o_ref.double().flatten(1) @ head.double().t()
    return lg.argmax(-1) != lr.argmax(-1)


# ------------------------------------------------------------ problem generation


@dataclass
class LayerShape:
    num_k_heads: int = 16
    num_v_heads: int = 32
    head_k_dim: int = 128
    head_v_dim: int = 128
    conv_width: int = 4

    @property
    def dim(self) -> int:
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass
class Problem:
    """One request: a tree and the random layer inputs for its D tokens."""

    parents: list[int]  # flat, [-1, ...]
    tokens: list[int]
    first_child: list[int]  # retrieve_next_token
    next_sibling: list[int]  # retrieve_next_sibling
    x: torch.Tensor  # [D, dim] (act dtype)
    a: torch.Tensor  # [D, HV]
    b: torch.Tensor  # [D, HV]
    conv_state0: torch.Tensor  # [dim, W-1]
    S0: torch.Tensor  # [HV, V, K] float32


@dataclass
class Layer:
    weight: torch.Tensor  # [dim, W] act dtype
    params: GDNParams
    shape: LayerShape


def make_layer(gen: torch.Generator, shape: LayerShape, dtype: torch.dtype) -> Layer:
    HV = shape.num_v_heads
    w = torch.randn(shape.dim, shape.conv_width, generator=gen) * 0.5
    A_log = torch.log(0.5 + 3.5 * torch.rand(HV, generator=gen))
    dt_bias = -3.0 + 0.5 * torch.randn(HV, generator=gen)
    params = GDNParams(
        A_log=A_log.float(),
        dt_bias=dt_bias.float(),
        num_k_heads=shape.num_k_heads,
        num_v_heads=HV,
        head_k_dim=shape.head_k_dim,
        head_v_dim=shape.head_v_dim,
    )
    return Layer(weight=w.to(dtype), params=params, shape=shape)


def make_problems(
    gen: torch.Generator,
    shape: LayerShape,
    budget: int,
    dtype: torch.dtype,
    n: int,
    depth: int,
    vocab: int,
    tree_device: str = "cpu",
) -> tuple[list[Problem], str]:
    logps = torch.stack([random_draft_logp(gen, depth, vocab) for _ in range(n)])
    trees, builder = build_trees(logps, budget, tree_device)
    HV, V, K, W = shape.num_v_heads, shape.head_v_dim, shape.head_k_dim, shape.conv_width
    problems = []
    for t in trees:
        D = len(t["parents"])
        x = torch.randn(D, shape.dim, generator=gen).to(dtype)
        a = (0.5 * torch.randn(D, HV, generator=gen)).to(dtype)
        b = torch.randn(D, HV, generator=gen).to(dtype)
        conv_state0 = torch.randn(shape.dim, W - 1, generator=gen).to(dtype)
        S0 = (0.5 * torch.randn(HV, V, K, generator=gen)).float()
        problems.append(
            Problem(t["parents"], t["tokens"], t["first_child"], t["next_sibling"], x, a, b, conv_state0, S0)
        )
    return problems, builder


# ------------------------------------------------------------ SGLang kernels (GPU)


def import_sglang_kernels():
    """Import exactly SGLang's two Triton kernels used by GDN tree verify."""
    from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import (
        fused_sigmoid_gating_delta_rule_update,
    )
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_update

    return causal_conv1d_update, fused_sigmoid_gating_delta_rule_update


@dataclass
class KernelResult:
    conv_out: list[torch.Tensor] = field(default_factory=list)  # per req [D, dim]
    window: list[torch.Tensor] = field(default_factory=list)  # per req [D, W-1, dim]
    parents: list[Optional[torch.Tensor]] = field(default_factory=list)  # per req [D]
    states: list[torch.Tensor] = field(default_factory=list)  # per req [D, HV, V, K]
    o: list[torch.Tensor] = field(default_factory=list)  # per req [D, HV, V]


def run_sglang(problems: Sequence[Problem], layer: Layer, tree: bool, device: str = "cuda") -> KernelResult:
    """Run one GDN layer's target verify for a batch of requests the way
    ``GDNAttnBackend.forward_extend`` (is_target_verify) calls the Triton kernels.

    ``tree=True``: tree mode (retrieve_next_token/sibling given, retrieve_parent_token
    filled by the conv kernel and passed to the recurrent kernel).
    ``tree=False``: chain mode (what topk == 1 / a hybrid-unsafe override runs).
    """
    causal_conv1d_update, fused_gdn_update = import_sglang_kernels()
    sh = layer.shape
    N = len(problems)
    D = len(problems[0].parents)
    assert all(len(pb.parents) == D for pb in problems)
    dim, W = sh.dim, sh.conv_width
    H, HV, K, V = sh.num_k_heads, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim
    dtype = problems[0].x.dtype
    slots = N + 3
    g = torch.Generator().manual_seed(1234)
    # Non-trivial slot indices, different for the state pool and the intermediate
    # buffers (as in SGLang, where they come from different index spaces).
    cache_idx = torch.randperm(slots, generator=g)[:N].to(torch.int32).to(device)
    inter_idx = torch.randperm(slots, generator=g)[:N].to(torch.int32).to(device)

    x = torch.stack([pb.x for pb in problems]).to(device)  # [N, D, dim]
    x_k = x.transpose(1, 2)  # [N, dim, D], dim-contiguous like mixed_qkv.view().transpose()
    conv_pool = torch.zeros(slots, W - 1, dim, dtype=dtype, device=device).transpose(1, 2)
    for r, pb in enumerate(problems):
        conv_pool[int(cache_idx[r])] = pb.conv_state0.to(device)
    inter_win = torch.zeros(slots, D, dim, W - 1, dtype=dtype, device=device)
    kw = {}
    rpt = None
    if tree:
        nt = torch.empty(N, D, dtype=torch.int32)
        ns = torch.empty(N, D, dtype=torch.int32)
        for r, pb in enumerate(problems):
            nt[r] = torch.tensor(pb.first_child, dtype=torch.int32)
            ns[r] = torch.tensor(pb.next_sibling, dtype=torch.int32)
        nt, ns = nt.to(device), ns.to(device)
        rpt = torch.empty_like(nt)
        kw = dict(retrieve_next_token=nt, retrieve_next_sibling=ns, retrieve_parent_token=rpt)
    conv_out = causal_conv1d_update(
        x_k,
        conv_pool,
        layer.weight.to(device),
        None,
        "silu",
        conv_state_indices=cache_idx,
        intermediate_conv_window=inter_win,
        intermediate_state_indices=inter_idx,
        **kw,
    )
    mixed = conv_out.transpose(1, 2).reshape(N * D, dim)
    q, k, v = torch.split(mixed, [H * K, H * K, HV * V], dim=-1)
    q = q.contiguous().view(1, N * D, H, K)
    k = k.contiguous().view(1, N * D, H, K)
    v = v.contiguous().view(1, N * D, HV, V)
    a = torch.cat([pb.a for pb in problems]).to(device)
    b = torch.cat([pb.b for pb in problems]).to(device)
    ssm_pool = torch.zeros(slots, HV, V, K, dtype=torch.float32, device=device)
    for r, pb in enumerate(problems):
        ssm_pool[int(cache_idx[r])] = pb.S0.to(device)
    inter_states = torch.zeros(slots, D, HV, V, K, dtype=torch.float32, device=device)
    qsl = torch.arange(0, N * D + 1, D, dtype=torch.int32, device=device)
    o = fused_gdn_update(
        A_log=layer.params.A_log.to(device),
        a=a,
        dt_bias=layer.params.dt_bias.to(device),
        softplus_beta=1.0,
        softplus_threshold=20.0,
        q=q,
        k=k,
        v=v,
        b=b,
        initial_state_source=ssm_pool,
        initial_state_indices=cache_idx,
        cu_seqlens=qsl,
        use_qk_l2norm_in_kernel=True,
        is_kda=False,
        disable_state_update=True,
        intermediate_states_buffer=inter_states,
        intermediate_state_indices=inter_idx,
        cache_steps=D,
        retrieve_parent_token=rpt,
    )
    torch.cuda.synchronize()
    o = o.reshape(N, D, HV, V)
    res = KernelResult()
    conv_out_nd = conv_out.transpose(1, 2)  # [N, D, dim]
    for r in range(N):
        ii = int(inter_idx[r])
        res.conv_out.append(conv_out_nd[r])
        res.window.append(inter_win[ii].permute(0, 2, 1))  # [D, W-1, dim]
        res.parents.append(rpt[r] if rpt is not None else None)
        res.states.append(inter_states[ii])
        res.o.append(o[r])
    return res


def run_emulated(problems: Sequence[Problem], layer: Layer, tree: bool, device: str = "cpu") -> KernelResult:
    """Torch float32 stand-in for :func:`run_sglang` with the kernels' semantics
    (parent derivation from the links, flat-order processing reading the parent's
    cached state in tree mode, the previous token's in chain mode, conv output
    rounded to the activation dtype).  For CPU dry runs and tests of the check
    itself; it proves nothing about SGLang."""
    sh = layer.shape
    p = _to(layer.params, device)
    res = KernelResult()
    for pb in problems:
        D = len(pb.parents)
        if tree:
            par = derive_parents_like_kernel(pb.first_child, pb.next_sibling)
            par_list = [-1] + par[1:]
        else:
            par = None
            par_list = [-1] + list(range(D - 1))
        paths = root_paths(par_list)
        x = pb.x.to(device)
        out, win = reference_conv(x.float(), pb.conv_state0.to(device).float(), layer.weight.to(device).float(), paths)
        out = out.to(x.dtype)
        win = win.to(x.dtype)
        q, k, v = split_qkv(out.float(), p)
        a, b = pb.a.to(device).float(), pb.b.to(device).float()
        states = torch.empty(D, sh.num_v_heads, sh.head_v_dim, sh.head_k_dim, device=device)
        o = torch.empty(D, sh.num_v_heads, sh.head_v_dim, device=device)
        for i in range(D):
            S_prev = pb.S0.to(device)[None] if i == 0 else states[par_list[i]][None]
            S_new, o_new = _gdn_step(S_prev.float(), q[i : i + 1], k[i : i + 1], v[i : i + 1], a[i : i + 1], b[i : i + 1], p)
            states[i] = S_new[0]
            o[i] = o_new[0]
        res.conv_out.append(out)
        res.window.append(win)
        res.parents.append(torch.tensor(par, dtype=torch.int32) if par is not None else None)
        res.states.append(states)
        res.o.append(o.to(x.dtype))
    return res


# ------------------------------------------------------------------ the check


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.2e}"


def evaluate_budget(
    budget: int,
    dtype_name: str,
    n_trees: int,
    shape: LayerShape,
    seed: int,
    depth: int,
    vocab: int,
    head_vocab: int,
    device: str,
    backend: str = "sglang",
) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    tol = TOLERANCES[dtype_name]
    gen = torch.Generator().manual_seed(seed * 1000 + budget)
    layer = make_layer(gen, shape, dtype)
    problems, builder = make_problems(gen, shape, budget, dtype, n_trees, depth, vocab, device)
    head = torch.randn(head_vocab, shape.num_v_heads * shape.head_v_dim, generator=gen)
    head = head.to(device=device, dtype=torch.float64)
    p = layer.params
    W = shape.conv_width

    t0 = time.perf_counter()
    run = run_sglang if backend == "sglang" else run_emulated
    tree_res = run(problems, layer, tree=True, device=device)
    t1 = time.perf_counter()
    chain_res = run(problems, layer, tree=False, device=device)
    t2 = time.perf_counter()

    agg: dict[str, list] = {k: [] for k in (
        "parent_ok", "win_tree", "win_chain", "cout_tree", "st_iso", "st_e2e", "o_e2e",
        "flip_tree", "st_chain", "o_chain", "flip_chain", "win_chain_aff", "st_chain_aff",
        "struct_conv", "struct_state", "depth", "links_ok", "flip_chain_vs_tree",
    )}
    for r, pb in enumerate(problems):
        paths = root_paths(pb.parents)
        x = pb.x.to(device)
        cs0 = pb.conv_state0.to(device)
        w = layer.weight.to(device)
        a, b, S0 = pb.a.to(device), pb.b.to(device), pb.S0.to(device)
        # reference conv on the true paths (float64 from the exact kernel inputs)
        ref_out, ref_win = reference_conv(x, cs0, w, paths)
        # parents the conv kernel derived from first-child / next-sibling
        kpar = tree_res.parents[r].cpu().tolist()
        agg["parent_ok"].append(kpar[1:] == pb.parents[1:])
        agg["links_ok"].append(tree_links(pb.parents) == (pb.first_child, pb.next_sibling))
        agg["win_tree"].append(node_abs_err(tree_res.window[r], ref_win))
        agg["win_chain"].append(node_abs_err(chain_res.window[r], ref_win))
        agg["cout_tree"].append(node_rel_err(tree_res.conv_out[r], ref_out))
        # recurrent state, isolated: reference fed the kernel's own conv output
        qk, kk, vk = split_qkv(tree_res.conv_out[r].double(), p)
        S_iso, _ = reference_gdn(qk, kk, vk, a, b, S0, _to(p, device), paths)
        agg["st_iso"].append(node_rel_err(tree_res.states[r], S_iso))
        del S_iso
        # end to end: reference does its own float64 conv along each path
        qr, kr, vr = split_qkv(ref_out, p)
        S_ref, o_ref = reference_gdn(qr, kr, vr, a, b, S0, _to(p, device), paths)
        agg["st_e2e"].append(node_rel_err(tree_res.states[r], S_ref))
        agg["o_e2e"].append(node_rel_err(tree_res.o[r], o_ref))
        agg["flip_tree"].append(argmax_flips(tree_res.o[r], o_ref, head))
        agg["st_chain"].append(node_rel_err(chain_res.states[r], S_ref))
        agg["o_chain"].append(node_rel_err(chain_res.o[r], o_ref))
        agg["flip_chain"].append(argmax_flips(chain_res.o[r], o_ref, head))
        agg["flip_chain_vs_tree"].append(argmax_flips(chain_res.o[r], tree_res.o[r], head))
        del S_ref
        sc, ss = structural_affected(pb.parents, W)
        agg["struct_conv"].append(torch.tensor(sc))
        agg["struct_state"].append(torch.tensor(ss))
        agg["depth"].append(max(len(pt) - 1 for pt in paths))

    cat = lambda key: torch.cat([t.flatten().double().cpu() for t in agg[key]])  # noqa: E731
    win_tree, win_chain = cat("win_tree"), cat("win_chain")
    cout_tree, st_iso, st_e2e, o_e2e = cat("cout_tree"), cat("st_iso"), cat("st_e2e"), cat("o_e2e")
    st_chain, o_chain = cat("st_chain"), cat("o_chain")
    flip_tree, flip_chain = cat("flip_tree"), cat("flip_chain")
    flip_cvt = cat("flip_chain_vs_tree")
    struct_conv, struct_state = cat("struct_conv"), cat("struct_state")
    n_nodes = st_e2e.numel()
    affected = st_chain > tol["state_e2e"]
    res = {
        "budget": budget,
        "dtype": dtype_name,
        "backend": backend,
        "trees": n_trees,
        "tokens_per_tree": contract.tree_width(budget),
        "nodes_total": n_nodes,
        "max_tree_depth": max(agg["depth"]),
        "tree_builder": builder,
        "links_equal_first_child_next_sibling_of_parents": all(agg["links_ok"]),
        "tolerance": tol,
        "tree_path": {
            "parents_exact": all(agg["parent_ok"]),
            "conv_window_max_abs_err": float(win_tree.max()),
            "conv_out_max_rel_err": float(cout_tree.max()),
            "state_isolated_max_rel_err": float(st_iso.max()),
            "state_e2e_max_rel_err": float(st_e2e.max()),
            "output_e2e_max_rel_err": float(o_e2e.max()),
            "argmax_flips": int(flip_tree.sum()),
            "argmax_flip_rate": float(flip_tree.mean()),
            "within_tolerance": bool(
                all(agg["parent_ok"])
                and float(win_tree.max()) <= tol["conv_window"]
                and float(cout_tree.max()) <= tol["conv_out"]
                and float(st_iso.max()) <= tol["state_iso"]
                and float(st_e2e.max()) <= tol["state_e2e"]
            ),
        },
        "unsafe_chain": {
            "conv_window_max_abs_err": float(win_chain.max()),
            "conv_window_nodes_differing_share": float((win_chain > 0).double().mean()),
            "conv_window_structural_share": float(struct_conv.mean()),
            "state_max_rel_err": float(st_chain.max()),
            "state_median_rel_err_affected": float(st_chain[affected].median()) if affected.any() else 0.0,
            "state_nodes_affected_share": float(affected.double().mean()),
            "state_structural_share": float(struct_state.mean()),
            "output_max_rel_err": float(o_chain.max()),
            "argmax_flips": int(flip_chain.sum()),
            "argmax_flip_rate": float(flip_chain.mean()),
            "argmax_flip_rate_among_affected": float(flip_chain[affected].mean()) if affected.any() else 0.0,
            "argmax_flip_rate_vs_tree_kernel": float(flip_cvt.mean()),
        },
        "kernel_seconds_incl_compile": {"tree": t1 - t0, "chain": t2 - t1},
    }
    return res


def _to(p: GDNParams, device) -> GDNParams:
    return GDNParams(
        A_log=p.A_log.to(device),
        dt_bias=p.dt_bias.to(device),
        num_k_heads=p.num_k_heads,
        num_v_heads=p.num_v_heads,
        head_k_dim=p.head_k_dim,
        head_v_dim=p.head_v_dim,
        scale=p.scale,
        softplus_threshold=p.softplus_threshold,
    )


def format_table(results: Sequence[dict]) -> str:
    hdr = (
        "| dtype | B | trees x nodes | depth | parents | conv win err | conv out rel | state rel (iso) "
        "| state rel (e2e) | tol e2e | tree flips | unsafe state rel max | unsafe affected (struct) "
        "| unsafe conv win err / share | unsafe flip rate vs ref (among affected; vs tree kernel) |"
    )
    sep = "|" + "|".join(["---"] * (hdr.count("|") - 1)) + "|"
    rows = [hdr, sep]
    for r in results:
        t, u = r["tree_path"], r["unsafe_chain"]
        rows.append(
            f"| {r['dtype']} | {r['budget']} | {r['trees']}x{r['tokens_per_tree']} | {r['max_tree_depth']} "
            f"| {'exact' if t['parents_exact'] else 'MISMATCH'} | {_fmt(t['conv_window_max_abs_err'])} "
            f"| {_fmt(t['conv_out_max_rel_err'])} | {_fmt(t['state_isolated_max_rel_err'])} "
            f"| {_fmt(t['state_e2e_max_rel_err'])} | {_fmt(r['tolerance']['state_e2e'])} "
            f"| {t['argmax_flips']}/{r['nodes_total']} "
            f"| {_fmt(u['state_max_rel_err'])} "
            f"| {100 * u['state_nodes_affected_share']:.1f}% ({100 * u['state_structural_share']:.1f}%) "
            f"| {_fmt(u['conv_window_max_abs_err'])} / {100 * u['conv_window_nodes_differing_share']:.1f}% "
            f"| {100 * u['argmax_flip_rate']:.1f}% ({100 * u['argmax_flip_rate_among_affected']:.1f}%; "
            f"{100 * u['argmax_flip_rate_vs_tree_kernel']:.1f}%) |"
        )
    return "\n".join(rows)


def _run_parallel(cases, args, argv) -> list[dict]:
    """Run each (dtype, budget) case in its own process, at most ``args.jobs`` at once."""
    import os
    import subprocess
    import tempfile

    base = list(argv if argv is not None else sys.argv[1:])
    # drop the options this function sets per case
    drop = {"--budgets", "--dtypes", "--json", "--jobs"}
    kept, skip = [], False
    for tok in base:
        if tok in drop:
            skip = True
            continue
        if skip and not tok.startswith("--"):
            continue
        skip = False
        kept.append(tok)
    tmp = tempfile.mkdtemp(prefix="hybrid_gdn_")
    pending = list(cases)
    running: list[tuple[subprocess.Popen, str, str]] = []
    results: dict[tuple[str, int], dict] = {}
    failed = []
    while pending or running:
        while pending and len(running) < args.jobs:
            dt, b = pending.pop(0)
            js = os.path.join(tmp, f"{dt}_{b}.json")
            log = os.path.join(tmp, f"{dt}_{b}.log")
            cmd = [sys.executable, "-m", "ddtree_checks.hybrid_gdn", *kept,
                   "--budgets", str(b), "--dtypes", dt, "--json", js]
            running.append((subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT), js, log))
        time.sleep(1.0)
        for item in list(running):
            proc, js, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            with open(log) as f:
                text = f.read()
            print(f"--- {os.path.basename(log)} (exit {proc.returncode})", flush=True)
            print("\n".join(line for line in text.splitlines() if not line.startswith("|")), flush=True)
            if os.path.exists(js):
                with open(js) as f:
                    for r in json.load(f)["results"]:
                        results[(r["dtype"], r["budget"])] = r
            else:
                failed.append(log)
    if failed:
        print("hybrid_gdn: cases without results:", failed, file=sys.stderr)
    return [results[c] for c in cases if c in results]


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddtree_checks.hybrid_gdn", description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=sorted(TOLERANCES))
    ap.add_argument("--trees", type=int, default=8, help="trees (requests, one batch) per budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depth", type=int, default=16, help="drafter positions (max tree depth)")
    ap.add_argument("--vocab", type=int, default=1024, help="draft vocabulary for random draft distributions")
    ap.add_argument("--head-vocab", type=int, default=8192, help="rows of the random output head")
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="run the (dtype, budget) cases in this many parallel processes (Triton compiles the "
        "tree conv kernel per verify length, ~1-2 min at D=129; parallel jobs overlap the compiles)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--backend",
        default="sglang",
        choices=["sglang", "emulate"],
        help="sglang: SGLang's Triton kernels (GPU). emulate: torch stand-in, for dry runs of the check only",
    )
    args = ap.parse_args(argv)

    if args.backend == "sglang" and not torch.cuda.is_available():
        print("hybrid_gdn: no CUDA device; the SGLang Triton kernels need a GPU", file=sys.stderr)
        return 2
    shape = LayerShape(args.k_heads, args.v_heads, args.head_dim, args.head_dim, 4)
    meta = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "layer_shape": shape.__dict__,
        "args": vars(args),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        from importlib.metadata import version

        meta["sglang"] = version("sglang")
    except Exception:
        meta["sglang"] = "unknown (no dist-info)"
    print("hybrid_gdn:", json.dumps(meta), flush=True)

    results = []
    cases = [(d, b) for d in args.dtypes for b in args.budgets]
    if args.jobs > 1 and len(cases) > 1:
        results = _run_parallel(cases, args, argv)
    else:
        for dtype_name, budget in cases:
            t0 = time.perf_counter()
            r = evaluate_budget(
                budget,
                dtype_name,
                args.trees,
                shape,
                args.seed,
                args.depth,
                args.vocab,
                args.head_vocab,
                args.device,
                args.backend,
            )
            r["wall_seconds"] = time.perf_counter() - t0
            print(json.dumps(r), flush=True)
            results.append(r)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    table = format_table(results)
    ok = bool(results) and len(results) == len(cases) and all(
        r["tree_path"]["within_tolerance"] for r in results
    )
    print()
    print(table)
    print()
    print("tree path within stated tolerance for every budget and dtype:", ok)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "table": table, "tree_path_ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
