"""DDTree draft-tree construction (paper-exact, best-first under a node budget).

Vocabulary used throughout this package
---------------------------------------
* The drafter (a block-diffusion drafter such as DFlash) emits, in one forward
  pass, a distribution for each of ``L`` future positions.  ``draft_logprobs``
  holds their **log-probabilities** (``log_softmax`` output, every value <= 0):
  shape ``[L, V]`` for one request or ``[N, L, V]`` for a batch.  Row ``i``
  (0-based) is the distribution of the token at tree depth ``i + 1``.
* The tree root (depth 0, slot 0) is the *bonus* token: the token the target
  model already committed in the previous verify step.  The builder does not
  know it; :mod:`sglang_ddtree.compile` writes it into slot 0.
* ``B`` (``budget``) is the number of non-root nodes.  A tree therefore has
  ``D = B + 1`` slots; slot ``s`` in ``1..B`` is the ``s``-th node popped by the
  best-first search.  This slot order is the order of SGLang's verify tokens
  ``[bonus, nodes...]``.

The algorithm (DDTree paper, "best-first heap")
-----------------------------------------------
For each depth ``d`` take the top ``K = min(B, V)`` tokens of ``q_d`` sorted by
log-prob (rank 0 = most likely).  A node is a rank tuple ``(r_1, .., r_d)``;
its score is the cumulative draft log-prob
``score = (..((lp_1[r_1] + lp_2[r_2]) + lp_3[r_3]) ..)`` accumulated in float64
in exactly that order (parent score + own log-prob).  Start with the first
child of the root on a max-heap, then pop ``B`` times; every popped node gets
the next slot and pushes its *next sibling* (same parent, rank + 1, if
``rank + 1 < K``) and its *first child* (depth + 1, rank 0, if depth + 1 <=
max_depth).  Since log-probs are sorted and <= 0, both pushes score no better
than the popped node, so the pops enumerate all prefixes in best-first order
and the ``B`` popped nodes are exactly the ``B`` best prefixes.  No heuristics
(depth bonus, per-level caps, early stop) are applied; there are none in this
module.

Tie rule (deterministic, documented, shared by every builder here)
------------------------------------------------------------------
Nodes are totally ordered by the key ``(-score, depth, ranks)``:

1. higher cumulative score first;
2. on equal score, the shallower node first;
3. on equal score and depth, the lexicographically smaller rank tuple first,
   where the rank at each depth comes from a *stable* descending sort of that
   depth's log-probs, i.e. equal log-probs rank by ascending token id.

Log-probs are clamped from below at :data:`LOGPROB_FLOOR` (so ``-inf`` tokens
stay finite and tie among themselves under the rule above); NaN is rejected by
the reference builder.  Under this order a parent always precedes its children
and a node precedes its next sibling, so the result is prefix-closed, every
parent slot is smaller than its child's slot, and siblings occupy ascending
slots in rank order.

Builders
--------
* :func:`build_tree_reference` - one request, Python ``heapq`` on the CPU (the
  paper's reference formulation).
* :func:`build_tree_batched` - a batch of requests, on the tensors' device,
  no host synchronisation, CUDA-graph capturable.  ``backend="auto"`` (the
  default) uses :func:`build_tree_triton` for CUDA tensors when Triton is
  importable and ``B <= 511``, else :func:`build_tree_torch`.
* :func:`build_tree_triton` - Triton only: an exact tie-rule top-``K``
  (threshold select, four launches, no ``torch.topk``, for 16/32-bit rows)
  and a one-warp-per-request kernel that replays the heap's pops exactly (see
  :mod:`sglang_ddtree.tree_kernels`).  Identical output to the reference.
* :func:`build_tree_torch` - torch tensor ops only (runs on CUDA or CPU
  tensors, static shapes).  It runs a per-depth beam of width ``B``
  (``O(max_depth)`` kernel launches instead of ``O(B)`` heap pops): the ``B``
  best nodes of each depth are the ``B`` best children of the previous depth's
  beam, and the global top ``B`` is contained in the union of the beams.  It
  returns the identical tree (same slots, parents, tokens and float64 scores)
  as the heap.
* :func:`build_tree_brute_force` - enumerates every prefix over the full
  vocabulary; for tests on tiny vocabularies/depths only.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from . import contract

__all__ = [
    "LOGPROB_FLOOR",
    "DraftTree",
    "TreeBatch",
    "rank_draft_tokens",
    "build_tree_reference",
    "build_tree_batched",
    "build_tree_torch",
    "build_tree_triton",
    "triton_available",
    "build_tree_brute_force",
    "child_sibling_links",
]

#: Log-probs below this value (including ``-inf``) are clamped to it, so scores
#: stay finite and "no node" can be represented by ``-inf`` unambiguously.
LOGPROB_FLOOR = -1.0e30


@dataclass(frozen=True)
class DraftTree:
    """One request's tree as plain Python lists, indexed by slot (0 = root).

    ``tokens[0]`` is ``-1`` (the bonus token is not known to the builder),
    ``parents[0] == -1``, ``depths[0] == 0``, ``scores[0] == 0.0``.  Slots
    ``1..num_nodes`` are the popped nodes in best-first order.  ``num_nodes`` is
    ``B`` unless the search space (``sum_d K**d`` over the allowed depths) has
    fewer than ``B`` prefixes.
    """

    tokens: List[int]
    parents: List[int]
    depths: List[int]
    scores: List[float]
    ranks: List[int]

    @property
    def num_nodes(self) -> int:
        return len(self.tokens) - 1

    def path(self, slot: int) -> List[int]:
        """Slots from the root's first descendant down to ``slot`` (root excluded)."""
        out = []
        while slot > 0:
            out.append(slot)
            slot = self.parents[slot]
        return out[::-1]

    def prefix_tokens(self, slot: int) -> tuple:
        return tuple(self.tokens[s] for s in self.path(slot))


