"""The pure core of one DDTree tree-verify decode step (no SGLang import).

Every piece of tensor / index arithmetic that the worker's decode step does
around SGLang's forwards and kernels lives here, so it is tested on CPU
tensors (``tests/plugin/test_step*.py``).  The worker (``worker.py``) only
feeds these functions SGLang's tensors and hands their results back to SGLang.

One step, for ``N`` requests, drafter block width ``blk`` (slot 0 = bonus,
slots ``1..blk-1`` = mask positions, so ``L = blk - 1`` draft depths), tree
budget ``B`` and verify width ``D = B + 1``:

1. drafter forward on ``[bonus, mask * (blk-1)]``; its hidden states at
   positions ``1..L`` go through the target's LM head:
   :func:`draft_topk_candidates` per vocab shard, :func:`merge_vocab_shards`
   across tensor-parallel ranks -> per-depth top-``K`` log-probs and *global*
   token ids (``K = min(B, V)``, ties to the lower token id, exactly the
   builder's rule);
2. :func:`build_tree_from_candidates` - the paper-exact tree over the
   candidates, token ids mapped back to the global vocabulary;
3. ``compile.compile_tree`` -> verify inputs (ids, depth positions, ancestor
   mask, ``retrieve_*``);
4. target verify forward (SGLang), then SGLang's tree accept
   (``verify_tree_greedy`` for greedy, ``tree_speculative_sampling_target_only``
   for sampling).  :func:`tree_accept_greedy_reference` reproduces the greedy
   kernel's outputs ``(predicts, accept_index, accept_token_num)`` and is
   cross-checked against SGLang's own Triton kernel in the tests;
5. :func:`commit_from_accept` turns the kernel outputs into everything the
   step must commit: emitted tokens in DFlash's output shape, commit lengths,
   the next bonus, the permuted KV window (accepted path first), the
   recurrent-state step (deepest accepted node), the mamba-track step mapping
   and the drafter-cache append inputs.

Budget schedule (``contract``'s *Budget schedule*): each step builds the tree
of its own batch size's budget (:func:`step_budget`; ``chain`` is the tree
over each depth's top-1 candidate, ``blk - 1`` nodes, ``D = blk``) and verifies
it at that tree's own width ``B + 1``.  Nothing else of the step depends on
the budget: every function here reads the width off its tensors, the KV
window reserved for the server's largest width holds any smaller one, and the
accept keeps only target-argmax (or target-sampled) tokens, so a request's
output does not depend on which budget a step used
(``tests/plugin/test_schedule.py`` runs it across batch-size switches).

Why each width verifies at its own ``D`` rather than padding a smaller tree to
the server's ``D`` with masked-out nodes: padding is lossless and keeps one
graph width, but verifies the same ``batch * D`` tokens as the largest budget
while proposing fewer, so it can only be slower than not switching.  At its own
width a step verifies ``batch * (B + 1)`` tokens, which is what a smaller budget
saves at high load.  SGLang's graph runner keeps one width for all its graphs
(``captured_req_width``, checked in ``can_run_graph``); on SGLang 0.5.17 the
plugin captures each graph bucket of the target's verify runner at its own
width instead (``adapters/v0_5_17_graph_widths``: the runner's width per
bucket, the hybrid backend's per-width ``query_start_loc`` and tree links), so
a step replays a graph at every width: no more graphs than one width has.  A
step's budget is its graph bucket's entry (the smallest captured batch size
at or above its own, the one SGLang pads it to), so the width a step verifies
and the graph it replays agree.  Without the patch (another SGLang, or
``SGLANG_DDTREE_BUCKET_WIDTHS=0``) the graphs are captured at the server's
``D`` and the steps at another width run the verify forward eagerly.

Tensor parallelism (``tp_size > 1``): every rank builds the same tree and accepts the same path because every
tensor a decision reads is identical on every rank *by construction*, not by hoping that per-rank arithmetic
agrees:

* the tree: each rank ranks only its own vocab shard of the target's LM head (:func:`draft_topk_candidates`);
  :func:`tp_merged_candidates` all-gathers the shards' candidates (an all-gather hands every rank the same
  bytes, whatever each rank's own hidden states were) and :func:`merge_vocab_shards` merges them with a fixed
  rule (stable sort, rank-major order: ties to the lower token id). The builder is deterministic on equal
  inputs (``tree_kernels``: its atomic collect is followed by a rank-by-counting select over unique keys; the
  heap replay is bit-identical to the reference), so the trees are equal bit for bit. A broadcast of rank 0's
  tree would be a second collective per step for what the gather, which the vocab-parallel head needs anyway,
  already guarantees.
* the accept: greedy reads the verify logits, which SGLang's logits processor all-gathers over the vocab
  shards on every rank, so every rank's argmax is the same; sampling draws random coins and may differ at float
  ties between ranks, so rank 0 decides and the others take its result (:func:`follow_rank0`, a broadcast).

``tests/plugin/test_tp_ranks.py`` runs both over two gloo processes whose ranks hold different shards (and
different local noise), and fails if their trees or accepted paths could differ.

KV bookkeeping under SGLang's spec-v2 over-allocation: the scheduler reserves
``req_to_token[prefix : prefix + 2*D]`` for every request before the step, the
verify writes the ``D`` slots ``req_to_token[prefix : prefix + D]`` in slot
order, and only the committed prefix ``kv_committed_len`` counts as sequence.
Keeping "only the accepted path" is therefore a permutation of that window:
the accepted path's locations move to ``prefix .. prefix + a`` (sequence
order) and the rejected ones to the window's tail, where they stay reserved to
the same request and are overwritten by the next step (they are returned to
the allocator with the request's reservation, never leaked, never shared).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from . import contract
from . import tree as _tree
from .indexing import (
    accepted_kv_locs,
    kv_keep_mask,
    map_chain_steps_to_slots,
    recurrent_state_step,
)
from .verify import walk_tree

__all__ = [
    "step_budget",
    "draft_topk_candidates",
    "tree_accept_counts",
    "TreeAcceptStats",
    "merge_vocab_shards",
    "tp_merged_candidates",
    "follow_rank0",
    "build_tree_from_candidates",
    "tree_accept_greedy_reference",
    "accept_slots_from_flat",
    "committed_tokens",
    "window_permutation",
    "committed_window_locs",
    "draft_append_inputs",
    "mamba_track_steps",
    "StepCommit",
    "commit_from_accept",
    "tree_verify_inputs",
    "accept_commit",
    "chain_nodes_of_tree",
    "shadow_tree_accept",
    "ShadowStats",
]


# --------------------------------------------------------------------------
# 0. the step's budget (budget schedule)
# --------------------------------------------------------------------------
def step_budget(budget, batch: int, block: int, vocab: int):
    """``(B, K)`` of the tree a step of ``batch`` requests builds from ``budget`` (one int or a schedule,
    ``contract.budget_for``): ``K = min(B, vocab)`` candidates per depth; ``chain`` is ``(block - 1, 1)``, the
    drafter's top-1 at each of its ``block - 1`` depths (one branch, verified at ``D = block``, as DFLASH
    verifies it). The verify width is ``B + 1`` in both cases."""
    b = contract.budget_for(budget, int(batch))
    if b == contract.CHAIN:
        return int(block) - 1, 1
    return int(b), min(int(b), int(vocab))


# --------------------------------------------------------------------------
# 1. drafter candidates (vocab-parallel safe)
# --------------------------------------------------------------------------
def draft_topk_candidates(logits: torch.Tensor, k: int, vocab_start: int = 0):
    """Top-``k`` of one vocab shard's logits per row.

    ``logits``: ``[R, V_local]`` (the shard's real vocab columns only, padding
    removed).  Returns ``(values [R, k] float32, ids [R, k] int64 global,
    lse [R] float32)``: values sorted descending, equal values ordered by
    ascending token id (stable sort), ids offset by ``vocab_start``; ``lse`` is
    the shard's log-sum-exp.  When the shard has fewer than ``k`` columns the
    rest is padded with ``-inf`` / id ``-1`` (sorts last everywhere)."""
    x = logits.float()
    r, v = x.shape
    lse = torch.logsumexp(x, dim=-1)
    kk = min(k, v)
    vals, idx = torch.sort(x, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :kk], idx[:, :kk] + int(vocab_start)
    if kk < k:
        vals = torch.cat([vals, torch.full((r, k - kk), float("-inf"), device=x.device)], 1)
        idx = torch.cat([idx, torch.full((r, k - kk), -1, dtype=idx.dtype, device=x.device)], 1)
    return vals, idx.to(torch.int64), lse


def merge_vocab_shards(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int):
    """Merge per-rank candidates (``all_gather`` output) into the global top-``k``.

    ``values`` / ``ids``: ``[TP, R, k]`` from :func:`draft_topk_candidates` on
    each rank (rank ``t`` owns a lower vocab range than rank ``t+1``);
    ``lse``: ``[TP, R]``.  Returns ``(logprobs [R, k] float64, ids [R, k])``
    sorted by ``(-logprob, id)``: the global top-``k`` of the full-vocab
    log-softmax with the builder's tie rule (the union of the per-shard top-k
    contains the global top-k; rank-major concatenation keeps equal values in
    ascending id order, and the sort is stable)."""
    tp, r, kk = values.shape
    if tp == 1 and kk == k:
        # One shard: its candidates are already sorted by (-value, id) (draft_topk_candidates' stable sort),
        # so the merge is the identity and the global lse is the shard's (launch-bound step: skip the sort).
        return values[0].double() - lse[0].double().unsqueeze(1), ids[0]
    glse = torch.logsumexp(lse.float(), dim=0)  # [R]
    cat_v = values.permute(1, 0, 2).reshape(r, tp * kk)
    cat_i = ids.permute(1, 0, 2).reshape(r, tp * kk)
    sv, order = torch.sort(cat_v, dim=1, descending=True, stable=True)
    top = order[:, :k]
    lp = torch.gather(cat_v, 1, top).double() - glse.double().unsqueeze(1)
    return lp, torch.gather(cat_i, 1, top)


def tp_merged_candidates(values: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor, k: int, world_size: int,
                         all_gather_into_tensor=None):
    """The global top-``k`` of this rank's shard candidates (:func:`draft_topk_candidates`: ``[R, k]`` values and
    ids, ``[R]`` lse) and every other rank's: ``all_gather_into_tensor(out_flat, in_flat)`` (the TP group's, as
    SGLang's GroupCoordinator names it) gathers them rank-major, then :func:`merge_vocab_shards`. Every rank
    merges the same gathered bytes with the same rule, so every rank gets the same candidates (module
    docstring). ``world_size`` 1: the shard is the vocabulary, nothing is gathered."""
    if world_size > 1:
        gathered = []
        for t in (values, ids, lse):
            g = torch.empty((world_size,) + tuple(t.shape), dtype=t.dtype, device=t.device)
            all_gather_into_tensor(g.view(-1), t.contiguous().view(-1))
            gathered.append(g)
        values, ids, lse = gathered
    else:
        values, ids, lse = values.unsqueeze(0), ids.unsqueeze(0), lse.unsqueeze(0)
    return merge_vocab_shards(values, ids, lse, k)


def follow_rank0(tensors, world_size: int, broadcast) -> None:
    """Make every rank's ``tensors`` rank 0's, in place: ``broadcast(tensor, src=0)`` over the TP group, for the
    results a rank computes from its own random draws (the sampled accept: module docstring)."""
    if world_size > 1:
        for t in tensors:
            broadcast(t, src=0)


def build_tree_from_candidates(
    cand_logprobs: torch.Tensor, cand_ids: torch.Tensor, budget: int, max_depth: Optional[int] = None
) -> "_tree.TreeBatch":
    """The DDTree over per-depth candidates, with global token ids.

    ``cand_logprobs`` / ``cand_ids``: ``[N, L, K]`` sorted by ``(-logprob, id)``
    per depth (:func:`merge_vocab_shards`), ``K >= min(B, V)``.  The builder
    runs on the compressed vocabulary ``0..K-1`` - its stable ranking keeps the
    candidate order, so ranks (and hence the tree) equal those of the dense
    full-vocab build - and the token ids are mapped back through ``cand_ids``.
    Goes through ``sglang_ddtree.tree.build_tree_batched`` by name, so a faster
    builder installed under that name is used."""
    t = _tree.build_tree_batched(cand_logprobs, budget, max_depth)
    n, d = t.token_ids.shape
    dep = (t.depths - 1).clamp_min(0)  # [N, D] 0-based depth index
    kk = cand_ids.shape[-1]
    flat = cand_ids.reshape(n, -1)  # [N, L*K]
    idx = dep * kk + t.token_ids.clamp_min(0)
    mapped = torch.gather(flat, 1, idx)
    has_tok = t.valid & (t.depths > 0)
    tok = torch.where(has_tok, mapped, torch.full_like(mapped, -1))
    return dataclasses.replace(t, token_ids=tok)


# --------------------------------------------------------------------------
# 4. accept (reference of SGLang's greedy tree kernel's output format)
# --------------------------------------------------------------------------
def tree_accept_greedy_reference(
    candidates: torch.Tensor,
    retrieve_index: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_speculative_tokens: int,
):
    """What ``verify_tree_greedy`` writes, as a pure function (host loop; tests).

    ``candidates`` / ``retrieve_*`` / ``target_predict``: ``[N, D]``.  Returns
    ``(predicts [N*D] int32, accept_index [N, M] int32, accept_token_num [N]
    int32)`` with ``M = num_speculative_tokens``: ``accept_index[n, 0]`` is the
    root's flat row, then the accepted nodes' rows; ``predicts[row]`` at each
    accepted row is the next emitted token (the accepted child's token, or the
    bonus at the deepest accepted row); other rows 0."""
    n, d = candidates.shape
    predicts = torch.zeros(n * d, dtype=torch.int32)
    accept = torch.full((n, num_speculative_tokens), -1, dtype=torch.int32)
    num = torch.zeros(n, dtype=torch.int32)
    cand, ri = candidates.tolist(), retrieve_index.tolist()
    nt, ns, tp = retrieve_next_token.tolist(), retrieve_next_sibling.tolist(), target_predict.tolist()
    for b in range(n):
        last = ri[b][0]
        accept[b, 0] = last
        cur = 0
        cnt = 0
        for j in range(1, num_speculative_tokens):
            cur = nt[b][cur]
            want = tp[last // d][last % d]
            while cur != -1:
                if cand[b][cur] == want:
                    predicts[last] = want
                    cnt += 1
                    accept[b, cnt] = ri[b][cur]
                    last = ri[b][cur]
                    break
                cur = ns[b][cur]
            if cur == -1:
                break
        num[b] = cnt
        predicts[last] = tp[last // d][last % d]
    return predicts, accept, num


def accept_slots_from_flat(accept_index: torch.Tensor, accept_token_num: torch.Tensor, d: int):
    """SGLang's ``accept_index`` (flat verify rows ``n*D + slot``, ``-1`` pad) ->
    ``(accept_slots [N, M] int64 local slots, -1 pad; accept_length [N] int64)``
    in the convention of :mod:`sglang_ddtree.indexing`."""
    n, m = accept_index.shape
    ai = accept_index.to(torch.int64)
    length = accept_token_num.to(torch.int64).clamp(min=0, max=m - 1)
    base = torch.arange(n, device=ai.device).unsqueeze(1) * d
    on = (torch.arange(m, device=ai.device).unsqueeze(0) <= length.unsqueeze(1)) & (ai >= 0)
    return torch.where(on, ai - base, torch.full_like(ai, -1)), length


# --------------------------------------------------------------------------
# 5. commit
# --------------------------------------------------------------------------
def committed_tokens(
    predicts: torch.Tensor, accept_index: torch.Tensor, accept_length: torch.Tensor, width: int
):
    """Emitted tokens in DFlash's result shape.

    Returns ``(out_tokens [N, width] int64, commit_lens [N] int32, bonus [N]
    int64)``: row ``n`` holds the ``accept_length[n]`` accepted draft tokens and
    then the bonus, zero-padded (as DFlash's ``_commit_accept``); ``commit_lens
    = accept_length + 1`` (what the scheduler's ``accept_lens`` counts).  The
    scheduler reads ``next_token_ids[n*width : n*width + commit_lens[n]]``."""
    n, m = accept_index.shape
    flat = predicts.reshape(-1).to(torch.int64)
    ar = torch.arange(m, device=accept_index.device).unsqueeze(0)
    on = (ar <= accept_length.unsqueeze(1)) & (accept_index >= 0)
    tok = torch.where(on, flat[accept_index.to(torch.int64).clamp_min(0)], torch.zeros_like(accept_index, dtype=torch.int64))
    if width < m:
        raise ValueError(f"output width {width} < accept_index width {m}")
    out = torch.zeros((n, width), dtype=torch.int64, device=accept_index.device)
    out[:, :m] = tok
    bonus = torch.gather(tok, 1, accept_length.to(torch.int64).unsqueeze(1)).squeeze(1)
    return out, (accept_length + 1).to(torch.int32), bonus


def window_permutation(accept_slots: torch.Tensor, accept_length: torch.Tensor, d: int) -> torch.Tensor:
    """``[N, D]`` permutation of verify slots: the accepted path (root first, in
    sequence order), then every other slot in ascending order.  Column ``k`` is
    the verify slot whose KV location becomes sequence position ``prefix + k``."""
    n, m = accept_slots.shape
    dev = accept_slots.device
    keep = kv_keep_mask(accept_slots, accept_length, d)  # [N, D]
    slot_ids = torch.arange(d, device=dev).expand(n, d)
    # sort key: path slots by their path index (0..a), others after, by slot id
    pos_on_path = torch.full((n, d), 0, dtype=torch.int64, device=dev)
    on = (torch.arange(m, device=dev).unsqueeze(0) <= accept_length.unsqueeze(1)) & (accept_slots >= 0)
    src = torch.where(on, torch.arange(m, device=dev).expand(n, m), torch.zeros_like(accept_slots))
    pos_on_path.scatter_(1, torch.where(on, accept_slots, torch.zeros_like(accept_slots)), src)
    key = torch.where(keep, pos_on_path, d + slot_ids)
    return torch.argsort(key, dim=1, stable=True)


def committed_window_locs(window_locs: torch.Tensor, accept_slots: torch.Tensor, accept_length: torch.Tensor):
    """The verify window's KV locations (``[N, D]``, slot order) rearranged by
    :func:`window_permutation`: write it back to ``req_to_token[req, prefix :
    prefix + D]``.  Positions ``prefix .. prefix + a`` then hold the accepted
    path's KV; the rest of the window keeps the other locations (still reserved
    to the request)."""
    n, d = window_locs.shape
    return torch.gather(window_locs, 1, window_permutation(accept_slots, accept_length, d))


def draft_append_inputs(
    draft_window_ids: torch.Tensor, accept_slots: torch.Tensor, accept_length: torch.Tensor, prefix: torch.Tensor
):
    """Inputs of DFlash's ``_append_target_hidden_to_draft_kv_by_loc`` for the
    accepted path.  ``draft_window_ids``: the verify window's ids in the drafter
    pool's id space, ``[N, D]`` slot order.  Returns ``(rows [N*M] int64 flat
    rows of the verify hidden states, cache_loc_2d [N, M], positions [N*M],
    commit_lens [N] int32)``; entries past the path point at the root's row /
    location (never written: the writer is prefix-valid over ``commit_lens``)."""
    n, m = accept_slots.shape
    d = draft_window_ids.shape[1]
    dev = accept_slots.device
    on = (torch.arange(m, device=dev).unsqueeze(0) <= accept_length.unsqueeze(1)) & (accept_slots >= 0)
    slots = torch.where(on, accept_slots, torch.zeros_like(accept_slots))
    rows = (torch.arange(n, device=dev).unsqueeze(1) * d + slots).reshape(-1)
    loc = torch.gather(draft_window_ids.to(torch.int64), 1, slots)
    pos = (prefix.to(torch.int64).unsqueeze(1) + torch.arange(m, device=dev).unsqueeze(0)).reshape(-1)
    return rows, loc, pos, (accept_length + 1).to(torch.int32)


def mamba_track_steps(
    seq_lens_pre: torch.Tensor,
    seq_lens_post: torch.Tensor,
    commit_lens: torch.Tensor,
    interval: int,
    accept_slots: torch.Tensor,
    accept_length: torch.Tensor,
) -> torch.Tensor:
    """DFlash's ``mamba_steps_to_track`` (the chain step whose state the radix
    cache snapshots when a track boundary is crossed, ``-1`` = none), mapped
    through the accepted path to the verify SLOT that holds that state."""
    to_track = seq_lens_pre // interval != seq_lens_post // interval
    point = seq_lens_post // interval * interval
    ith = torch.clamp(point - seq_lens_pre - 1, min=0).to(torch.int64)
    ith = torch.where(to_track & (ith < commit_lens.to(ith.dtype)), ith, torch.full_like(ith, -1))
    return map_chain_steps_to_slots(ith, accept_slots, accept_length)


@dataclass
class StepCommit:
    accept_slots: torch.Tensor  # int64 [N, M]
    accept_length: torch.Tensor  # int64 [N] accepted draft nodes
    out_tokens: torch.Tensor  # int64 [N, width]
    commit_lens: torch.Tensor  # int32 [N] = accept_length + 1
    bonus: torch.Tensor  # int64 [N] next root
    new_seq_lens: torch.Tensor  # int64 [N] prefix + commit_lens
    window_locs: torch.Tensor  # [N, D] to write to req_to_token[prefix : prefix + D]
    append_rows: torch.Tensor  # int64 [N*M]
    append_cache_loc_2d: torch.Tensor  # [N, M]
    append_positions: torch.Tensor  # int64 [N*M]
    verify_window_locs: torch.Tensor  # [N, D] the verify window's KV locations in slot order (input)
    d: int
    # The recurrent commit's indices, where the accept computed them (accept_commit(recurrent=True)): int32 [N]
    # verify slot whose state is committed, and int32 [N] slot of the tracked state (-1: none; track_interval)
    recurrent_step: Optional[torch.Tensor] = None
    track_steps: Optional[torch.Tensor] = None

    # Derived on first use only: a decode step is launch-bound and the workers read none of these.
    @functools.cached_property
    def state_step(self) -> torch.Tensor:  # [N] verify slot whose recurrent state is committed
        if self.recurrent_step is not None:
            return self.recurrent_step
        return recurrent_state_step(self.accept_slots, self.accept_length)

    @functools.cached_property
    def kept_kv_locs(self) -> torch.Tensor:  # [N, M] accepted path's KV locations (sequence order), -1 pad
        return accepted_kv_locs(self.verify_window_locs, self.accept_slots, self.accept_length)

    @functools.cached_property
    def recycled_kv_mask(self) -> torch.Tensor:  # bool [N*D] window entries not on the path (stay reserved)
        return (~kv_keep_mask(self.accept_slots, self.accept_length, self.d)).reshape(-1)


def commit_from_accept(
    *,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    d: int,
    prefix: torch.Tensor,
    window_locs: torch.Tensor,
    draft_window_ids: torch.Tensor,
    out_width: int,
) -> StepCommit:
    """Everything a tree-verify step commits, from SGLang's tree-accept outputs.

    ``window_locs`` / ``draft_window_ids``: ``[N, D]`` KV locations the verify
    wrote (target pool / drafter pool id space, slot order)."""
    slots, length = accept_slots_from_flat(accept_index, accept_token_num, d)
    out, commit_lens, bonus = committed_tokens(predicts, accept_index, length, out_width)
    rows, loc2d, pos, _ = draft_append_inputs(draft_window_ids, slots, length, prefix)
    return StepCommit(
        accept_slots=slots,
        accept_length=length,
        out_tokens=out,
        commit_lens=commit_lens,
        bonus=bonus,
        new_seq_lens=prefix.to(torch.int64) + commit_lens.to(torch.int64),
        window_locs=committed_window_locs(window_locs, slots, length),
        append_rows=rows,
        append_cache_loc_2d=loc2d,
        append_positions=pos,
        verify_window_locs=window_locs,
        d=int(d),
    )


def tree_verify_inputs(cand_logprobs: torch.Tensor, cand_ids: torch.Tensor, bonus: torch.Tensor,
                       prefix: torch.Tensor, budget: int, topk: int, full_index: bool = False):
    """The tree over the drafter's candidates and its verify inputs with the ``QLEN_ONLY`` mask: the part of a
    compile whose shapes the batch size fixes (the worker's first glue graph; the FULL mask, sized by the prefix
    lengths, is ``compile.with_full_mask`` after it; ``full_index``: with its scatter index computed here).
    Returns ``(tree, VerifyInputs)``."""
    from .compile import QLEN_ONLY, compile_tree

    tree = build_tree_from_candidates(cand_logprobs, cand_ids, budget)
    return tree, compile_tree(tree, bonus, prefix, mask_mode=QLEN_ONLY, topk=topk, full_index=full_index)


def accept_commit(predict: torch.Tensor, accept_index: torch.Tensor, accept_num: torch.Tensor, ranks: torch.Tensor,
                  prefix: torch.Tensor, window_locs: torch.Tensor, draft_window_ids: torch.Tensor, max_depth: int,
                  recurrent: bool = False, track_interval: int = 0):
    """A step's accept counters and its commit from the tree accept's outputs (greedy kernel or sampling alike):
    ``(tree_accept_counts, StepCommit)``; ``ranks`` / ``window_locs`` / ``draft_window_ids``: ``[N, D]``.

    ``recurrent``: also the recurrent commit's indices (``StepCommit.recurrent_step``, and with a
    ``track_interval`` > 0 ``track_steps``: :func:`mamba_track_steps` from ``prefix`` to the new lengths), int32
    as SGLang's scatter kernels read them, so a glue graph replays them instead of ~25 eager launches."""
    d = int(ranks.shape[1])
    counts = tree_accept_counts(ranks, accept_index, accept_num, max_depth)
    c = commit_from_accept(predicts=predict, accept_index=accept_index, accept_token_num=accept_num, d=d,
                           prefix=prefix, window_locs=window_locs, draft_window_ids=draft_window_ids, out_width=d)
    if recurrent:
        c.recurrent_step = recurrent_state_step(c.accept_slots, c.accept_length).to(torch.int32)
        if track_interval > 0:
            c.track_steps = mamba_track_steps(prefix.to(torch.int64), c.new_seq_lens, c.commit_lens,
                                              int(track_interval), c.accept_slots, c.accept_length).to(torch.int32)
    return counts, c


