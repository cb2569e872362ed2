"""DDTree worker: a subclass of SGLang 0.5.23's ``DFlashWorkerV2``.

STATUS - IMPLEMENTED, UNRUN.  No GPU host in this workplace can install
SGLang, so nothing in this module has been executed.  It is written against
the 0.5.23 source; every SGLang function / method / attribute it touches is
checked against the installed source by ``tests/plugin/test_worker_glue.py``
(names, keyword arguments), and every piece of index / tensor arithmetic it
does lives in :mod:`sglang_ddtree.step` / :mod:`sglang_ddtree.indexing`, tested
on CPU (including a fake-model end-to-end test and a cross-check against
SGLang's own greedy tree-accept Triton kernel).  On a CPU-only install this
module does not import (``dflash_worker_v2`` pulls CUDA-only packages).

Modes
-----
* ``tree-verify`` decode (:meth:`DDTreeWorker._forward_tree_verify`): draft once
  (DFlash drafter, its own block width ``blk``), per-depth top-K candidates from
  the target LM head (vocab-parallel: per-shard top-K + all-gather + merge, so
  token ids are global), tree build + compile, target verify with the ancestor
  mask and depth positions (``D = B + 1`` tokens), SGLang's tree accept
  (``verify_tree_greedy`` greedy, ``tree_speculative_sampling_target_only``
  sampling), commit: ``req_to_token`` window permuted so the accepted path is
  the sequence (rejected slots stay reserved to the request), recurrent state
  of the deepest accepted node, accepted hidden states appended to the
  drafter's KV, DFlash-shaped result.
* ``shadow-linear`` decode: DFlash's own chain step (``super()``) commits; two
  thin hooks capture the drafter's candidates (``_greedy_sample_from_vocab_
  parallel_head``) and the chain verify's greedy predictions (``_accept_block``),
  and :func:`sglang_ddtree.step.shadow_tree_accept` walks the tree built from the
  same draft.  Per request, the would-accept length (tokens incl. bonus, like
  ``accept_lens``) is returned in ``GenerationBatchResult.cap_lens`` - SGLang's
  scheduler reports it as ``meta_info["spec_cap_length"]``, the ``cap len`` of the
  decode log line and the ``sglang:spec_cap_length`` gauge (a reporting-only field
  that DDTREE otherwise leaves unused) - and running sums are logged every
  ``SGLANG_DDTREE_SHADOW_LOG_EVERY`` steps (default 200).  ``/get_server_info``
  has no hook for a plugin worker's counters in 0.5.23 (only DSpark's).

Refused (raise at init or at the first decode, with the reason): CUDA graphs on
the target verify (captured with ``custom_mask=None``/``topk=1``: silently
causal), selector / LiLiCorr / Domino drafters, compact draft window, DP
attention, quantized LM head, LoRA-added vocab, grammar, logprobs, penalties /
logit bias / custom logit processors in tree-verify (chain-accumulated
penalties are not defined on a tree), drafter block wider than the ``2 * D``
KV reservation.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_func
from sglang.srt.lora.layers import unwrap_lora_layer
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import (
    CaptureHiddenMode,
    ForwardBatch,
    ForwardMode,
    enable_num_token_non_padded,
)
from sglang.srt.runtime_context import get_parallel, mamba_track_grid
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import is_dense_head_weight, parse_dflash_draft_config
from sglang.srt.speculative.dflash_worker_v2 import (
    DFlashWorkerV2,
    _is_all_greedy,
    _resolve_dflash_embedding_module,
)
from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_tp_sync import SpecTpSyncSite
from sglang.srt.speculative.spec_utils import draft_tp_context

from .compile import FULL_MASK, compile_tree
from .plugin import SHADOW_LINEAR, TREE_VERIFY, resolve_ddtree_config
from .step import (
    ShadowStats,
    build_tree_from_candidates,
    commit_from_accept,
    draft_topk_candidates,
    mamba_track_steps,
    merge_vocab_shards,
    shadow_tree_accept,
)

logger = logging.getLogger(__name__)

SHADOW_LOG_EVERY_ENV = "SGLANG_DDTREE_SHADOW_LOG_EVERY"


@dataclasses.dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """DFlash verify input carrying the tree links.  SGLang's hybrid
    linear-attention backend reads ``spec_info.retrieve_next_token`` /
    ``retrieve_next_sibling`` when ``topk > 1`` (tree path: each node reads its
    parent's conv window / SSM state)."""

    retrieve_index: Optional[torch.Tensor] = None
    retrieve_next_token: Optional[torch.Tensor] = None
    retrieve_next_sibling: Optional[torch.Tensor] = None


class DDTreeWorker(DFlashWorkerV2):
    """DFlash v2 worker with DDTree tree verify (implemented, unrun; see module docstring)."""

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        self.ddtree = resolve_ddtree_config(server_args, os.environ)
        self._tree_accept_slots: Optional[torch.Tensor] = None
        self._tree_accept_length: Optional[torch.Tensor] = None
        self._shadow_armed = False
        self._shadow_cands = None
        self._shadow_result = None
        self._shadow_sums: Optional[torch.Tensor] = None  # device [steps, requests, chain, tree, inexact]
        self._shadow_steps = 0  # host counter: one host sync per logging interval, not per step
        self.shadow_stats = ShadowStats()
        self._shadow_log_every = int(os.environ.get(SHADOW_LOG_EVERY_ENV, "200") or 200)
        self._vocab_size = int(self.model_runner.model_config.vocab_size)
        self._check_drafter_supported()
        if self.ddtree.mode == TREE_VERIFY:
            self._init_tree_verify()
        logger.info("DDTreeWorker: %s (drafter block %d)", self.ddtree, int(self.block_size))

    # ----- init -------------------------------------------------------------
    def _check_drafter_supported(self) -> None:
        if self.selector is not None or self.lilicorr is not None or self._is_domino:
            raise NotImplementedError(
                "DDTREE builds its tree from the plain DFlash drafter's per-position distributions; "
                "selector / LiLiCorr / Domino drafters are not supported."
            )
        if get_parallel().attn_dp_enabled:
            raise NotImplementedError("DDTREE does not support DP attention (idle-rank verify lockstep).")

    def _init_tree_verify(self) -> None:
        d = self.ddtree.num_draft_tokens
        # DFlash sized its drafter block by --speculative-num-draft-tokens (= D here); the
        # drafter keeps its own trained block width, the verify is D = B + 1 wide.
        blk = self.ddtree.drafter_block_size
        if blk is None:
            cfg = parse_dflash_draft_config(draft_hf_config=self.draft_model_runner.model_config.hf_config)
            blk = cfg.block_size
        if blk is None:
            raise ValueError(
                "DDTREE tree-verify needs the drafter's block width: set --speculative-dflash-block-size "
                "or use a drafter whose config declares block_size."
            )
        blk = int(blk)
        if blk < 2:
            raise ValueError(f"DDTREE drafter block width must be >= 2, got {blk}.")
        if blk > 2 * d:
            raise ValueError(
                f"DDTREE drafter block {blk} exceeds the 2*D = {2 * d} KV slots the scheduler reserves per "
                "request and step; raise --speculative-num-draft-tokens or lower the drafter block."
            )
        if self.use_compact_draft_cache:
            raise NotImplementedError("DDTREE tree-verify does not support --speculative-draft-window-size.")
        if getattr(self.model_runner, "decode_cuda_graph_runner", None) is not None:
            raise RuntimeError(
                "DDTREE tree-verify found a target decode CUDA graph: SGLang 0.5.23 captures the DFlash "
                "verify graph with custom_mask=None and topk=1 (silently causal). Run with "
                "--cuda-graph-backend-decode disabled."
            )
        self.block_size = blk
        self.draft_model.set_block_size(blk)
        self._block_pos_offsets = build_block_pos_offsets(length=blk, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(draft_token_num=blk, device=self.device)
        self.speculative_num_draft_tokens = d

    def _maybe_build_draft_sampler(self):
        # DDTREE needs the drafter's hidden states (full per-position distributions),
        # not the greedy ids a folded in-graph sampler would produce.
        return None

    # ----- drafter candidates (vocab-parallel safe) ---------------------------
    def _draft_candidates(self, hidden_states: torch.Tensor, lm_head, k: int, chunk: int = 256):
        """Global-vocab top-``k`` log-probs / ids of the target LM head on the
        drafter's hidden states ``[R, H]`` -> ``([R, k] float64, [R, k] int64)``."""
        weight = getattr(lm_head, "weight", None)
        if not is_dense_head_weight(weight):
            raise NotImplementedError("DDTREE needs a dense (unquantized) target lm_head to rank draft tokens.")
        shard = getattr(lm_head, "shard_indices", None)
        if shard is None:
            start, num_org = 0, min(int(weight.shape[0]), self._vocab_size)
        else:
            if int(shard.num_added_elements) != 0:
                raise NotImplementedError("DDTREE does not support LoRA-added vocabulary in the lm_head.")
            start, num_org = int(shard.org_vocab_start_index), int(shard.num_org_elements)
        tp_group = get_parallel().tp_group
        tp = int(tp_group.world_size) if shard is not None else 1
        vals, ids, lses = [], [], []
        for a in range(0, hidden_states.shape[0], chunk):
            hs = hidden_states[a : a + chunk].to(weight.dtype)
            v, i, l = draft_topk_candidates(torch.matmul(hs, weight[:num_org].T), k, vocab_start=start)
            vals.append(v), ids.append(i), lses.append(l)
        v, i, l = torch.cat(vals), torch.cat(ids), torch.cat(lses)
        if tp > 1:
            gv = torch.empty((tp,) + tuple(v.shape), dtype=v.dtype, device=v.device)
            gi = torch.empty((tp,) + tuple(i.shape), dtype=i.dtype, device=i.device)
            gl = torch.empty((tp,) + tuple(l.shape), dtype=l.dtype, device=l.device)
            tp_group.all_gather_into_tensor(gv.view(-1), v.contiguous().view(-1))
            tp_group.all_gather_into_tensor(gi.view(-1), i.contiguous().view(-1))
            tp_group.all_gather_into_tensor(gl.view(-1), l.contiguous().view(-1))
            v, i, l = gv, gi, gl
        else:
            v, i, l = v.unsqueeze(0), i.unsqueeze(0), l.unsqueeze(0)
        return merge_vocab_shards(v, i, l, k)

    # ----- recurrent state commit -------------------------------------------
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
            steps_to_track = mamba_track_steps(
                seq_lens_pre_verify,
                seq_lens_post_verify,
                commit_lens,
                mamba_track_grid(batch.tree_cache.page_size),
                slots,
                length,
            )
        backend = self.target_worker.model_runner.attn_backend
        if hasattr(backend, "update_mamba_state_after_mtp_verify"):
            from .indexing import recurrent_state_step

            backend.update_mamba_state_after_mtp_verify(
                last_correct_step_indices=recurrent_state_step(slots, length),
                mamba_track_indices=batch.mamba_track_indices,
                mamba_steps_to_track=steps_to_track,
                model=self.target_worker.model_runner.model,
                req_pool_indices=batch.req_pool_indices[: commit_lens.shape[0]],
            )

    # ----- shadow-linear hooks -------------------------------------------------
    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        out = super()._greedy_sample_from_vocab_parallel_head(
            hidden_states=hidden_states, lm_head=lm_head, chunk_size=chunk_size
        )
        if self._shadow_armed:
            k = min(self.ddtree.budget, self._vocab_size)
            self._shadow_cands = self._draft_candidates(hidden_states, lm_head, k)
        return out

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

    # ----- entry --------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        is_extend = batch.forward_mode.is_extend() or batch.is_extend_in_batch
        if is_extend or batch.forward_mode.is_idle():
            return super().forward_batch_generation(
                batch, on_publish=on_publish, grammar_barrier=grammar_barrier, pp_proxy_tensors=pp_proxy_tensors
            )
        if self.ddtree.mode == SHADOW_LINEAR:
            return self._forward_shadow(batch, on_publish, grammar_barrier, pp_proxy_tensors)
        return self._forward_tree_verify(batch, on_publish)

    # ----- tree-verify decode step ----------------------------------------------
    def _check_tree_batch(self, batch) -> None:
        if batch.has_grammar:
            raise NotImplementedError("DDTREE tree-verify does not support grammar-constrained decoding yet.")
        if batch.return_logprob:
            raise NotImplementedError("DDTREE tree-verify does not support return_logprob yet.")
        si = batch.sampling_info
        if si is not None and (
            si.has_custom_logit_processor
            or getattr(si, "acc_linear_penalties", None) is not None
            or (si.penalizer_orchestrator is not None and si.penalizer_orchestrator.is_required)
            or getattr(si, "logit_bias", None) is not None
            or getattr(si, "grammar_mask", None) is not None
        ):
            raise NotImplementedError(
                "DDTREE tree-verify supports temperature / top-k / top-p sampling only: penalties, logit bias "
                "and custom logit processors accumulate along a chain and are not defined on a tree."
            )

    def _draft_block_input(self, bs, blk, prefix_lens, batch):
        """The drafter block's spec info with an explicit all-True mask (prefix and
        the whole block visible - the drafter's ENCODER_ONLY semantics).  DDTREE
        sets speculative_eagle_topk >= 2 globally, so the drafter's attention
        backend may take its topk > 1 TARGET_VERIFY path, which reads
        ``spec_info.custom_mask`` (DFlash passes None, being topk = 1)."""
        info = make_draft_block_spec_info(draft_token_num=blk, device=self.device)
        total = int(batch.seq_lens_sum) if batch.seq_lens_cpu is not None else int(prefix_lens.sum().item())
        info.custom_mask = torch.ones(total * blk + bs * blk * blk, dtype=torch.bool, device=self.device)
        return info

    def _forward_tree_verify(self, batch, on_publish):
        self._check_tree_batch(batch)
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=self.device)
        draft_input = batch.spec_info
        device = self.device
        bs = len(batch.seq_lens)
        blk = int(self.block_size)
        d = int(self.ddtree.num_draft_tokens)
        w = max(blk, d)
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token

        target_model = self.target_worker.model_runner.model
        embed_module = unwrap_lora_layer(_resolve_dflash_embedding_module(self.draft_model, target_model))
        lm_head = unwrap_lora_layer(getattr(target_model, "lm_head", None))
        if lm_head is None:
            raise RuntimeError("DDTREE requires the target model to expose lm_head.")

        # --- 1) the step's KV window: req_to_token[prefix : prefix + w] (reserved by the scheduler)
        window = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=req_to_token,
            start_offset=prefix_lens,
            end_offset=prefix_lens + w,
            batch_size=bs,
            draft_token_num=w,
            device=device,
        ).view(bs, w)
        host_seq_lens = batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu
        kv_loc_plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            seq_lens_cpu=host_seq_lens,
            write_virtual=window.reshape(-1),
            read_extent=w,
        )

        # --- 2) drafter block [bonus, mask * (blk - 1)]
        block_ids = torch.full((bs, blk), int(self._mask_token_id), dtype=torch.long, device=device)
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        positions_blk = (prefix_lens.unsqueeze(1).to(torch.int64) + self._block_pos_offsets).reshape(-1)
        if self._full_embed_gpu is not None:
            noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            noise = embed_module(block_ids)
        if self._noise_embed_scale != 1.0:
            noise = noise * self._noise_embed_scale
        if batch.seq_lens_cpu is not None:
            draft_seq_lens_cpu = (batch.seq_lens_cpu + blk).to(torch.int32)
        else:
            draft_seq_lens_cpu = draft_input.nxt_kv_lens_cpu.to(torch.int32)
        draft_fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix_lens,
            out_cache_loc=window[:, :blk].reshape(-1),
            seq_lens_sum=int(draft_seq_lens_cpu.sum()),
            seq_lens_cpu=draft_seq_lens_cpu,
            positions=positions_blk,
            input_embeds=noise.view(-1, noise.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._draft_block_input(bs, blk, prefix_lens, batch),
            capture_hidden_mode=CaptureHiddenMode.NULL,
            num_token_non_padded=(
                torch.full((), bs * blk, dtype=torch.int32, device=device) if enable_num_token_non_padded() else None
            ),
            global_num_token_non_padded_cpu=bs * blk,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph,
        )
        kv_loc_plan.bind(draft_fb, self.draft_model_runner.kv_index_translator, cols=slice(0, blk))
        with torch.inference_mode(), draft_tp_context(self.draft_parallel_layout):
            draft_out = self.draft_model_runner.forward(draft_fb)
        draft_hidden = draft_out.logits_output.hidden_states
        if draft_hidden is None:
            raise RuntimeError("DDTREE: the DFlash draft model returned no hidden states.")
        draft_hidden = draft_hidden[: bs * blk].view(bs, blk, -1)

        # --- 3) tree: per-depth global top-K -> build -> compile
        k = min(self.ddtree.budget, self._vocab_size)
        with draft_tp_context(self.draft_parallel_layout):
            lp, ids = self._draft_candidates(draft_hidden[:, 1:, :].reshape(-1, draft_hidden.shape[-1]), lm_head, k)
        tree = build_tree_from_candidates(lp.view(bs, blk - 1, k), ids.view(bs, blk - 1, k), self.ddtree.budget)
        vin = compile_tree(
            tree,
            draft_input.bonus_tokens,
            prefix_lens,
            mask_mode=FULL_MASK,
            prefix_lens_sum=batch.seq_lens_sum if batch.seq_lens_cpu is not None else None,
            topk=self.ddtree.topk,
        )
        assert vin.draft_token_num == d

        # --- 4) target verify: D tokens, ancestor mask, depth positions, tree links
        verify_input = DDTreeVerifyInput(
            draft_token=vin.draft_token,
            positions=vin.positions,
            draft_token_num=d,
            topk=vin.topk,
            custom_mask=vin.custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=kv_loc_plan,
            kv_loc_cols=slice(0, d),
            retrieve_index=vin.retrieve_index,
            retrieve_next_token=vin.retrieve_next_token,
            retrieve_next_sibling=vin.retrieve_next_sibling,
        )
        batch.out_cache_loc = window[:, :d].reshape(-1)
        seq_lens_pre_verify = batch.seq_lens.clone() if self._need_mamba_verify_commit else None
        seq_lens_cpu_backup, seq_lens_sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        if seq_lens_cpu_backup is not None:
            batch.seq_lens_cpu = seq_lens_cpu_backup + d
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        elif draft_input.nxt_kv_lens_cpu is not None:
            batch.seq_lens_cpu = draft_input.nxt_kv_lens_cpu
            batch.seq_lens_sum = int(draft_input.nxt_kv_lens_sum)
        verify_fb, can_run_graph = verify_input.prepare_for_verify(batch, self.target_worker)
        batch.seq_lens_cpu, batch.seq_lens_sum = seq_lens_cpu_backup, seq_lens_sum_backup
        if can_run_graph:
            raise RuntimeError("DDTREE tree-verify must not replay a decode CUDA graph (causal mask capture).")
        verify_fb.can_run_decode_cuda_graph = False
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=verify_fb, is_verify=True, skip_attn_backend_init=True
        )
        logits_output = target_out.logits_output
        sampling_info = batch.sampling_info
        target_predict = None
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(logits_output.next_token_logits):
            if self._can_skip_verify_logits(batch, sampling_info):
                target_predict = target_lp.deferred_argmax(logits_output.next_token_logits)
                logits_output.next_token_logits = None
            else:
                logits_output.next_token_logits = target_lp.finish_deferred_gather(logits_output.next_token_logits)

        # --- 5) SGLang's tree accept
        candidates = vin.draft_token.view(bs, d)
        m = vin.max_tree_depth + 1
        predict = torch.zeros((bs * d,), dtype=torch.int32, device=device)
        accept_index = torch.full((bs, m), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros((bs,), dtype=torch.int32, device=device)
        if target_predict is not None or _is_all_greedy(sampling_info):
            if target_predict is None:
                target_predict = torch.argmax(logits_output.next_token_logits, dim=-1)
            target_predict = target_predict.view(bs, d).to(torch.int64)
            self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_GREEDY, target_predict)
            predict, accept_index, accept_num = verify_tree_greedy_func(
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
        else:
            self._tree_sample_accept(
                batch, logits_output.next_token_logits, candidates, vin, predict, accept_index, accept_num
            )
            for t in (predict, accept_index, accept_num):
                self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, t)

        # --- 6) commit
        draft_window_ids = self._draft_write_ids(kv_loc_plan).view(bs, w)[:, :d]
        c = commit_from_accept(
            predicts=predict,
            accept_index=accept_index,
            accept_token_num=accept_num,
            d=d,
            prefix=prefix_lens,
            window_locs=window[:, :d],
            draft_window_ids=draft_window_ids,
            out_width=d,
        )
        new_seq_lens = c.new_seq_lens.to(prefix_lens.dtype)
        # keep the accepted path as the sequence: permute the window in req_to_token
        cols = prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(d, device=device).unsqueeze(0)
        req_to_token[batch.req_pool_indices.to(torch.int64).unsqueeze(1), cols] = c.window_locs.to(req_to_token.dtype)

        if self._need_mamba_verify_commit:
            self._tree_accept_slots, self._tree_accept_length = c.accept_slots, c.accept_length
            try:
                self._update_target_mamba_state_after_verify(
                    batch=batch,
                    seq_lens_pre_verify=seq_lens_pre_verify,
                    seq_lens_post_verify=new_seq_lens,
                    commit_lens=c.commit_lens,
                )
            finally:
                self._tree_accept_slots = self._tree_accept_length = None
        if on_publish is not None:
            on_publish(new_seq_lens)

        # --- 7) drafter cache: the accepted path's target hidden states, sequence order
        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, but got None.")
        self._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=hidden.index_select(0, c.append_rows),
            cache_loc=c.append_cache_loc_2d.reshape(-1),
            cache_loc_2d=c.append_cache_loc_2d,
            positions=c.append_positions,
            commit_lens=c.commit_lens,
        )
        logits_output.hidden_states = None

        next_draft_input = self._make_next_draft_input_decode(bonus_tokens=c.bonus, new_seq_lens=new_seq_lens)
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=c.out_tokens.reshape(-1),
            accept_lens=c.commit_lens,
            can_run_cuda_graph=False,
            next_draft_input=next_draft_input,
            speculative_num_draft_tokens=d,
            new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output,
        )

    def _tree_sample_accept(self, batch, logits, candidates, vin, predict, accept_index, accept_num) -> None:
        """Target-only tree sampling with SGLang's kernel (lossless: every emitted
        token is a sample of the target's processed distribution at the accepted
        prefix; draft probabilities are zero, so the residual at a stop is the
        target's distribution with the rejected siblings removed)."""
        from sglang.kernels.ops.sampling import softmax as sampling_softmax
        from sglang.kernels.ops.sampling.renorm import top_k_renorm_prob, top_p_renorm_prob
        from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only
        from sglang.srt.speculative.eagle_utils import _verify_coins

        si = batch.sampling_info
        bs, d = candidates.shape
        temp = torch.repeat_interleave(si.temperatures, d, dim=0)
        probs = sampling_softmax(logits, temperatures=temp)
        if si.need_top_k_sampling:
            probs = top_k_renorm_prob(probs, torch.repeat_interleave(si.top_ks, d, dim=0))
        if si.need_top_p_sampling:
            probs = top_p_renorm_prob(probs, torch.repeat_interleave(si.top_ps, d, dim=0))
        probs = probs.reshape(bs, d, -1)
        coins, coins_final = _verify_coins(
            sampling_info=si, seq_lens=batch.seq_lens, draft_token_num=d, candidates=candidates, device=self.device
        )
        tree_speculative_sampling_target_only(
            predicts=predict,
            accept_index=accept_index,
            accept_token_num=accept_num,
            candidates=candidates,
            retrive_index=vin.retrieve_index,
            retrive_next_token=vin.retrieve_next_token,
            retrive_next_sibling=vin.retrieve_next_sibling,
            uniform_samples=coins,
            uniform_samples_for_final_sampling=coins_final,
            target_probs=probs,
            draft_probs=torch.zeros_like(probs),
            threshold_single=1.0,
            threshold_acc=1.0,
            deterministic=True,
        )