@dataclass
class TreeBatch:
    """A batch of trees as tensors of shape ``[N, D]`` with ``D = B + 1``.

    Slot 0 is the root of every tree.  For a slot that holds no node (only when
    the search space is smaller than ``B``) ``valid`` is False, ``token_ids``
    and ``parents`` are ``-1``, ``depths`` is 0 and ``scores`` is ``-inf``.

    ``first_child[n, s]`` / ``next_sibling[n, s]`` are slot indices or ``-1``;
    they follow the same conventions as SGLang's ``retrieve_next_token`` /
    ``retrieve_next_sibling`` (local, not batch-flattened, indices).
    """

    token_ids: torch.Tensor  # int64 [N, D]; slot 0 = -1 (bonus filled later)
    parents: torch.Tensor  # int64 [N, D]; slot 0 = -1
    depths: torch.Tensor  # int64 [N, D]; slot 0 = 0
    scores: torch.Tensor  # float64 [N, D]; slot 0 = 0.0
    ranks: torch.Tensor  # int64 [N, D]; rank of the token at its depth, -1 at root
    valid: torch.Tensor  # bool [N, D]; slot 0 True
    first_child: torch.Tensor  # int64 [N, D]
    next_sibling: torch.Tensor  # int64 [N, D]
    budget: int
    max_depth: int

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_slots(self) -> int:
        return self.token_ids.shape[1]

    def unbind(self) -> List[DraftTree]:
        """Per-request :class:`DraftTree` (copies to the host; for tests/debug)."""
        out = []
        cols = [
            t.detach().cpu().tolist()
            for t in (self.token_ids, self.parents, self.depths, self.scores, self.ranks, self.valid)
        ]
        for tok, par, dep, sc, rk, va in zip(*cols):
            n = sum(va)
            out.append(DraftTree(tok[:n], par[:n], dep[:n], sc[:n], rk[:n]))
        return out


def _as_batched(draft_logprobs: torch.Tensor) -> torch.Tensor:
    if not isinstance(draft_logprobs, torch.Tensor):
        draft_logprobs = torch.as_tensor(draft_logprobs)
    if draft_logprobs.dim() == 2:
        draft_logprobs = draft_logprobs.unsqueeze(0)
    if draft_logprobs.dim() != 3:
        raise ValueError(
            f"draft_logprobs must be [L, V] or [N, L, V], got shape {tuple(draft_logprobs.shape)}"
        )
    if not draft_logprobs.is_floating_point():
        raise ValueError("draft_logprobs must be a floating-point tensor of log-probabilities")
    return draft_logprobs


