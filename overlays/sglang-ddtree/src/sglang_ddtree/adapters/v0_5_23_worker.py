"""DDTree worker for SGLang 0.5.23: what differs from 0.5.17, over the shared
worker (:mod:`sglang_ddtree.adapters.worker`, which has the step itself).

CPU-TESTED ONLY.  SGLang 0.5.23 pins torch 2.14.1 and its sglang-kernel does not
load on the fleet's (and the lent H200's) torch 2.11.0, so this worker has not
served on a GPU; the 0.5.17 one did.  Every SGLang name and keyword used here and
in the shared worker is checked against the installed 0.5.23 source by
``tests/plugin/test_worker_glue.py``.

Per version here, because 0.5.23's internals are what they are:

* the KV index translator: the step's window is planned (``kv_loc_plan``) and
  bound to the drafter's batch and the verify input, and the drafter writes its
  own ids (``_draft_write_ids``), not the target's locations;
* deferred vocab shards: the verify's logits may come back as a shard, finished
  here by argmax (greedy, when DFlash may skip the logits) or by the gather;
* ``SpecTpSync`` sites for the accept results; ``get_parallel()`` for the TP group
  and rank; ``draft_tp_context`` around the drafter's pass;
* the drafter: DFlash's resolved (or cached full) embedding and noise scale;
  ``set_block_size``; an explicit all-True drafter mask (DDTREE sets
  ``speculative_eagle_topk >= 2`` globally, so the drafter's backend may take its
  ``topk > 1`` TARGET_VERIFY path, which reads ``spec_info.custom_mask``);
  selector / LiLiCorr / Domino drafters and DP attention refused;
* names that moved: ``kernels.ops.speculative.spec_tree.verify_tree_greedy_func``,
  ``kernels.ops`` sampling ops, ``mamba_track_grid``, the draft input's
  ``nxt_kv_lens_*``; ``routed_experts_output`` / ``indexer_topk_output`` in the result;
* the recurrent-state commit goes through DFlash's
  ``_update_target_mamba_state_after_verify`` (overridden: the tree's accepted
  slots instead of a chain's prefix);
* ``forward_batch_generation``'s signature (``pp_proxy_tensors``) and
  shadow-linear's step, which hooks ``_accept_block`` and keeps device-side sums
  (one host sync per logging interval).

Tree-verify CUDA graphs stay refused here (``tree_verify_cuda_graphs`` is false
for 0.5.23 in ``capabilities.json``): there is no tree-mask capture hook.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.model_executor.forward_batch_info import enable_num_token_non_padded
from sglang.srt.runtime_context import get_parallel, mamba_track_grid
from sglang.srt.speculative.dflash_utils import is_dense_head_weight
from sglang.srt.speculative.dflash_worker_v2 import _is_all_greedy, _resolve_dflash_embedding_module
from sglang.srt.speculative.draft_worker_common import make_draft_block_spec_info
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import draft_tp_context

from ..config import TREE_VERIFY
from ..step import build_tree_from_candidates, shadow_tree_accept
from . import v0_5_23
from .worker import DDTreeWorkerBase

logger = logging.getLogger(__name__)


class DDTreeWorker(DDTreeWorkerBase):
    """DFlash v2 worker (SGLang 0.5.23) with DDTree tree verify (implemented, unrun; see the module docstring)."""

    _ddtree_adapter = v0_5_23
    _ddtree_verify_tree_greedy = staticmethod(verify_tree_greedy_func)

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        self._tree_accept_slots: Optional[torch.Tensor] = None
        self._tree_accept_length: Optional[torch.Tensor] = None
        self._shadow_result = None
        self._shadow_sums: Optional[torch.Tensor] = None  # device [steps, requests, chain, tree, inexact]
        self._shadow_steps = 0  # host counter: one host sync per logging interval, not per step

    # ----- entry (0.5.23's signature) -----------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        return self._ddtree_forward(batch, on_publish, grammar_barrier=grammar_barrier,
                                    pp_proxy_tensors=pp_proxy_tensors)

    # ----- init ---------------------------------------------------------------------
    def _ddtree_check_supported(self) -> None:
        if self.selector is not None or self.lilicorr is not None or self._is_domino:
            raise NotImplementedError(
                "DDTREE builds its tree from the plain DFlash drafter's per-position distributions; "
                "selector / LiLiCorr / Domino drafters are not supported."
            )
        if get_parallel().attn_dp_enabled:
            raise NotImplementedError("DDTREE does not support DP attention (idle-rank verify lockstep).")
        if self.ddtree.mode == TREE_VERIFY and self.use_compact_draft_cache:
            raise NotImplementedError("DDTREE tree-verify does not support --speculative-draft-window-size.")

    def _ddtree_drafter_block(self, cfg):
        return cfg.block_size

    def _ddtree_set_drafter_block(self, blk: int) -> None:
        self.draft_model.set_block_size(blk)  # its convolutions index a layout built from the block width

    # ----- target head, tensor parallelism ------------------------------------------
    def _ddtree_lm_head(self):
        lm_head = unwrap_lora_layer(getattr(self.target_worker.model_runner.model, "lm_head", None))
        if lm_head is None:
            raise RuntimeError("DDTREE requires the target model to expose lm_head.")
        return lm_head

    def _ddtree_head_weight(self, lm_head):
        weight = getattr(lm_head, "weight", None)
        if not is_dense_head_weight(weight):
            raise NotImplementedError("DDTREE needs a dense (unquantized) target lm_head to rank draft tokens.")
        return weight

    def _ddtree_tp_group(self):
        return get_parallel().tp_group

    def _ddtree_tp_rank(self) -> int:
        return get_parallel().tp_rank

    # ----- drafter pass --------------------------------------------------------------
    def _ddtree_reserved_seq_lens(self, draft_input):
        return draft_input.nxt_kv_lens_cpu, draft_input.nxt_kv_lens_sum

    def _ddtree_kv_loc_plan(self, batch, window, w):
        """The KV index translator's plan for the step's window req_to_token[prefix : prefix + w]."""
        host_seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.spec_info.nxt_kv_lens_cpu
        return self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=batch.seq_lens,
            seq_lens_cpu=host_seq_lens,
            write_virtual=window.reshape(-1),
            read_extent=w,
        )

    def _ddtree_bind_kv_loc_plan(self, plan, forward_batch, blk) -> None:
        plan.bind(forward_batch, self.draft_model_runner.kv_index_translator, cols=slice(0, blk))

    def _ddtree_embed(self, block_ids):
        embed_module = unwrap_lora_layer(
            _resolve_dflash_embedding_module(self.draft_model, self.target_worker.model_runner.model))
        if self._full_embed_gpu is not None:
            noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            noise = embed_module(block_ids)
        if self._noise_embed_scale != 1.0:
            noise = noise * self._noise_embed_scale
        return noise

    def _ddtree_draft_spec_info(self, batch, bs, blk):
        """The drafter block's spec info with an explicit all-True mask (prefix and the whole
        block visible - the drafter's ENCODER_ONLY semantics); see the module docstring."""
        info = make_draft_block_spec_info(draft_token_num=blk, device=self.device)
        total = int(batch.seq_lens_sum) if batch.seq_lens_cpu is not None else int(batch.seq_lens.sum().item())
        info.custom_mask = torch.ones(total * blk + bs * blk * blk, dtype=torch.bool, device=self.device)
        return info

    def _ddtree_draft_batch_extra(self, batch, bs, blk) -> dict:
        return {
            "num_token_non_padded": (
                torch.full((), bs * blk, dtype=torch.int32, device=self.device) if enable_num_token_non_padded()
                else None
            ),
            "global_num_token_non_padded_cpu": bs * blk,
            "can_run_decode_cuda_graph": batch.can_run_decode_cuda_graph,
        }

    def _ddtree_draft_tp(self):
        return draft_tp_context(self.draft_parallel_layout)

    # ----- verify, accept, commit ----------------------------------------------------
    def _ddtree_verify_input_extra(self, draft, d) -> dict:
        return {"kv_loc_plan": draft.kv_loc_plan, "kv_loc_cols": slice(0, d)}

    def _ddtree_finish_verify_logits(self, batch, logits_output):
        """A deferred vocab shard: argmax it where DFlash may skip the logits (greedy), else gather."""
        target_lp = self._target_logits_processor
        if target_lp is None or not target_lp.is_deferred_shard(logits_output.next_token_logits):
            return None
        if self._can_skip_verify_logits(batch, batch.sampling_info):
            target_predict = target_lp.deferred_argmax(logits_output.next_token_logits)
            logits_output.next_token_logits = None
            return target_predict
        logits_output.next_token_logits = target_lp.finish_deferred_gather(logits_output.next_token_logits)
        return None

    def _ddtree_sampling_ops(self):
        from sglang.kernels.ops.sampling.renorm import top_k_renorm_prob, top_p_renorm_prob
        from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only
        from sglang.srt.speculative.eagle_utils import _verify_coins

        return _verify_coins, tree_speculative_sampling_target_only, top_k_renorm_prob, top_p_renorm_prob

    def _ddtree_sync_greedy(self, target_predict) -> None:
        self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_GREEDY, target_predict)

    def _ddtree_sync_sampled(self, *tensors) -> None:
        for t in tensors:
            self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, t)

    def _ddtree_draft_window_ids(self, draft, window):
        bs, d = window.shape
        return self._draft_write_ids(draft.kv_loc_plan).view(bs, draft.window.shape[1])[:, :d]

    def _ddtree_commit_recurrent_state(self, batch, new_seq_lens, c) -> None:
        self._tree_accept_slots, self._tree_accept_length = c.accept_slots, c.accept_length
        try:
            self._update_target_mamba_state_after_verify(
                batch=batch,
                seq_lens_pre_verify=self._seq_lens_pre_verify,
                seq_lens_post_verify=new_seq_lens,
                commit_lens=c.commit_lens,
            )
        finally:
            self._tree_accept_slots = self._tree_accept_length = None

    def _ddtree_mamba_track_interval(self, batch) -> int:
        return mamba_track_grid(batch.tree_cache.page_size)

    def _ddtree_glue_track_interval(self):
        return None  # the grid depends on each batch's tree cache: the commit computes the indices (eager)

    def _ddtree_result_extra(self, target_out) -> dict:
        return {"routed_experts_output": target_out.routed_experts_output,
                "indexer_topk_output": target_out.indexer_topk_output}

    # ----- recurrent state commit (DFlash's hook, the tree's accepted slots) -----------
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
        if hasattr(self.target_worker.model_runner.attn_backend, "update_mamba_state_after_mtp_verify"):
            self._commit_tree_recurrent_state(batch, seq_lens_pre_verify, seq_lens_post_verify, commit_lens,
                                              self._tree_accept_slots, self._tree_accept_length)

    # ----- shadow-linear ---------------------------------------------------------------
    def _accept_block(self, *, candidates, next_token_logits, sampling_info, draft_input, prefix_lens, bs,
                      target_predict=None):
        res = super()._accept_block(
            candidates=candidates,
            next_token_logits=next_token_logits,
            sampling_info=sampling_info,
            draft_input=draft_input,
            prefix_lens=prefix_lens,
            bs=bs,
            target_predict=target_predict,
        )
        if self._shadow_armed and self._shadow_cands is not None:
            if target_predict is None and not _is_all_greedy(sampling_info):
                self.shadow_stats.skip("sampling", bs)  # the greedy walk is not what sampling would accept
            else:
                blk = int(self.block_size)
                pred = target_predict if target_predict is not None else torch.argmax(next_token_logits, dim=-1)
                lp, ids = self._shadow_cands
                tree = build_tree_from_candidates(
                    lp.view(bs, blk - 1, -1), ids.view(bs, blk - 1, -1), self.ddtree.budget
                )
                acc, exact = shadow_tree_accept(tree, candidates.view(bs, blk), pred.view(bs, blk))
                self._shadow_result = (acc, exact, res[1])  # res[1] = commit_lens
        return res

    def _forward_shadow(self, batch, on_publish, grammar_barrier, pp_proxy_tensors):
        self._shadow_armed, self._shadow_cands, self._shadow_result = True, None, None
        try:
            out = super().forward_batch_generation(
                batch, on_publish=on_publish, grammar_barrier=grammar_barrier, pp_proxy_tensors=pp_proxy_tensors
            )
        finally:
            self._shadow_armed, self._shadow_cands = False, None
        if self._shadow_result is not None:
            acc, exact, commit = self._shadow_result
            self._shadow_result = None
            out.cap_lens = (acc + 1).to(torch.int32)
            row = torch.stack([
                torch.ones((), dtype=torch.int64, device=acc.device),
                torch.tensor(acc.shape[0], dtype=torch.int64, device=acc.device),
                commit.to(torch.int64).sum(),
                (acc + 1).sum(),
                (~exact).to(torch.int64).sum(),
            ])
            self._shadow_sums = row if self._shadow_sums is None else self._shadow_sums + row
            self._shadow_steps += 1
            if self._shadow_steps >= self._shadow_log_every:
                self._shadow_steps = 0
                self.shadow_stats.add_totals(*self._shadow_sums.tolist())
                self._shadow_sums = None
                if get_parallel().tp_rank == 0:
                    logger.info("DDTREE shadow-linear (B=%d): %s", self.ddtree.budget, self.shadow_stats.summary())
        return out
