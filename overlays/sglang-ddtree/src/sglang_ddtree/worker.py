"""DDTree worker: a subclass of SGLang 0.5.23's ``DFlashWorkerV2``.

STATUS - UNRUN.  No GPU host in this workplace can install SGLang, so nothing
in this module has been executed; it is written against the 0.5.23 source and
only its pure pieces (``tree``, ``compile``, ``verify``, ``indexing``) are
tested, on CPU.  On a CPU-only install this module does not even import,
because ``sglang.srt.speculative.dflash_worker_v2`` pulls CUDA-only kernel
packages (``tvm_ffi``, ``sgl_kernel``) and torchvision.

What is implemented here:

* prefill (extend) batches: unchanged DFlash behaviour (``super()``), which
  captures the target hidden states and fills the drafter's KV cache;
* the tree pieces the decode step needs, as thin glue over tested functions:
  :meth:`DDTreeWorker.build_verify_inputs` (batched tree build + compile),
  :meth:`DDTreeWorker.walk` (greedy / target-only sampling walk),
  :meth:`DDTreeWorker.commit_indices` (accept-index, KV keep/free, recurrent
  state step, hidden-state rows), and the override of
  ``_update_target_mamba_state_after_verify`` that commits the recurrent state
  of the deepest accepted NODE (``last_correct_step_indices`` mapped through the
  accept slots) instead of DFlash's chain formula ``commit_len - 1``;
* ``shadow-linear`` decode: commits through DFlash's own chain verifier
  (``super()``).

What is NOT implemented: the tree-verify decode step itself.  In 0.5.23 the
DFlash decode step is one ~500-line method that sizes the verify forward,
KV allocation (``out_cache_loc``), the draft-KV append and the next draft input
by ``block_size``; a tree verify needs ``D = B + 1`` there and a compacting
``req_to_token`` remap after accept.  Until that method is re-derived for
trees and run on a GPU, a decode batch in ``tree-verify`` mode raises
``NotImplementedError`` rather than running something unverified.
Known traps that implementation must handle (see plugin.py for the ones the
argument validation already guards): the verify CUDA graph captured with no
custom mask; depth positions must be written into the graph's static position
buffer; ``topk`` must be the same at capture and replay; under tensor
parallelism the drafter's vocab ids must be the global ids (gather the
vocab-parallel shards before ranking).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from .compile import FULL_MASK, VerifyInputs, compile_tree
from .indexing import (
    accepted_kv_locs,
    flat_accept_index,
    gather_accepted_rows,
    kv_free_locs_mask,
    map_chain_steps_to_slots,
    recurrent_state_step,
)
from .plugin import SHADOW_LINEAR, TREE_VERIFY, resolve_ddtree_config
from .tree import TreeBatch, build_tree_batched
from .verify import WalkResult, verify_greedy, verify_sample

logger = logging.getLogger(__name__)


class DDTreeWorker(DFlashWorkerV2):
    """DFlash v2 worker with DDTree tree verify (see module docstring: unrun)."""

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        self.ddtree = resolve_ddtree_config(server_args, os.environ)
        self._tree_accept_slots: Optional[torch.Tensor] = None
        self._tree_accept_length: Optional[torch.Tensor] = None
        logger.info("DDTreeWorker: %s", self.ddtree)

    # ----- pieces (thin glue over the tested functions) -------------------
    def build_verify_inputs(
        self,
        draft_logprobs: torch.Tensor,
        bonus_tokens: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: Optional[int],
    ):
        """``draft_logprobs``: ``[bs, L, V]`` global-vocab log-probs of the drafter's
        block positions.  Returns ``(tree, VerifyInputs)``."""
        tree = build_tree_batched(draft_logprobs, self.ddtree.budget)
        vin = compile_tree(
            tree,
            bonus_tokens,
            seq_lens,
            mask_mode=FULL_MASK,
            prefix_lens_sum=seq_lens_sum,
            topk=self.ddtree.topk,
        )
        return tree, vin

    @staticmethod
    def walk(
        tree: TreeBatch,
        target_logits: torch.Tensor,
        greedy: bool,
        target_probs: Optional[torch.Tensor] = None,
        predictions: Optional[torch.Tensor] = None,
    ) -> WalkResult:
        if greedy:
            return verify_greedy(tree, target_logits)
        return verify_sample(tree, target_probs, predictions=predictions)

    @staticmethod
    def commit_indices(walk: WalkResult, vin: VerifyInputs, out_cache_loc: torch.Tensor):
        d = vin.draft_token_num
        return {
            "accept_index": flat_accept_index(walk.accept_slots, walk.accept_length, d),
            "kept_kv_locs": accepted_kv_locs(out_cache_loc, walk.accept_slots, walk.accept_length),
            "free_kv_mask": kv_free_locs_mask(walk.accept_slots, walk.accept_length, d),
            "state_step": recurrent_state_step(walk.accept_slots, walk.accept_length),
        }

    @staticmethod
    def accepted_hidden(hidden: torch.Tensor, walk: WalkResult):
        return gather_accepted_rows(hidden, walk.accept_slots, walk.accept_length)

    # ----- overrides -------------------------------------------------------
    def _update_target_mamba_state_after_verify(
        self, *, batch, seq_lens_pre_verify, seq_lens_post_verify, commit_lens
    ) -> None:
        if self.ddtree.mode != TREE_VERIFY or self._tree_accept_slots is None:
            return super()._update_target_mamba_state_after_verify(
                batch=batch,
                seq_lens_pre_verify=seq_lens_pre_verify,
                seq_lens_post_verify=seq_lens_post_verify,
                commit_lens=commit_lens,
            )
        if not self._need_mamba_verify_commit:
            return
        slots, length = self._tree_accept_slots, self._tree_accept_length
        steps_to_track = None
        if batch.mamba_track_indices is not None:
            from sglang.srt.speculative.dflash_worker_v2 import mamba_track_grid

            interval = mamba_track_grid(batch.tree_cache.page_size)
            to_track = seq_lens_pre_verify // interval != seq_lens_post_verify // interval
            point = seq_lens_post_verify // interval * interval
            ith = torch.clamp(point - seq_lens_pre_verify - 1, min=0).to(torch.int64)
            ith = torch.where(to_track & (ith < commit_lens.to(ith.dtype)), ith, torch.full_like(ith, -1))
            steps_to_track = map_chain_steps_to_slots(ith, slots, length)
        backend = self.target_worker.model_runner.attn_backend
        if hasattr(backend, "update_mamba_state_after_mtp_verify"):
            backend.update_mamba_state_after_mtp_verify(
                last_correct_step_indices=recurrent_state_step(slots, length),
                mamba_track_indices=batch.mamba_track_indices,
                mamba_steps_to_track=steps_to_track,
                model=self.target_worker.model_runner.model,
                req_pool_indices=batch.req_pool_indices[: commit_lens.shape[0]],
            )

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        is_extend = batch.forward_mode.is_extend() or batch.is_extend_in_batch
        if is_extend or self.ddtree.mode == SHADOW_LINEAR:
            return super().forward_batch_generation(
                batch,
                on_publish=on_publish,
                grammar_barrier=grammar_barrier,
                pp_proxy_tensors=pp_proxy_tensors,
            )
        raise NotImplementedError(
            "DDTREE tree-verify decode is not implemented in this build of sglang-ddtree (see "
            "sglang_ddtree.worker docstring); run with SGLANG_DDTREE_MODE=shadow-linear."
        )
