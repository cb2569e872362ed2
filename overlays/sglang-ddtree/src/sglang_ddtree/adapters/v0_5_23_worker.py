"""DDTree worker for SGLang 0.5.23: a subclass of its ``DFlashWorkerV2``.

CPU-TESTED ONLY.  SGLang 0.5.23 pins torch 2.14.1 and its sglang-kernel does not
load on the fleet's (and the lent H200's) torch 2.11.0, so this worker has not
served on a GPU; the 0.5.17 adapter (:mod:`sglang_ddtree.adapters.v0_5_17_worker`)
is the one that ran on the H200.  Every SGLang name and keyword used here is
checked against the installed 0.5.23 source by ``tests/plugin/test_worker_glue.py``;
every index computation lives in :mod:`sglang_ddtree.step` (pure, CPU-tested).

Same structure as the 0.5.17 worker: prefill / idle / shadow-linear commits are
DFlash's own; tree-verify decode is :meth:`_tree_draft`, :meth:`_tree_verify`,
:meth:`_tree_accept`, :meth:`_tree_commit`.  0.5.23 differences: the KV window
goes through the KV index translator (``kv_loc_plan``), vocab-parallel heads
may be deferred shards, TP sync sites, and a drafter-side ``topk > 1`` path that
needs an explicit all-True drafter mask.
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

from ..admission import tree_verify_rejection
from ..compile import FULL_MASK, compile_tree
from ..config import SHADOW_LINEAR, TREE_VERIFY, resolve_ddtree_config
from ..indexing import recurrent_state_step
from ..tree_sampling import max_bytes_from_env, sample_tree_accept
from . import common
from .v0_5_23 import attention_backends
from ..step import (
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
        self.ddtree = resolve_ddtree_config(server_args, os.environ, backends=attention_backends(server_args))
        common.set_active_mode(self.ddtree.mode)
        self._sampling_bytes = max_bytes_from_env()
        self._warned_unsupported = False
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
        self.block_size = blk
        self.draft_model.set_block_size(blk)
        self._block_pos_offsets = build_block_pos_offsets(length=blk, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(draft_token_num=blk, device=self.device)
        self.speculative_num_draft_tokens = d

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        # Checked here, after SGLang built (or skipped) its graphs: the target's decode graph is
        # captured with custom_mask=None / topk=1 and would run the tree causally.
        if self.ddtree.mode == TREE_VERIFY and getattr(self.model_runner, "decode_cuda_graph_runner", None):
            raise RuntimeError(
                "DDTREE tree-verify found a target decode CUDA graph (captured causal, topk=1); "
                "run with --cuda-graph-backend-decode disabled."
            )

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
    def _unsupported_in_batch(self, batch) -> None:
        """Admission rejects these (sglang_ddtree.admission); if one reached a batch through a
        path admission does not see, serve it with its plain sampling parameters and log why
        once - raising here would stop the scheduler loop for every request."""
        if self._warned_unsupported:
            return
        for req in batch.reqs:
            why = tree_verify_rejection(req)
            if why:
                self._warned_unsupported = True
                logger.error("DDTREE: a request reached tree-verify unchecked (%s); serving it without "
                             "those features.", why)
                return

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
        self._unsupported_in_batch(batch)
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=self.device)
        draft = self._tree_draft(batch)
        vin, target_out, target_predict = self._tree_verify(batch, draft)
        predict, accept_index, accept_num = self._tree_accept(batch, vin, target_out.logits_output, target_predict)
        return self._tree_commit(batch, draft, vin, target_out, predict, accept_index, accept_num, on_publish)

    def _tree_draft(self, batch) -> dict:
        """The step's KV window and the drafter's per-depth global top-K candidates."""
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

        # the step's KV window: req_to_token[prefix : prefix + w] (reserved by the scheduler)
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

        # drafter block [bonus, mask * (blk - 1)]
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
        k = min(self.ddtree.budget, self._vocab_size)
        with draft_tp_context(self.draft_parallel_layout):
            lp, ids = self._draft_candidates(draft_hidden[:, 1:, :].reshape(-1, draft_hidden.shape[-1]), lm_head, k)
        return {"window": window, "kv_loc_plan": kv_loc_plan, "w": w,
                "lp": lp.view(bs, blk - 1, k), "ids": ids.view(bs, blk - 1, k)}

    def _tree_verify(self, batch, draft: dict):
        """Tree over the candidates -> compiled verify inputs -> one target verify forward."""
        draft_input = batch.spec_info
        d = int(self.ddtree.num_draft_tokens)
        tree = build_tree_from_candidates(draft["lp"], draft["ids"], self.ddtree.budget)
        vin = compile_tree(
            tree,
            draft_input.bonus_tokens,
            batch.seq_lens,
            mask_mode=FULL_MASK,
            prefix_lens_sum=batch.seq_lens_sum if batch.seq_lens_cpu is not None else None,
            topk=self.ddtree.topk,
        )
        assert vin.draft_token_num == d
        verify_input = DDTreeVerifyInput(
            draft_token=vin.draft_token,
            positions=vin.positions,
            draft_token_num=d,
            topk=vin.topk,
            custom_mask=vin.custom_mask,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            kv_loc_plan=draft["kv_loc_plan"],
            kv_loc_cols=slice(0, d),
            retrieve_index=vin.retrieve_index,
            retrieve_next_token=vin.retrieve_next_token,
            retrieve_next_sibling=vin.retrieve_next_sibling,
        )
        batch.out_cache_loc = draft["window"][:, :d].reshape(-1)
        self._seq_lens_pre_verify = batch.seq_lens.clone() if self._need_mamba_verify_commit else None
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
        target_predict = None
        target_lp = self._target_logits_processor
        if target_lp is not None and target_lp.is_deferred_shard(logits_output.next_token_logits):
            if self._can_skip_verify_logits(batch, batch.sampling_info):
                target_predict = target_lp.deferred_argmax(logits_output.next_token_logits)
                logits_output.next_token_logits = None
            else:
                logits_output.next_token_logits = target_lp.finish_deferred_gather(logits_output.next_token_logits)
        return vin, target_out, target_predict

    def _tree_accept(self, batch, vin, logits_output, target_predict):
        """SGLang's tree accept: greedy kernel, or bounded-memory target-only tree sampling."""
        device = self.device
        bs, d = len(batch.seq_lens), int(vin.draft_token_num)
        sampling_info = batch.sampling_info
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
            from sglang.kernels.ops.sampling.renorm import top_k_renorm_prob, top_p_renorm_prob
            from sglang.kernels.ops.speculative.sampling import tree_speculative_sampling_target_only
            from sglang.srt.speculative.eagle_utils import _verify_coins

            si = sampling_info
            coins, coins_final = _verify_coins(
                sampling_info=si, seq_lens=batch.seq_lens, draft_token_num=d, candidates=candidates, device=device
            )
            sample_tree_accept(
                logits=logits_output.next_token_logits,
                d=d,
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
                kernel=tree_speculative_sampling_target_only,
                top_k_renorm=top_k_renorm_prob,
                top_p_renorm=top_p_renorm_prob,
                max_bytes=self._sampling_bytes,
            )
            for t in (predict, accept_index, accept_num):
                self._tp_sync.sync(SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE, t)
        return predict, accept_index, accept_num

    def _tree_commit(self, batch, draft, vin, target_out, predict, accept_index, accept_num, on_publish):
        """The accepted path becomes the sequence (KV window permutation, recurrent
        state, drafter KV append) and the DFlash-shaped result."""
        device = self.device
        d = int(vin.draft_token_num)
        bs = len(batch.seq_lens)
        prefix_lens = batch.seq_lens
        window = draft["window"]
        logits_output = target_out.logits_output
        draft_window_ids = self._draft_write_ids(draft["kv_loc_plan"]).view(bs, draft["w"])[:, :d]
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
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        cols = prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(d, device=device).unsqueeze(0)
        req_to_token[batch.req_pool_indices.to(torch.int64).unsqueeze(1), cols] = c.window_locs.to(req_to_token.dtype)

        if self._need_mamba_verify_commit:
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
        if on_publish is not None:
            on_publish(new_seq_lens)

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