def _resolve_depth(num_positions: int, budget: int, max_depth: Optional[int]) -> int:
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    depth = num_positions if max_depth is None else min(int(max_depth), num_positions)
    if depth < 1:
        raise ValueError(f"need at least one draft position (max_depth={max_depth}, L={num_positions})")
    return min(depth, budget)


_TRITON = None


def triton_available() -> bool:
    """Whether :mod:`sglang_ddtree.tree_kernels` (Triton) can be imported."""
    global _TRITON
    if _TRITON is None:
        try:
            from . import tree_kernels  # noqa: F401

            _TRITON = True
        except Exception:  # pragma: no cover - depends on the install
            _TRITON = False
    return _TRITON


def _use_triton(t: torch.Tensor, k: int) -> bool:
    return t.is_cuda and contract.BUDGET_MIN <= k <= contract.BUDGET_MAX and triton_available()  # the kernel's bound


def rank_draft_tokens(draft_logprobs: torch.Tensor, k: int):
    """Top-``k`` tokens per position with the documented tie rule, on device.

    ``draft_logprobs``: ``[..., V]`` float.  Returns ``(values, token_ids)`` of
    shape ``[..., k]``: ``values`` in float64, clamped at :data:`LOGPROB_FLOOR`,
    sorted descending; equal values (including at the top-``k`` boundary) are
    resolved in favour of the lower token id.  No host sync.  On CUDA (with
    Triton, ``k <= 511``) :func:`~sglang_ddtree.tree_kernels.rank_topk_triton`
    (Triton threshold top-K); otherwise torch ops
    (:func:`_rank_draft_tokens_torch`).  Both give identical results.
    """
    v = draft_logprobs.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, V={v}], got {k}")
    if isinstance(draft_logprobs, torch.Tensor) and _use_triton(draft_logprobs, k) \
            and draft_logprobs.is_floating_point():
        from .tree_kernels import rank_topk_triton

        lead = draft_logprobs.shape[:-1]
        vals, ids = rank_topk_triton(draft_logprobs.reshape(-1, 1, v), k)
        return vals.view(*lead, k), ids.view(*lead, k)
    return _rank_draft_tokens_torch(draft_logprobs, k)


def _rank_draft_tokens_torch(draft_logprobs: torch.Tensor, k: int):
    """Torch-only :func:`rank_draft_tokens` (any device)."""
    lp = draft_logprobs.to(torch.float64).clamp_min(LOGPROB_FLOOR)
    v = lp.shape[-1]
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, V={v}], got {k}")
    # The k-th largest value is well defined even when topk's choice among ties
    # is not; select exactly: everything above it, then the lowest-id ties.
    kth = torch.topk(lp, k, dim=-1, sorted=True).values[..., k - 1 : k]
    above = lp > kth
    tied = lp == kth
    n_above = above.sum(dim=-1, keepdim=True)
    take_tied = tied & (torch.cumsum(tied.to(torch.int32), dim=-1) <= (k - n_above))
    chosen = (above | take_tied).to(torch.int32)  # exactly k ones per row
    ids = torch.topk(chosen, k, dim=-1, sorted=False).indices
    ids, _ = torch.sort(ids, dim=-1)  # ascending token id ...
    vals = torch.gather(lp, -1, ids)
    vals, order = torch.sort(vals, dim=-1, descending=True, stable=True)  # ... kept among ties
    ids = torch.gather(ids, -1, order)
    return vals, ids


