"""What every adapter's DDTree worker does the same way, whatever the SGLang release (no SGLang import).

The version adapters (``v0_5_17_worker``, ``v0_5_23_worker``) keep what differs between releases: how the
drafter forward and the verify forward are built, how the recurrent state is committed, the kernels' import
paths and the result's fields. Everything else lives here once:

* :class:`TreeWorkerMixin` - put first in the worker's bases: the CUDA-graph check after SGLang built its
  graphs, no draft sampler folded into the draft graph, the in-batch guard behind admission;
* :func:`drafter_block` - the drafter's own block width, checked against the ``2*D`` KV reservation;
* :func:`draft_candidates` - per-depth global top-K of the target LM head (vocab-parallel safe);
* :func:`sample_accept` - lossless target-only tree sampling through SGLang's kernel in bounded groups;
* :func:`commit_window` and :func:`append_accepted` - the accepted path becomes the sequence (the KV window
  permutation) and the drafter's context (its KV).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from ..admission import tree_verify_rejection
from ..compile import FULL_MASK, compile_tree
from ..config import TREE_VERIFY
from ..step import StepCommit, build_tree_from_candidates, draft_topk_candidates, merge_vocab_shards
from ..tree_sampling import sample_tree_accept

logger = logging.getLogger(__name__)

__all__ = ["TreeWorkerMixin", "drafter_block", "draft_candidates", "step_tree", "verify_host_bound",
           "accept_buffers", "greedy_accept", "sample_accept", "commit_window", "append_accepted"]


class TreeWorkerMixin:
    """Methods both DDTree workers override on their release's ``DFlashWorkerV2`` (first in the bases)."""

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        # Checked here, after SGLang built (or skipped) its graphs: the target's decode graph is captured with
        # custom_mask=None / topk=1 and would run the tree causally.
        if self.ddtree.mode == TREE_VERIFY and getattr(self.model_runner, "decode_cuda_graph_runner", None):
            raise RuntimeError(
                "DDTREE tree-verify found a target decode CUDA graph (captured causal, topk=1); "
                "run with --cuda-graph-backend-decode disabled."
            )

    def _maybe_build_draft_sampler(self):
        # DDTREE needs the drafter's hidden states (per-position distributions), not the greedy ids a sampler
        # folded into the draft graph would produce.
        return None

    def _unsupported_in_batch(self, batch) -> None:
        """Admission rejects these; if one reached a batch through a path admission does not see, it is
        served with its plain sampling parameters and logged once - raising here would stop the scheduler
        loop for every request."""
        if getattr(self, "_warned_unsupported", False):
            return
        for req in batch.reqs:
            why = tree_verify_rejection(req)
            if why:
                self._warned_unsupported = True
                logger.error("DDTREE: a request reached tree-verify unchecked (%s); serving it without those "
                             "features.", why)
                return


def drafter_block(d: int, *widths: Optional[int]) -> int:
    """The drafter's block width: the first of ``widths`` that is set (the flag, the drafter's config, the
    loaded draft model), which must fit the ``2*D`` KV slots the scheduler reserves per request and step."""
    blk = next((int(w) for w in widths if w is not None), None)
    if blk is None:
        raise ValueError("DDTREE tree-verify needs the drafter's block width: set --speculative-dflash-block-size "
                         "or use a drafter whose config declares block_size.")
    if not 2 <= blk <= 2 * d:
        raise ValueError(f"DDTREE drafter block {blk} must be in [2, 2*D = {2 * d}]: the scheduler reserves 2*D KV "
                         "slots per request and step and the drafter writes its whole block there.")
    return blk


def draft_candidates(hidden_states: torch.Tensor, lm_head, k: int, vocab_size: int, tp_group,
                     chunk: int = 256):
    """Global-vocab top-``k`` log-probs / ids of the target LM head on the drafter's hidden states ``[R, H]``
    -> ``([R, k] float64, [R, k] int64)``. ``lm_head.weight`` must be dense (the adapter checks); with
    ``shard_indices`` each tensor-parallel rank ranks its own vocab shard and ``tp_group`` gathers them."""
    weight = lm_head.weight
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:
        start, num_org = 0, min(int(weight.shape[0]), vocab_size)
    else:
        if int(shard.num_added_elements) != 0:
            raise NotImplementedError("DDTREE does not support LoRA-added vocabulary in the lm_head.")
        start, num_org = int(shard.org_vocab_start_index), int(shard.num_org_elements)
    tp = int(tp_group.world_size) if shard is not None and tp_group is not None else 1
    vals, ids, lses = [], [], []
    for a in range(0, hidden_states.shape[0], chunk):
        hs = hidden_states[a : a + chunk].to(weight.dtype)
        v, i, l = draft_topk_candidates(torch.matmul(hs, weight[:num_org].T), k, vocab_start=start)
        vals.append(v), ids.append(i), lses.append(l)
    v, i, l = torch.cat(vals), torch.cat(ids), torch.cat(lses)
    if tp > 1:
        gathered = []
        for t in (v, i, l):
            g = torch.empty((tp,) + tuple(t.shape), dtype=t.dtype, device=t.device)
            tp_group.all_gather_into_tensor(g.view(-1), t.contiguous().view(-1))
            gathered.append(g)
        v, i, l = gathered
    else:
        v, i, l = v.unsqueeze(0), i.unsqueeze(0), l.unsqueeze(0)
    return merge_vocab_shards(v, i, l, k)


