"""Triton kernels for the DDTree builder (see :mod:`sglang_ddtree.tree`).

A handful of launches build a whole batch of trees on the GPU with no host
round-trip and static shapes (CUDA-graph capturable):

1. :func:`rank_topk_triton` - the per-position top-``K`` with the documented
   tie rule: order by ``(-logprob, token id)`` after the
   :data:`~sglang_ddtree.tree.LOGPROB_FLOOR` clamp, values in float64, exactly
   as the reference ranks.  For float32 / bfloat16 / float16 rows with
   ``K < V`` (the default, ``method="select"``) an exact threshold select in
   four launches, no ``torch.topk``:

   a. ``_chunk_max_kernel``: the max of every ``S``-long chunk of each row
      (``S <= 128``, so that a row has at least ``2K`` chunks), in int32
      *order keys* (monotone float32 bits; the clamp classes and ``-0.0 ==
      +0.0`` folded in);
   b. ``_threshold_kernel``: per row, ``T`` = the ``K``-th largest chunk max
      (bisection on the keys) - at least ``K`` elements are ``>= T``;
   c. ``_collect_kernel``: every element ``>= T`` (only chunks whose max is
      ``>= T`` are read again) is appended, packed as the int64
      ``(INT32_MAX - key) << 31 | id`` (ascending == tie rule), to a per-row
      buffer of ``CAP`` entries with an atomic counter;
   d. ``_select_kernel``: rank the candidates by counting
      (``rank_i = #{j: pk_j < pk_i}``, keys are unique) and write the first
      ``K``.  If a row collected more than ``CAP`` candidates (massive ties at
      ``T``, e.g. a uniform row), the same program falls back, on the device,
      to an exact but slow path: bisection of the ``K``-th largest key with
      full-row counts, then everything above it plus its lowest-id ties.  No
      host sync, no data-dependent shapes.

   NaN is not supported (the reference rejects it).  float64 rows (and
   ``method="torch"``) use the previous path: ``torch.topk(x, K + 1)`` gives the
   right *multiset* of values (its choice among equal values is unspecified);
   one program per row then fixes the selection exactly: the ``K+1``-th value
   tells whether the ``K``-th value has ties outside the chosen set (only then
   the row is scanned for the lowest-id tied tokens - a rare, data-dependent
   branch), and the ``K`` chosen entries are ordered by ``(-logprob, token
   id)`` by counting.  ``K == V`` (the worker's candidate rows) needs no
   selection.
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

import os

import triton
import triton.language as tl

from . import contract

#: Largest budget the Triton tree kernel supports (10-bit packed key fields): the contract's bound, which says why.
MAX_TRITON_BUDGET = contract.BUDGET_MAX

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


# ---------------------------------------------------------------------------
# Exact top-K by threshold selection (replaces torch.topk for 16/32-bit floats)
# ---------------------------------------------------------------------------
# Every element gets an int32 *order key*: the float32 bit pattern made
# monotone (signed compare of keys == float compare of values), -0.0 folded
# onto +0.0, and every value below LOGPROB_FLOOR (as float64, -inf included)
# mapped to one key, _KEY_FLOOR == key(-inf): exactly the reference's
# ``float64 -> clamp_min(LOGPROB_FLOOR)`` equivalence classes.  A candidate is
# packed into one int64, ``(INT32_MAX - key) << 31 | token id``, so ascending
# int64 order is the tie rule ``(-logprob, token id)``.
_KEY_FLOOR = tl.constexpr(-2139095041)  # key(-inf) = 0xFF800000 ^ 0x7FFFFFFF as int32
# key(float32(-1e30)) = key(-1.0000000150474662e30), the largest float32 whose
# float64 value is below LOGPROB_FLOOR; keys <= this one are clamped.
_KEY_CLAMP = tl.constexpr(-1900671691)
_PK_PAD = tl.constexpr(0x7FFFFFFFFFFFFFFF)


@triton.jit
def _order_key(xv):
    b = xv.to(tl.float32).to(tl.int32, bitcast=True)
    key = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    key = tl.where(xv == 0, 0, key)  # -0.0 == +0.0
    return tl.where(key <= _KEY_CLAMP, _KEY_FLOOR, key)


@triton.jit
def _chunk_max_kernel(
    x_ptr, cmax_ptr, LC, V, C, sxn, sxl,
    S: tl.constexpr, G: tl.constexpr,
):
    # stage 1: order-key max of each S-long chunk; a program covers G chunks.
    r = tl.program_id(0)
    pg = tl.program_id(1)
    xrow = x_ptr + (r // LC).to(tl.int64) * sxn + (r % LC).to(tl.int64) * sxl
    o = pg * (G * S) + tl.arange(0, G * S)
    xv = tl.load(xrow + o, mask=o < V, other=float("-inf"))
    key = tl.where(o < V, _order_key(xv), -2147483647 - 1)
    cm = tl.max(tl.reshape(key, (G, S)), axis=1)
    c = pg * G + tl.arange(0, G)
    tl.store(cmax_ptr + r.to(tl.int64) * C + c, cm, mask=c < C)


@triton.jit
def _threshold_kernel(cmax_ptr, thr_ptr, cnt_ptr, C, K, CB: tl.constexpr):
    # stage 2: T = K-th largest chunk max (>= K elements are >= T), found by
    # bisection over the int32 keys; when there are fewer than K chunks every
    # element is a candidate (T = INT32_MIN).  Also zeroes the row's counter.
    r = tl.program_id(0)
    c = tl.arange(0, CB)
    cm = tl.load(cmax_ptr + r.to(tl.int64) * C + c, mask=c < C, other=-2147483647 - 1).to(tl.int64)
    lo = tl.min(tl.where(c < C, cm, 2147483647), axis=0)
    hi = tl.max(cm, axis=0)
    while lo < hi:
        mid = lo + (hi - lo + 1) // 2
        if tl.sum((cm >= mid).to(tl.int32), axis=0) >= K:
            lo = mid
        else:
            hi = mid - 1
    t = tl.where(C >= K, lo, -2147483647 - 1).to(tl.int32)
    tl.store(thr_ptr + r, t)
    tl.store(cnt_ptr + r, t * 0)


@triton.jit
def _collect_kernel(
    x_ptr, cmax_ptr, thr_ptr, cnt_ptr, buf_ptr, LC, V, C, sxn, sxl,
    S: tl.constexpr, G: tl.constexpr, CAP: tl.constexpr,
):
    # stage 3: append every element with key >= T to the row's buffer (packed
    # int64); the counter keeps counting past CAP (overflow -> exact fallback).
    r = tl.program_id(0)
    pg = tl.program_id(1)
    t = tl.load(thr_ptr + r)
    c = pg * G + tl.arange(0, G)
    cm = tl.load(cmax_ptr + r.to(tl.int64) * C + c, mask=c < C, other=-2147483647 - 1)
    if tl.max(cm, axis=0) >= t:
        xrow = x_ptr + (r // LC).to(tl.int64) * sxn + (r % LC).to(tl.int64) * sxl
        o = pg * (G * S) + tl.arange(0, G * S)
        live = tl.reshape(tl.broadcast_to((cm >= t)[:, None], (G, S)), (G * S,)) & (o < V)
        xv = tl.load(xrow + o, mask=live, other=float("-inf"))
        key = _order_key(xv)
        sel = live & (key >= t)
        n = tl.sum(sel.to(tl.int32), axis=0)
        base = tl.atomic_add(cnt_ptr + r, n)
        pos = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        pk = ((2147483647 - key.to(tl.int64)) << 31) | o.to(tl.int64)
        tl.store(buf_ptr + r.to(tl.int64) * CAP + pos, pk, mask=sel & (pos < CAP))


@triton.jit
def _row_count_ge(xrow, V, t, SB: tl.constexpr):
    cnt = tl.zeros([1], dtype=tl.int32).sum(axis=0)
    for start in range(0, V, SB):
        o = start + tl.arange(0, SB)
        xv = tl.load(xrow + o, mask=o < V, other=float("-inf"))
        key = _order_key(xv)
        cnt += tl.sum(((o < V) & (key.to(tl.int64) >= t)).to(tl.int32), axis=0)
    return cnt


@triton.jit
def _select_kernel(
    x_ptr, cmax_ptr, thr_ptr, cnt_ptr, buf_ptr, out_v_ptr, out_i_ptr,
    LC, V, C, K, sxn, sxl,
    CAP: tl.constexpr, CB: tl.constexpr, SB: tl.constexpr, IB: tl.constexpr, JB: tl.constexpr,
):
    # stage 4: order the row's candidates by the packed key, emit the first K.
    r = tl.program_id(0)
    cnt = tl.load(cnt_ptr + r)
    bbase = buf_ptr + r.to(tl.int64) * CAP
    if cnt > CAP:
        # Overflow (massive ties at the threshold): exact in-kernel fallback.
        # Bisect the K-th largest key over [T, row max] with full-row counts,
        # then take everything above it plus its lowest-id ties (scan order).
        xrow = x_ptr + (r // LC).to(tl.int64) * sxn + (r % LC).to(tl.int64) * sxl
        c = tl.arange(0, CB)
        hi = tl.max(tl.load(cmax_ptr + r.to(tl.int64) * C + c, mask=c < C, other=-2147483647 - 1), axis=0)
        lo = tl.load(thr_ptr + r)
        lo64 = lo.to(tl.int64)
        hi64 = hi.to(tl.int64)
        while lo64 < hi64:
            mid = lo64 + (hi64 - lo64 + 1) // 2
            if _row_count_ge(xrow, V, mid, SB) >= K:
                lo64 = mid
            else:
                hi64 = mid - 1
        kth = lo64.to(tl.int32)
        n_above = _row_count_ge(xrow, V, lo64 + 1, SB)
        na = n_above * 0
        nt = n_above * 0
        for start in range(0, V, SB):
            o = start + tl.arange(0, SB)
            xv = tl.load(xrow + o, mask=o < V, other=float("-inf"))
            key = _order_key(xv)
            above = (o < V) & (key > kth)
            tie = (o < V) & (key == kth)
            pa = na + tl.cumsum(above.to(tl.int32), axis=0) - 1
            pt = n_above + nt + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            pk = ((2147483647 - key.to(tl.int64)) << 31) | o.to(tl.int64)
            tl.store(bbase + pa, pk, mask=above)
            tl.store(bbase + pt, pk, mask=tie & (pt < K))
            na += tl.sum(above.to(tl.int32), axis=0)
            nt += tl.sum(tie.to(tl.int32), axis=0)
        cnt = cnt * 0 + K
        tl.debug_barrier()
    # rank by counting (packed keys are unique): rank_i = #{j: pk_j < pk_i}
    nc = tl.minimum(cnt, CAP)
    obase = r.to(tl.int64) * K
    for i0 in range(0, nc, IB):
        oi = i0 + tl.arange(0, IB)
        pi = tl.load(bbase + oi, mask=oi < nc, other=_PK_PAD)
        rk = tl.zeros([IB], dtype=tl.int32)
        for j0 in range(0, nc, JB):
            oj = j0 + tl.arange(0, JB)
            pj = tl.load(bbase + oj, mask=oj < nc, other=_PK_PAD)
            rk += tl.sum((pj[None, :] < pi[:, None]).to(tl.int32), axis=1)
        key = (2147483647 - (pi >> 31)).to(tl.int32)
        ids = pi & 0x7FFFFFFF
        bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
        v = bits.to(tl.float32, bitcast=True).to(tl.float64)
        # (tl.full: the float64 constant exactly, not a float32-rounded literal)
        v = tl.where(key == _KEY_FLOOR, tl.full([IB], -1.0e30, tl.float64), v)
        w = (oi < nc) & (rk < K)
        tl.store(out_v_ptr + obase + rk, v, mask=w)
        tl.store(out_i_ptr + obase + rk, ids, mask=w)


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


def _select_params(v: int, k: int):
    """Chunk length ``S`` (power of two, <= 128, halved while there are fewer
    than ``2K`` chunks), chunks per stage-1/3 program ``G`` (2048 elements per
    program), chunk count ``C`` and the per-row candidate buffer ``CAP``."""
    s = 128
    while s > 16 and -(-v // s) < 2 * k:
        s //= 2
    c = -(-v // s)
    cap = min(4096, max(1024, _next_pow2(8 * k)))
    return s, 2048 // s, c, cap


#: ``"select"`` (default): the exact Triton threshold top-K for float32 /
#: bfloat16 / float16 rows; ``"torch"``: the previous ``torch.topk`` + fix-up
#: path (always used for float64).  ``SGLANG_DDTREE_TOPK`` overrides it.
TOPK_METHOD = os.environ.get("SGLANG_DDTREE_TOPK", "select")


def _select_topk(x, k: int, vals, ids):
    """Exact top-``k`` with the tie rule via threshold selection (4 launches,
    static shapes, no host sync; see the module docstring)."""
    import torch

    n, lc, v = x.shape
    r = n * lc
    s, g, c, cap = _select_params(v, k)
    cb = _next_pow2(c)
    dev = x.device
    cmax = torch.empty((r, c), dtype=torch.int32, device=dev)
    thr = torch.empty((r,), dtype=torch.int32, device=dev)
    cnt = torch.empty((r,), dtype=torch.int32, device=dev)
    buf = torch.empty((r, cap), dtype=torch.int64, device=dev)
    grid = (r, triton.cdiv(v, s * g))
    sxn, sxl = x.stride(0), x.stride(1)
    _chunk_max_kernel[grid](x, cmax, lc, v, c, sxn, sxl, S=s, G=g, num_warps=4)
    _threshold_kernel[(r,)](cmax, thr, cnt, c, k, CB=cb, num_warps=4)
    _collect_kernel[grid](x, cmax, thr, cnt, buf, lc, v, c, sxn, sxl, S=s, G=g, CAP=cap, num_warps=4)
    _select_kernel[(r,)](
        x, cmax, thr, cnt, buf, vals, ids, lc, v, c, k, sxn, sxl,
        CAP=cap, CB=cb, SB=2048, IB=64, JB=64, num_warps=4,
    )
    return vals, ids


def rank_topk_triton(x, k: int, method: str = ""):
    """Top-``k`` per row of ``x`` (``[N, Lc, V]``, last dim contiguous) with the
    tie rule; returns ``(vals float64 [N, Lc, k], ids int64 [N, Lc, k])``.
    ``method``: ``"select"`` / ``"torch"`` (default :data:`TOPK_METHOD`)."""
    import torch

    n, lc, v = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not 1 <= k <= min(v, MAX_TRITON_BUDGET):
        raise ValueError(f"k={k} out of range for the Triton ranker (V={v})")
    vals = torch.empty((n, lc, k), dtype=torch.float64, device=x.device)
    ids = torch.empty((n, lc, k), dtype=torch.int64, device=x.device)
    from_topk = k < v
    method = method or TOPK_METHOD
    if method not in ("select", "torch"):
        raise ValueError(f"unknown top-k method {method!r} (select, torch)")
    if from_topk and method == "select" and x.dtype in (torch.float32, torch.bfloat16, torch.float16) \
            and v < 2**31 and -(-v // 16) <= 16384:
        return _select_topk(x, k, vals, ids)
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