def build_tree_reference(
    draft_logprobs: torch.Tensor, budget: int, max_depth: Optional[int] = None
) -> DraftTree:
    """Paper-exact best-first tree for ONE request, with Python ``heapq``.

    ``draft_logprobs``: ``[L, V]`` (or ``[1, L, V]``) log-probs, any device.
    ``budget``: ``B``, the number of non-root nodes.  ``max_depth``: optional
    cap on tree depth (default ``L``; never more than ``B``).
    """
    lp = _as_batched(draft_logprobs)
    if lp.shape[0] != 1:
        raise ValueError("build_tree_reference takes one request; use build_tree_batched")
    lp = lp[0]
    if torch.isnan(lp).any():
        raise ValueError("draft_logprobs contains NaN")
    if (lp > 0).any():
        raise ValueError("draft_logprobs must be log-probabilities (<= 0), not logits")
    depth_cap = _resolve_depth(lp.shape[0], budget, max_depth)
    k = min(budget, lp.shape[-1])
    vals_t, ids_t = rank_draft_tokens(lp[:depth_cap], k)
    vals = vals_t.cpu().tolist()
    ids = ids_t.cpu().tolist()

    tokens, parents, depths, scores, ranks = [-1], [-1], [0], [0.0], [-1]
    # entry: (-score, depth, rank tuple, parent slot, parent score, rank)
    heap = [(-vals[0][0], 1, (0,), 0, 0.0, 0)]
    while heap and len(tokens) <= budget:
        neg, d, rt, pslot, pscore, r = heapq.heappop(heap)
        score = -neg
        slot = len(tokens)
        tokens.append(ids[d - 1][r])
        parents.append(pslot)
        depths.append(d)
        scores.append(score)
        ranks.append(r)
        if r + 1 < k:  # next sibling
            s = pscore + vals[d - 1][r + 1]
            heapq.heappush(heap, (-s, d, rt[:-1] + (r + 1,), pslot, pscore, r + 1))
        if d < depth_cap:  # first child
            s = score + vals[d][0]
            heapq.heappush(heap, (-s, d + 1, rt + (0,), slot, score, 0))
    return DraftTree(tokens, parents, depths, scores, ranks)


def build_tree_brute_force(
    draft_logprobs: torch.Tensor, budget: int, max_depth: Optional[int] = None
) -> DraftTree:
    """Enumerate every prefix over the FULL vocabulary, sort by the tie rule and
    keep the best ``B``.  Exponential: tests only (``V ** depth`` small)."""
    lp = _as_batched(draft_logprobs)[0].to(torch.float64).clamp_min(LOGPROB_FLOOR)
    depth_cap = _resolve_depth(lp.shape[0], budget, max_depth)
    table = lp.cpu().tolist()
    v = lp.shape[-1]
    entries = []
    for d in range(1, depth_cap + 1):
        for seq in itertools.product(range(v), repeat=d):
            s = 0.0
            for i, t in enumerate(seq):
                s = s + table[i][t]
            lex = tuple((-table[i][t], t) for i, t in enumerate(seq))
            entries.append((-s, d, lex, seq, s))
    entries.sort(key=lambda e: e[:3])
    chosen = entries[:budget]
    slot_of = {(): 0}
    tokens, parents, depths, scores, ranks = [-1], [-1], [0], [0.0], [-1]
    order = [sorted(range(v), key=lambda t, i=i: (-table[i][t], t)) for i in range(depth_cap)]
    for _, d, _, seq, s in chosen:
        slot_of[seq] = len(tokens)
        tokens.append(seq[-1])
        parents.append(slot_of[seq[:-1]])  # KeyError here would mean "not prefix-closed"
        depths.append(d)
        scores.append(s)
        ranks.append(order[d - 1].index(seq[-1]))
    return DraftTree(tokens, parents, depths, scores, ranks)


