"""Triton kernels for the DDTree builder (see :mod:`sglang_ddtree.tree`).

Two launches (plus one ``torch.topk`` when ``K < V``) build a whole batch of
trees on the GPU with no host round-trip:

1. :func:`rank_topk_triton` - the per-position top-``K`` with the documented
   tie rule.  ``torch.topk(x, K + 1)`` gives the right *multiset* of values
   (its choice among equal values is unspecified); one program per row then
   fixes the selection exactly: the ``K+1``-th value tells whether the
   ``K``-th value has ties outside the chosen set (only then the row is
   scanned for the lowest-id tied tokens - a rare, data-dependent branch), and
   the ``K`` chosen entries are ordered by ``(-logprob, token id)`` by
   counting (``rank_i = #{j: v_j > v_i or (v_j == v_i and id_j < id_i)}``),
   all in float64 after the :data:`~sglang_ddtree.tree.LOGPROB_FLOOR` clamp,
   exactly as the reference ranks.
2. :func:`tree_from_ranked_triton` - one single-warp program per request
   replays the paper's best-first heap *exactly*: the frontier is kept as one
   entry per popped node ("its next unexpanded child"), each pop is a
   max-reduction over candidate scores followed by a min-reduction over a
   packed integer key ``(depth, preorder of parent, rank, ...)`` that
   implements the tie rule (equal score -> shallower -> lexicographically
   smaller rank tuple; among nodes of one depth, lexicographic order of rank
   tuples is the DFS preorder of the tree, maintained incrementally).  Scores
   are accumulated with the same float64 additions as the reference
   (``parent score + log-prob``), so scores, slots, parents and tokens are
   bit-identical.  ``first_child`` / ``next_sibling`` are written on the fly.

Limits of the Triton path: ``B <= 511`` (10-bit key fields).  Larger budgets
and CPU tensors use the torch builder.  Under ``TRITON_INTERPRET=1`` the same
kernels run on CPU tensors (used by the tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Largest budget the Triton tree kernel supports (10-bit packed key fields).
MAX_TRITON_BUDGET = 511

_FLOOR = tl.constexpr(-1.0e30)  # == sglang_ddtree.tree.LOGPROB_FLOOR


@triton.jit
def _rank_kernel(
    x_ptr, tv_ptr, ti_ptr, out_v_ptr, out_i_ptr,
    LC, V, K, KK, sxn, sxl,
    FROM_TOPK: tl.constexpr, KB: tl.constexpr, JB: tl.constexpr, SB: tl.constexpr,
):
    r = tl.program_id(0)
    n = r // LC
    d = r % LC
    xrow = x_ptr + n.to(tl.int64) * sxn + d.to(tl.int64) * sxl
    offs = tl.arange(0, KB)
    obase = r.to(tl.int64) * K
    if FROM_TOPK:
        # KK = K + 1 unordered top values of the row (torch.topk)
        inb = offs < KK
        v = tl.load(tv_ptr + r.to(tl.int64) * KK + offs, mask=inb, other=0.0).to(tl.float32).to(tl.float64)
        ids = tl.load(ti_ptr + r.to(tl.int64) * KK + offs, mask=inb, other=0).to(tl.int64)
        v = tl.where(v < _FLOOR, _FLOOR, v)
        m1 = tl.min(tl.where(inb, v, float("inf")), axis=0)
        c1 = tl.sum((inb & (v == m1)).to(tl.int32), axis=0)
        # Everything above the smallest of the K+1 values is in the top K.  If the
        # smallest value is unique it is the one left out; otherwise it is the
        # K-th value and has ties that torch.topk may have picked arbitrarily.
        use = inb & (v > m1)
        pos = tl.cumsum(use.to(tl.int32), axis=0) - 1
        tl.store(out_v_ptr + obase + pos, v, mask=use)
        tl.store(out_i_ptr + obase + pos, ids, mask=use)
        n_use = tl.sum(use.to(tl.int32), axis=0)
        if c1 >= 2:
            need = K - n_use
            cnt = n_use * 0
            start = n_use * 0
            while (start < V) & (cnt < need):
                o = start + tl.arange(0, SB)
                om = o < V
                xv = tl.load(xrow + o, mask=om, other=0.0).to(tl.float32).to(tl.float64)
                xv = tl.where(xv < _FLOOR, _FLOOR, xv)
                m = om & (xv == m1)
                cpos = cnt + tl.cumsum(m.to(tl.int32), axis=0) - 1
                w = m & (cpos < need)
                tl.store(out_v_ptr + obase + n_use + cpos, xv, mask=w)
                tl.store(out_i_ptr + obase + n_use + cpos, o.to(tl.int64), mask=w)
                cnt += tl.sum(m.to(tl.int32), axis=0)
                start += SB
    else:
        # K == V: every token is a candidate
        inb = offs < V
        v = tl.load(xrow + offs, mask=inb, other=0.0).to(tl.float32).to(tl.float64)
        v = tl.where(v < _FLOOR, _FLOOR, v)
        tl.store(out_v_ptr + obase + offs, v, mask=inb)
        tl.store(out_i_ptr + obase + offs, offs.to(tl.int64), mask=inb)
    tl.debug_barrier()
    kin = offs < K
    vi = tl.load(out_v_ptr + obase + offs, mask=kin, other=0.0)
    ii = tl.load(out_i_ptr + obase + offs, mask=kin, other=0)
    rk = tl.zeros([KB], dtype=tl.int32)
    for j0 in range(0, K, JB):
        oj = j0 + tl.arange(0, JB)
        jm = oj < K
        vj = tl.load(out_v_ptr + obase + oj, mask=jm, other=0.0)
        ij = tl.load(out_i_ptr + obase + oj, mask=jm, other=0)
        better = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (ij[None, :] < ii[:, None]))
        better = better & jm[None, :]
        rk += tl.sum(better.to(tl.int32), axis=1)
    tl.debug_barrier()
    tl.store(out_v_ptr + obase + rk, vi, mask=kin)
    tl.store(out_i_ptr + obase + rk, ii, mask=kin)


@triton.jit
def _rank_kernel_f64(
    x_ptr, tv_ptr, ti_ptr, out_v_ptr, out_i_ptr,
    LC, V, K, KK, sxn, sxl,
    FROM_TOPK: tl.constexpr, KB: tl.constexpr, JB: tl.constexpr, SB: tl.constexpr,
):
    # Same as _rank_kernel for float64 inputs (no float32 round trip).
    r = tl.program_id(0)
    n = r // LC
    d = r % LC
    xrow = x_ptr + n.to(tl.int64) * sxn + d.to(tl.int64) * sxl
    offs = tl.arange(0, KB)
    obase = r.to(tl.int64) * K
    if FROM_TOPK:
        inb = offs < KK
        v = tl.load(tv_ptr + r.to(tl.int64) * KK + offs, mask=inb, other=0.0).to(tl.float64)
        ids = tl.load(ti_ptr + r.to(tl.int64) * KK + offs, mask=inb, other=0).to(tl.int64)
        v = tl.where(v < _FLOOR, _FLOOR, v)
        m1 = tl.min(tl.where(inb, v, float("inf")), axis=0)
        c1 = tl.sum((inb & (v == m1)).to(tl.int32), axis=0)
        use = inb & (v > m1)
        pos = tl.cumsum(use.to(tl.int32), axis=0) - 1
        tl.store(out_v_ptr + obase + pos, v, mask=use)
        tl.store(out_i_ptr + obase + pos, ids, mask=use)
        n_use = tl.sum(use.to(tl.int32), axis=0)
        if c1 >= 2:
            need = K - n_use
            cnt = n_use * 0
            start = n_use * 0
            while (start < V) & (cnt < need):
                o = start + tl.arange(0, SB)
                om = o < V
                xv = tl.load(xrow + o, mask=om, other=0.0).to(tl.float64)
                xv = tl.where(xv < _FLOOR, _FLOOR, xv)
                m = om & (xv == m1)
                cpos = cnt + tl.cumsum(m.to(tl.int32), axis=0) - 1
                w = m & (cpos < need)
                tl.store(out_v_ptr + obase + n_use + cpos, xv, mask=w)
                tl.store(out_i_ptr + obase + n_use + cpos, o.to(tl.int64), mask=w)
                cnt += tl.sum(m.to(tl.int32), axis=0)
                start += SB
    else:
        inb = offs < V
        v = tl.load(xrow + offs, mask=inb, other=0.0).to(tl.float64)
        v = tl.where(v < _FLOOR, _FLOOR, v)
        tl.store(out_v_ptr + obase + offs, v, mask=inb)
        tl.store(out_i_ptr + obase + offs, offs.to(tl.int64), mask=inb)
    tl.debug_barrier()
    kin = offs < K
    vi = tl.load(out_v_ptr + obase + offs, mask=kin, other=0.0)
    ii = tl.load(out_i_ptr + obase + offs, mask=kin, other=0)
    rk = tl.zeros([KB], dtype=tl.int32)
    for j0 in range(0, K, JB):
        oj = j0 + tl.arange(0, JB)
        jm = oj < K
        vj = tl.load(out_v_ptr + obase + oj, mask=jm, other=0.0)
        ij = tl.load(out_i_ptr + obase + oj, mask=jm, other=0)
        better = (vj[None, :] > vi[:, None]) | ((vj[None, :] == vi[:, None]) & (ij[None, :] < ii[:, None]))
        better = better & jm[None, :]
        rk += tl.sum(better.to(tl.int32), axis=1)
    tl.debug_barrier()
    tl.store(out_v_ptr + obase + rk, vi, mask=kin)
    tl.store(out_i_ptr + obase + rk, ii, mask=kin)


@triton.jit
def _tree_kernel(
    vals_ptr, ids_ptr, ints_ptr, score_ptr, valid_ptr,
    N, LC, K, B, D,
    BLOCK: tl.constexpr,
):
    NEG: tl.constexpr = float("-inf")
    n = tl.program_id(0)
    base = n.to(tl.int64) * LC * K
    ar = tl.arange(0, BLOCK)
    neg = tl.full([BLOCK], NEG, tl.float64)
    v00 = tl.load(vals_ptr + base)
    # Per slot (0 = root).  cand[s] = score of slot s's next unexpanded child.
    score = tl.where(ar == 0, 0.0, neg)
    cand = tl.where(ar == 0, v00, neg)
    depth = tl.zeros([BLOCK], dtype=tl.int32)
    nr = tl.zeros([BLOCK], dtype=tl.int32)  # number of children popped so far
    pre = tl.where(ar == 0, 0, 1000)  # DFS preorder position (lex order within a depth)
    size = tl.where(ar == 0, 1, 0)  # popped subtree size
    m1 = tl.full([BLOCK], -1, dtype=tl.int32)
    last = m1  # slot of the last popped child
    par = m1
    rank = m1
    fc = m1
    ns = m1
    for i in range(B):
        t = i + 1
        mx = tl.max(cand, axis=0)
        ok = mx > NEG
        # tie rule: (depth, lex rank tuple) == (depth, preorder of parent, rank);
        # the low fields only carry payload (they never decide: parent preorder is unique).
        key = (
            ((depth + 1).to(tl.int64) << 50)
            | (pre.to(tl.int64) << 40)
            | (nr.to(tl.int64) << 30)
            | (ar.to(tl.int64) << 20)
            | (size.to(tl.int64) << 10)
            | (last + 1).to(tl.int64)
        )
        kmin = tl.min(tl.where(cand == mx, key, 0x7FFFFFFFFFFFFFFF), axis=0)
        lastp = (kmin & 1023).to(tl.int32) - 1
        sizep = ((kmin >> 10) & 1023).to(tl.int32)
        p = ((kmin >> 20) & 1023).to(tl.int32)
        nrp = ((kmin >> 30) & 1023).to(tl.int32)
        prep = ((kmin >> 40) & 1023).to(tl.int32)
        dnew = (kmin >> 50).to(tl.int32)  # depth of the popped node (parent depth + 1)
        vnext = tl.load(vals_ptr + base + (dnew - 1) * K + nrp + 1, mask=ok & (nrp + 1 < K), other=NEG)
        v0 = tl.load(vals_ptr + base + dnew * K, mask=ok & (dnew < LC), other=NEG)
        # (scalar-only masking by `ok`: a frontier that ran dry changes nothing)
        pv = tl.where(ok, p, -1)
        tv = tl.where(ok, t, -1)
        is_p = ar == pv
        is_t = ar == tv
        exist = ar < tl.where(ok, t, 0)
        cand = tl.where(is_p, score + vnext, cand)  # parent's next sibling: pscore + lp
        cand = tl.where(is_t, mx + v0, cand)  # popped node's first child: score + lp
        score = tl.where(is_t, mx, score)
        depth = tl.where(is_t, dnew, depth)
        anc = exist & (pre <= prep) & (pre + size > prep)
        size = tl.where(anc, size + 1, size)
        size = tl.where(is_t, 1, size)
        pos = prep + sizep  # right after the parent's current subtree
        pre = tl.where(exist & (pre >= pos), pre + 1, pre)
        pre = tl.where(is_t, pos, pre)
        nr = tl.where(is_p, nr + 1, nr)
        par = tl.where(is_t, p, par)
        rank = tl.where(is_t, nrp, rank)
        fc = tl.where(ar == tl.where(nrp == 0, pv, -1), t, fc)
        ns = tl.where(ar == tl.where(ok & (nrp > 0), lastp, -1), t, ns)
        last = tl.where(is_p, t, last)
    valid = (ar == 0) | (score > NEG)
    dm = ar < D
    tok = tl.load(ids_ptr + base + (depth - 1) * K + rank, mask=dm & valid & (ar > 0), other=-1)
    row = n.to(tl.int64) * D + ar
    plane = N * D  # (N may arrive as the constant 1)
    tl.store(ints_ptr + row, tok, mask=dm)
    tl.store(ints_ptr + plane + row, par.to(tl.int64), mask=dm)
    tl.store(ints_ptr + 2 * plane + row, depth.to(tl.int64), mask=dm)
    tl.store(ints_ptr + 3 * plane + row, rank.to(tl.int64), mask=dm)
    tl.store(ints_ptr + 4 * plane + row, fc.to(tl.int64), mask=dm)
    tl.store(ints_ptr + 5 * plane + row, ns.to(tl.int64), mask=dm)
    tl.store(score_ptr + row, score, mask=dm)
    tl.store(valid_ptr + row, valid, mask=dm)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x - 1).bit_length())


def _chunking(v: int, kk: int, target: int = 0):
    """Slice length for the two-stage top-k: a divisor ``s`` of ``V`` with
    ``4 * kk <= s <= target`` (largest such), or None."""
    target = target or _CHUNK_TARGET
    best = None
    for s in range(min(target, v // 2), 4 * kk - 1, -1):
        if v % s == 0:
            best = s
            break
    return best


_CHUNK_TARGET = 2048


def topk_values(x, kk: int, chunk: int = 0):
    """``torch.topk(x, kk, dim=-1, sorted=False)`` over ``[N, Lc, V]`` as two
    smaller top-k's when ``V`` has a suitable divisor: top-``kk`` of each slice
    of length ``s``, then top-``kk`` of those.  The *multiset* of values is that
    of the one-stage top-k (the ``kk`` largest values of a row are among the
    ``kk`` largest of their slices); like ``torch.topk``, which of several equal
    values is returned is unspecified - the rank kernel resolves ties exactly.
    (One ``torch.topk`` over rows of ~150k runs on few thread blocks per row and
    was expected to be slower than two stages; measured on the H200 it is not:
    at B=64, batch 32 the two-stage version with s=1187 took ~2 ms against ~1 ms,
    so the default, ``chunk=0``, is one ``torch.topk``; ``chunk=-1`` picks a
    divisor with :func:`_chunking`.)"""
    import torch

    n, lc, v = x.shape
    s = _chunking(v, kk) if chunk < 0 else (chunk or None)
    if s is None:
        tv, ti = torch.topk(x, kk, dim=-1, sorted=False)
        return tv.contiguous(), ti.contiguous()
    c = v // s
    v1, i1 = torch.topk(x.unflatten(-1, (c, s)), kk, dim=-1, sorted=False)  # [n, lc, c, kk]
    i1 = i1 + torch.arange(0, v, s, device=x.device).view(c, 1)
    v2, j2 = torch.topk(v1.flatten(-2), kk, dim=-1, sorted=False)
    return v2.contiguous(), torch.gather(i1.flatten(-2), -1, j2).contiguous()


def rank_topk_triton(x, k: int):
    """Top-``k`` per row of ``x`` (``[N, Lc, V]``, last dim contiguous) with the
    tie rule; returns ``(vals float64 [N, Lc, k], ids int64 [N, Lc, k])``."""
    import torch

    n, lc, v = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not 1 <= k <= min(v, MAX_TRITON_BUDGET):
        raise ValueError(f"k={k} out of range for the Triton ranker (V={v})")
    vals = torch.empty((n, lc, k), dtype=torch.float64, device=x.device)
    ids = torch.empty((n, lc, k), dtype=torch.int64, device=x.device)
    from_topk = k < v
    if from_topk:
        tv, ti = topk_values(x, k + 1)
        kk = k + 1
    else:
        tv, ti, kk = x, x, v
    kb = _next_pow2(kk)
    kern = _rank_kernel_f64 if x.dtype == torch.float64 else _rank_kernel
    kern[(n * lc,)](
        x, tv, ti, vals, ids, lc, v, k, kk, x.stride(0), x.stride(1),
        FROM_TOPK=from_topk, KB=kb, JB=max(1, min(32, 4096 // kb)), SB=2048,
        num_warps=4 if kb >= 128 else 2,
    )
    return vals, ids


def tree_from_ranked_triton(vals, ids, budget: int, num_warps: int = 0):
    """Best-first trees from ranked candidates ``vals`` (float64, sorted per row
    by the tie rule) / ``ids`` (``[N, Lc, K]``).  Returns the output tensors
    ``(ints [6, N, D] int64: tokens, parents, depths, ranks, first_child,
    next_sibling), scores [N, D] float64, valid [N, D] bool)``."""
    import torch

    n, lc, k = vals.shape
    b = int(budget)
    if not 1 <= b <= MAX_TRITON_BUDGET:
        raise ValueError(f"budget {b} out of range for the Triton tree kernel")
    d = b + 1
    dev = vals.device
    ints = torch.empty((6, n, d), dtype=torch.int64, device=dev)
    scores = torch.empty((n, d), dtype=torch.float64, device=dev)
    valid = torch.empty((n, d), dtype=torch.bool, device=dev)
    block = _next_pow2(d)
    if num_warps <= 0:
        num_warps = 1 if block <= 128 else (2 if block <= 256 else 4)
    _tree_kernel[(n,)](
        vals.contiguous(), ids.contiguous(), ints, scores, valid, n, lc, k, b, d,
        BLOCK=block, num_warps=num_warps,
    )
    return ints, scores, valid