def step_tree(batch, cand_logprobs, cand_ids, budget: int, topk: int):
    """The step's tree over the drafter's candidates, compiled into verify inputs (FULL ancestor mask over the
    committed prefix and the D verify tokens, depth positions, retrieve_* links)."""
    tree = build_tree_from_candidates(cand_logprobs, cand_ids, budget)
    vin = compile_tree(tree, batch.spec_info.bonus_tokens, batch.seq_lens, mask_mode=FULL_MASK,
                       prefix_lens_sum=batch.seq_lens_sum if batch.seq_lens_cpu is not None else None, topk=topk)
    return tree, vin


@contextmanager
def verify_host_bound(batch, d: int, fallback_cpu=None, fallback_sum=None):
    """While the verify forward is prepared, the batch's host-side lengths are an upper bound of what it reads
    (committed prefix + the verify width), as DFlash does for its chain; restored afterwards."""
    cpu, total = batch.seq_lens_cpu, batch.seq_lens_sum
    if cpu is not None:
        batch.seq_lens_cpu = cpu + d
        batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
    elif fallback_cpu is not None:
        batch.seq_lens_cpu, batch.seq_lens_sum = fallback_cpu, int(fallback_sum)
    try:
        yield
    finally:
        batch.seq_lens_cpu, batch.seq_lens_sum = cpu, total


def accept_buffers(bs: int, d: int, depth: int, device):
    """(predicts [bs*D], accept_index [bs, depth] (-1), accept_token_num [bs]) for SGLang's tree accept."""
    return (torch.zeros((bs * d,), dtype=torch.int32, device=device),
            torch.full((bs, depth), -1, dtype=torch.int32, device=device),
            torch.zeros((bs,), dtype=torch.int32, device=device))


def greedy_accept(verify_fn: Callable, vin, candidates, target_predict, predict, accept_index, accept_num):
    """SGLang's greedy tree accept (`verify_tree_greedy_func` of the release)."""
    return verify_fn(
        predicts=predict,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=candidates,
        retrieve_index=vin.retrieve_index,
        retrieve_next_token=vin.retrieve_next_token,
        retrieve_next_sibling=vin.retrieve_next_sibling,
        target_predict=target_predict,
        topk=vin.topk,
    )


def sample_accept(si, logits, vin, candidates, coins, coins_final, predict, accept_index, accept_num, *,
                  kernel: Callable, top_k_renorm: Callable, top_p_renorm: Callable, max_bytes: int) -> None:
    """Target-only tree sampling (temperature, top-k, top-p, min-p) with the release's kernel, in request
    groups that bound the extra memory (sglang_ddtree.tree_sampling); fills predict/accept_index/accept_num."""
    sample_tree_accept(
        logits=logits,
        d=int(vin.draft_token_num),
        temperatures=si.temperatures,
        top_ks=si.top_ks if si.need_top_k_sampling else None,
        top_ps=si.top_ps if si.need_top_p_sampling else None,
        min_ps=si.min_ps if getattr(si, "need_min_p_sampling", False) else None,
        candidates=candidates,
        retrieve_index=vin.retrieve_index,
        retrieve_next_token=vin.retrieve_next_token,
        retrieve_next_sibling=vin.retrieve_next_sibling,
        coins=coins,
        coins_final=coins_final,
        predicts=predict,
        accept_index=accept_index,
        accept_num=accept_num,
        kernel=kernel,
        top_k_renorm=top_k_renorm,
        top_p_renorm=top_p_renorm,
        max_bytes=max_bytes,
    )


def commit_window(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix: torch.Tensor,
                  c: StepCommit) -> None:
    """The accepted path becomes the sequence: ``req_to_token[req, prefix : prefix + D]`` gets the step's
    window permuted so the path's KV locations come first (the rest stay reserved to the request)."""
    d = c.window_locs.shape[1]
    cols = prefix.to(torch.int64).unsqueeze(1) + torch.arange(d, device=prefix.device).unsqueeze(0)
    req_to_token[req_pool_indices.to(torch.int64).unsqueeze(1), cols] = c.window_locs.to(req_to_token.dtype)


def append_accepted(worker, hidden: Optional[torch.Tensor], c: StepCommit) -> None:
    """The accepted path's target hidden states, in sequence order, into the drafter's KV."""
    if hidden is None:
        raise RuntimeError("DDTREE verify requires target hidden states, but got None.")
    worker._append_target_hidden_to_draft_kv_by_loc(
        target_hidden=hidden.index_select(0, c.append_rows),
        cache_loc=c.append_cache_loc_2d.reshape(-1),
        cache_loc_2d=c.append_cache_loc_2d,
        positions=c.append_positions,
        commit_lens=c.commit_lens,
    )