def child_sibling_links(parents: torch.Tensor):
    """First-child and next-sibling slot arrays from a ``[N, D]`` parent array.

    ``first_child[n, p]`` = smallest slot whose parent is ``p`` (else -1);
    ``next_sibling[n, s]`` = smallest slot ``> s`` with the same parent (else
    -1, and -1 for the root / slots with parent -1).  Pure tensor ops.
    """
    n, dsz = parents.shape
    dev = parents.device
    ar = torch.arange(dsz, device=dev, dtype=torch.int64).expand(n, dsz)
    has_parent = parents >= 0
    idx = torch.where(has_parent, parents, torch.full_like(parents, dsz))  # dump slot
    fc = torch.full((n, dsz + 1), dsz, device=dev, dtype=torch.int64)
    fc.scatter_reduce_(1, idx, ar, reduce="amin", include_self=True)
    first_child = fc[:, :dsz]
    first_child = torch.where(first_child >= dsz, torch.full_like(first_child, -1), first_child)
    # Stable sort by parent keeps ascending slot order within a sibling group.
    key = torch.where(has_parent, parents, torch.full_like(parents, -1))
    sp, perm = torch.sort(key, dim=1, stable=True)
    nxt_same = torch.zeros_like(sp, dtype=torch.bool)
    nxt_same[:, :-1] = (sp[:, 1:] == sp[:, :-1]) & (sp[:, :-1] >= 0)
    nxt = torch.full_like(perm, -1)
    nxt[:, :-1] = perm[:, 1:]
    nxt = torch.where(nxt_same, nxt, torch.full_like(nxt, -1))
    next_sibling = torch.full_like(parents, -1)
    next_sibling.scatter_(1, perm, nxt)
    return first_child, next_sibling


def build_tree_batched(
    draft_logprobs: torch.Tensor, budget: int, max_depth: Optional[int] = None, backend: str = "auto"
) -> TreeBatch:
    """DDTree for a batch of requests, identical to :func:`build_tree_reference`.

    ``draft_logprobs``: ``[N, L, V]`` (or ``[L, V]``) log-probs on any device;
    all work stays on that device with no host sync (CUDA-graph capturable).
    Returns a :class:`TreeBatch` with ``D = budget + 1`` slots per request.
    ``backend``: ``"auto"`` (Triton on CUDA when available and ``B <= 511``,
    else torch), ``"triton"`` or ``"torch"``.
    """
    if backend == "auto":
        t = draft_logprobs if isinstance(draft_logprobs, torch.Tensor) else None
        backend = "triton" if t is not None and _use_triton(t, int(budget)) else "torch"
    if backend == "triton":
        return build_tree_triton(draft_logprobs, budget, max_depth)
    if backend == "torch":
        return build_tree_torch(draft_logprobs, budget, max_depth)
    raise ValueError(f"unknown backend {backend!r} (auto, triton, torch)")


def build_tree_triton(
    draft_logprobs: torch.Tensor, budget: int, max_depth: Optional[int] = None
) -> TreeBatch:
    """:func:`build_tree_batched` with the Triton kernels (``B <= 511``).

    CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1`` (tests).  The
    ranking (four launches when ``K < V``, one when ``K == V``) and one tree
    launch; see :mod:`sglang_ddtree.tree_kernels`."""
    from .tree_kernels import rank_topk_triton, tree_from_ranked_triton

    lp = _as_batched(draft_logprobs)
    n, num_pos, v = lp.shape
    depth_cap = _resolve_depth(num_pos, budget, max_depth)
    b = int(budget)
    k = min(b, v)
    vals, ids = rank_topk_triton(lp[:, :depth_cap], k)
    ints, scores, valid = tree_from_ranked_triton(vals, ids, b)
    return TreeBatch(
        token_ids=ints[0],
        parents=ints[1],
        depths=ints[2],
        scores=scores,
        ranks=ints[3],
        valid=valid,
        first_child=ints[4],
        next_sibling=ints[5],
        budget=b,
        max_depth=depth_cap,
    )