def gather_hidden_for_append(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``hidden[rows]`` (``[N*D, H]`` -> ``[N*M, H]``)."""
    return hidden.index_select(0, rows)


# --------------------------------------------------------------------------
# shadow-linear: what the tree would have accepted
# --------------------------------------------------------------------------
UNKNOWN_TOKEN = -2


def chain_nodes_of_tree(tree, chain_tokens: torch.Tensor) -> torch.Tensor:
    """``[N, D]`` bool: tree slots whose root-to-node path is a prefix of the
    drafted chain.  ``chain_tokens``: ``[N, blk]`` (column 0 = bonus/root,
    column ``i`` = the chain's token at depth ``i``)."""
    n, d = tree.token_ids.shape
    blk = chain_tokens.shape[1]
    dep = tree.depths.clamp(max=blk - 1)
    want = torch.gather(chain_tokens.to(torch.int64), 1, dep)
    match = tree.valid & (tree.token_ids == want) & (tree.depths < blk)
    on = torch.zeros(n, d, dtype=torch.bool, device=tree.token_ids.device)
    on[:, 0] = True
    par = tree.parents.clamp_min(0)
    for _ in range(tree.max_depth):
        on = torch.where(tree.depths > 0, match & torch.gather(on, 1, par), on)
    return on


def shadow_tree_accept(tree, chain_tokens: torch.Tensor, chain_predict: torch.Tensor):
    """What the tree would have accepted, from a CHAIN verify's predictions.

    ``chain_predict``: ``[N, blk]`` the target's token at each chain slot
    (greedy argmax after DFlash's logits adjustments).  The target's prediction
    is known exactly at tree nodes on the chain; the walk uses those and stops
    at an off-chain node (its prediction is unknown).  Returns
    ``(tree_accept [N] int64, exact [N] bool)``: ``tree_accept`` is the number
    of draft nodes the greedy tree walk accepts, exact when the walk ended on
    the chain, else a lower bound (the walk left the chain through an accepted
    off-chain node whose own children were not verified)."""
    on = chain_nodes_of_tree(tree, chain_tokens)
    blk = chain_predict.shape[1]
    dep = tree.depths.clamp(max=blk - 1)
    pred = torch.gather(chain_predict.to(torch.int64), 1, dep)
    pred = torch.where(on, pred, torch.full_like(pred, UNKNOWN_TOKEN))
    w = walk_tree(tree.token_ids, tree.parents, pred, tree.max_depth, tree.valid)
    exact = torch.gather(on, 1, w.last_slot.unsqueeze(1)).squeeze(1)
    return w.accept_length, exact


class ShadowStats:
    """Host-side counters of the shadow-linear comparison (per worker)."""

    def __init__(self) -> None:
        self.steps = 0
        self.requests = 0
        self.chain_accept_tokens = 0  # committed tokens (drafts + bonus)
        self.tree_accept_tokens = 0  # tree would-accept drafts + bonus (lower bound where inexact)
        self.inexact = 0
        self.skipped = 0
        self.skip_reasons: Dict[str, int] = {}

    def update(self, chain_commit_lens: Sequence[int], tree_accept: Sequence[int], exact: Sequence[bool]) -> None:
        self.steps += 1
        self.requests += len(chain_commit_lens)
        self.chain_accept_tokens += int(sum(chain_commit_lens))
        self.tree_accept_tokens += int(sum(int(t) + 1 for t in tree_accept))
        self.inexact += int(sum(1 for e in exact if not e))

    def add_totals(self, steps: int, requests: int, chain_tokens: int, tree_tokens: int, inexact: int) -> None:
        """Fold device-side running sums in (one host sync per logging interval)."""
        self.steps += int(steps)
        self.requests += int(requests)
        self.chain_accept_tokens += int(chain_tokens)
        self.tree_accept_tokens += int(tree_tokens)
        self.inexact += int(inexact)

    def skip(self, reason: str, requests: int = 1) -> None:
        self.skipped += requests
        self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + requests

    def summary(self) -> Dict[str, float]:
        r = max(self.requests, 1)
        return {
            "steps": self.steps,
            "requests": self.requests,
            "chain_accept_length": self.chain_accept_tokens / r,
            "tree_would_accept_length": self.tree_accept_tokens / r,
            "tree_inexact_share": self.inexact / r,
            "skipped_requests": self.skipped,
            "skip_reasons": dict(self.skip_reasons),
        }


# --------------------------------------------------------------------------
# tree-verify accept counters (is the tree doing more than a chain would?)
# --------------------------------------------------------------------------
def tree_accept_counts(ranks: torch.Tensor, accept_index: torch.Tensor, accept_num: torch.Tensor,
                       max_depth: int) -> torch.Tensor:
    """One step's counters, on the device, no host sync (scatter, not bincount):
    ``[steps=1, requests, accepted, own_rank_gt0, off_first_branch, hist[0..max_depth]]``.

    ``ranks``: the tree's ``[N, D]`` per-depth candidate rank of each slot's token (0 = the drafter's top-1
    at that depth, what a chain would have drafted); ``accept_index``: ``[N, M]`` flat verify rows
    (``n * D + slot``) of the root then the accepted nodes, root to deepest, ``-1`` padded;
    ``accept_num``: ``[N]`` accepted draft nodes.  ``own_rank_gt0``: accepted tokens whose own rank is
    > 0; ``off_first_branch``: accepted tokens at or below such a node (a chain drafter could have
    accepted none of them); ``hist[k]``: requests that accepted ``k`` draft tokens this step."""
    n, d = ranks.shape
    acc = accept_index[:, 1:].to(torch.int64)
    ok = acc >= 0
    slot = torch.where(ok, acc.remainder(d), torch.zeros_like(acc))
    r = torch.gather(ranks.to(torch.int64), 1, slot)
    own = ok & (r > 0)
    off = (torch.cummax(own.to(torch.int64), dim=1).values > 0) & ok
    hist = torch.zeros(max_depth + 1, dtype=torch.int64, device=ranks.device)
    hist.scatter_add_(0, accept_num.to(torch.int64).clamp(0, max_depth), torch.ones(n, dtype=torch.int64,
                                                                                      device=ranks.device))
    head = torch.stack([torch.ones((), dtype=torch.int64, device=ranks.device),
                        torch.full((), n, dtype=torch.int64, device=ranks.device),
                        ok.sum(), own.sum(), off.sum()])
    return torch.cat([head, hist])


class TreeAcceptStats:
    """Running tree-verify accept counters: summed on the device every step, read back (one host sync)
    every ``every`` steps, when the worker logs them as one ``DDTREE accept stats {json}`` line."""

    def __init__(self, max_depth: int, every: int = 50) -> None:
        self.max_depth, self.every = int(max_depth), max(1, int(every))
        self._sum: Optional[torch.Tensor] = None
        self._pending = 0
        self.totals = {"steps": 0, "requests": 0, "accepted": 0, "own_rank_gt0": 0, "off_first_branch": 0,
                       "depth_hist": [0] * (self.max_depth + 1)}

    def add(self, counts: torch.Tensor) -> Optional[Dict]:
        """Fold one step's :func:`tree_accept_counts` in; returns the totals when it is time to log."""
        # a copy: ``counts`` may live in a glue graph's buffer, which the next replay overwrites
        self._sum = counts.clone() if self._sum is None else self._sum + counts
        self._pending += 1
        if self._pending < self.every:
            return None
        return self.flush()

    def flush(self) -> Dict:
        if self._sum is not None:
            v = self._sum.tolist()
            for k, x in zip(("steps", "requests", "accepted", "own_rank_gt0", "off_first_branch"), v[:5]):
                self.totals[k] += int(x)
            self.totals["depth_hist"] = [a + int(b) for a, b in zip(self.totals["depth_hist"], v[5:])]
        self._sum, self._pending = None, 0
        t = dict(self.totals)
        req = max(t["requests"], 1)
        t["accept_length"] = round(1 + t["accepted"] / req, 4)  # drafts + the bonus token, per request-step
        t["off_first_branch_share"] = round(t["off_first_branch"] / max(t["accepted"], 1), 4)
        return t