def build_tree_torch(
    draft_logprobs: torch.Tensor, budget: int, max_depth: Optional[int] = None
) -> TreeBatch:
    """:func:`build_tree_batched` with torch ops only (any device)."""
    lp = _as_batched(draft_logprobs)
    n, num_pos, v = lp.shape
    depth_cap = _resolve_depth(num_pos, budget, max_depth)
    b = budget
    k = min(b, v)
    dev = lp.device
    vals, ids = _rank_draft_tokens_torch(lp[:, :depth_cap], k)  # [N, Lc, K]

    # Beam at depth d-1, kept in lexicographic (rank-tuple) order.  Depth 0: root.
    beam_score = torch.full((n, b), float("-inf"), dtype=torch.float64, device=dev)
    beam_score[:, 0] = 0.0
    all_scores, all_parent, all_rank, all_tok = [], [], [], []
    r_of_cand = torch.arange(b * k, device=dev) % k  # [B*K]
    p_of_cand = torch.arange(b * k, device=dev) // k
    for d in range(depth_cap):
        # Candidate c = p*K + r, in lexicographic order of (parent, rank).
        # A -inf (empty) beam entry yields -inf children (log-probs are finite).
        cand = (beam_score.unsqueeze(-1) + vals[:, d, :].unsqueeze(1)).reshape(n, b * k)
        _, order = torch.sort(cand, dim=1, descending=True, stable=True)
        sel, _ = torch.sort(order[:, :b], dim=1)  # back to lexicographic order
        beam_score = torch.gather(cand, 1, sel)
        rank = r_of_cand[sel]
        all_scores.append(beam_score)
        all_parent.append(p_of_cand[sel])
        all_rank.append(rank)
        all_tok.append(torch.gather(ids[:, d, :], 1, rank))

    # Global order: (-score, depth, lex) == stable sort of the depth-major,
    # lex-ordered concatenation by score.
    cat_score = torch.cat(all_scores, dim=1)  # [N, Lc*B]
    _, gorder = torch.sort(cat_score, dim=1, descending=True, stable=True)
    top = gorder[:, :b]  # [N, B], best-first
    slot_vals = torch.arange(1, b + 1, device=dev, dtype=torch.int64).expand(n, b)
    slot_of = torch.full((n, depth_cap * b), -1, dtype=torch.int64, device=dev)
    slot_of.scatter_(1, top, slot_vals)

    depth_of = torch.arange(depth_cap * b, device=dev) // b  # 0-based depth index
    cat_parent = torch.cat(all_parent, dim=1)  # beam position at previous depth
    parent_global = (depth_of - 1).clamp_min(0) * b + cat_parent
    parent_slot = torch.where(
        depth_of == 0, torch.zeros_like(cat_parent), torch.gather(slot_of, 1, parent_global)
    )
    node_score = torch.gather(cat_score, 1, top)
    node_valid = ~torch.isneginf(node_score)
    minus1 = torch.full((n, b), -1, dtype=torch.int64, device=dev)
    node_parent = torch.where(node_valid, torch.gather(parent_slot, 1, top), minus1)
    node_tok = torch.where(node_valid, torch.gather(torch.cat(all_tok, 1), 1, top), minus1)
    node_rank = torch.where(node_valid, torch.gather(torch.cat(all_rank, 1), 1, top), minus1)
    node_depth = torch.where(node_valid, depth_of[top] + 1, torch.zeros_like(top))

    col0_i = torch.full((n, 1), -1, dtype=torch.int64, device=dev)
    parents = torch.cat([col0_i, node_parent], 1)
    first_child, next_sibling = child_sibling_links(parents)
    return TreeBatch(
        token_ids=torch.cat([col0_i, node_tok], 1),
        parents=parents,
        depths=torch.cat([torch.zeros_like(col0_i), node_depth], 1),
        scores=torch.cat([torch.zeros((n, 1), dtype=torch.float64, device=dev), node_score], 1),
        ranks=torch.cat([col0_i, node_rank], 1),
        valid=torch.cat([torch.ones((n, 1), dtype=torch.bool, device=dev), node_valid], 1),
        first_child=first_child,
        next_sibling=next_sibling,
        budget=b,
        max_depth=depth_cap,
    )


def stack_reference(trees: Sequence[DraftTree], budget: int) -> dict:
    """Pad reference trees to ``[N, B+1]`` lists (helper for comparisons)."""
    out = {"token_ids": [], "parents": [], "depths": [], "scores": []}
    for t in trees:
        pad = contract.tree_width(budget) - len(t.tokens)
        out["token_ids"].append(t.tokens + [-1] * pad)
        out["parents"].append(t.parents + [-1] * pad)
        out["depths"].append(t.depths + [0] * pad)
        out["scores"].append(t.scores + [float("-inf")] * pad)
    return out
