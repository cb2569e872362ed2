"""DDTree worker for SGLang 0.5.17: what differs from 0.5.23, over the shared
worker (:mod:`sglang_ddtree.adapters.worker`, which has the step itself).

This is the version that served on the NVIDIA H200.  Per version here, because
0.5.17's internals are what they are:

* the tree-verify CUDA-graph capture: 0.5.17's decode graph runner asks
  ``dflash_utils.resolve_dflash_verify_mask_policy`` whether to capture the
  target's verify graph with the Triton backend's mask buffer;
  :func:`_install_tree_mask_capture` answers yes in a DDTREE tree-verify
  process (capability ``tree_verify_cuda_graphs`` in ``capabilities.json``);
* names that moved in 0.5.23: ``get_tp_group`` / ``ps.tp_rank``,
  ``eagle_utils.verify_tree_greedy_func``, the ``sgl_kernel`` sampling ops,
  ``get_exec().mamba`` (the track interval), the draft input's
  ``reserved_seq_lens_*``;
* one KV location space (no KV index translator): the drafter writes the
  target's own locations; the drafter block embeds with the target's input
  embeddings; the recurrent-state commit calls the hybrid backend directly;
* the signatures of ``forward_batch_generation`` (no ``pp_proxy_tensors``) and
  shadow-linear's step: DFlash's chain step commits, then the tree from the same
  drafter distributions is walked with the chain verify's greedy predictions
  (host counters every step).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from sglang.srt.distributed import get_tp_group
from sglang.srt.runtime_context import get_exec
from sglang.srt.speculative.eagle_utils import _verify_coins, verify_tree_greedy_func

from .. import contract
from ..step import build_tree_from_candidates, follow_rank0, shadow_tree_accept
from . import v0_5_17
from . import v0_5_17_graph_widths as graph_widths
from .worker import DDTreeWorkerBase

logger = logging.getLogger(__name__)


# Tree-verify under CUDA graphs. SGLang 0.5.17 captures the target's DFlash-family verify graph with
# custom_mask=None when the attention backend can express a chain causally (Triton among them:
# dflash_utils._DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS), so a replay would verify the tree as a chain.
# The Triton backend already replays verify graphs with a custom mask - its VerifyMask buffer, refilled
# from spec_info.custom_mask at every replay - when the spec_info seen at capture carries one (the EAGLE
# topk > 1 path). The decode graph runner asks dflash_utils.resolve_dflash_verify_mask_policy (its only
# caller) whether to pass the mask buffer at capture; in a DDTREE tree-verify process the answer is yes.
# The hybrid linear-attention backend captures its tree buffers itself when speculative_eagle_topk > 1.
_TREE_MASK_CAPTURE = {"installed": False}


def _install_tree_mask_capture() -> None:
    """Make the target's verify-graph capture carry the tree-mask buffer (this process only; idempotent)."""
    if _TREE_MASK_CAPTURE["installed"]:
        return
    from sglang.srt.speculative import dflash_utils

    original = dflash_utils.resolve_dflash_verify_mask_policy

    def resolve_with_tree_mask(attn_backend):
        name, build = original(attn_backend)
        if graph_widths.capturing_chain():  # a chain bucket is DFLASH's own step: captured DFLASH's way
            return name, build
        return name, True

    resolve_with_tree_mask.__wrapped__ = original
    dflash_utils.resolve_dflash_verify_mask_policy = resolve_with_tree_mask
    _TREE_MASK_CAPTURE["installed"] = True


class DDTreeWorker(DDTreeWorkerBase):
    """DFlash v2 worker (SGLang 0.5.17) with DDTree tree verify; see the shared worker."""

    _ddtree_adapter = v0_5_17
    _ddtree_verify_tree_greedy = staticmethod(verify_tree_greedy_func)

    # ----- entry (0.5.17's signature) ---------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None):
        return self._ddtree_forward(batch, on_publish, grammar_barrier=grammar_barrier)

    # ----- init ---------------------------------------------------------------------
    def _ddtree_check_supported(self) -> None:
        if self.use_compact_draft_cache:
            raise ValueError("DDTREE does not support --speculative-draft-window-size (compact drafter cache).")

    def _ddtree_drafter_block(self, cfg):
        blk = cfg.resolve_block_size(default=None)
        if blk is None:
            blk = getattr(self.draft_model, "block_size", None)
        return blk

    def _ddtree_set_drafter_block(self, blk: int) -> None:
        # 0.5.17's DFlash drafter has no layer built from its block width (no set_block_size); its decode graphs
        # are captured (init_cuda_graphs, after this) at the width the spec class answers for the draft worker.
        from .v0_5_17 import DRAFTER_GRAPH_WIDTH

        DRAFTER_GRAPH_WIDTH["value"] = int(blk)

    def _ddtree_install_tree_mask_capture(self) -> None:
        _install_tree_mask_capture()

    def _ddtree_tree_mask_capture_installed(self) -> bool:
        return _TREE_MASK_CAPTURE["installed"]

    def _ddtree_install_bucket_widths(self) -> None:
        # A schedule's graphs: each bucket captured and replayed at its own entry's width (v0_5_17_graph_widths);
        # SGLANG_DDTREE_BUCKET_WIDTHS=0 keeps SGLang's one width (other widths verify eagerly).
        if not graph_widths.enabled():
            logger.info("DDTREE budget schedule: %s=0, verify graphs at one width (D); other widths eager",
                        graph_widths.ENV)
            return
        widths = set(contract.schedule_widths(self.ddtree.schedule, int(self.block_size)).values())
        graph_widths.install(self._width_at, widths, self._chain_at if self._chain_dflash else None)
        self._bucket_widths_on = True

    def _ddtree_dflash_chain_bucket(self, bs: int) -> bool:
        # a chain bucket's graph is captured DFLASH's way (v0_5_17_graph_widths), so DFLASH's step replays it
        if not (self._bucket_widths_on and self._graph_buckets and bs <= self._graph_buckets[-1]):
            return False  # past the largest bucket the verify runs eagerly: the plugin's own chain step
        return graph_widths.is_chain_bucket(self._ddtree_graph_bucket(bs))

    def _ddtree_graph_bucket(self, bs: int) -> int:
        if self._bucket_widths_on and self._graph_buckets and bs <= self._graph_buckets[-1]:
            return next(b for b in self._graph_buckets if b >= bs)
        return bs

    # ----- target head, tensor parallelism ------------------------------------------
    def _ddtree_lm_head(self):
        lm_head = getattr(self.target_worker.model_runner.model, "lm_head", None)
        if lm_head is None or not hasattr(lm_head, "weight"):
            raise RuntimeError("DDTREE requires the target model to expose lm_head with weight.")
        if not torch.is_floating_point(lm_head.weight):
            raise NotImplementedError("DDTREE needs a dense (unquantized) target lm_head to rank draft tokens.")
        return lm_head

    def _ddtree_head_weight(self, lm_head):
        return lm_head.weight

    def _ddtree_tp_group(self):
        return get_tp_group()

    def _ddtree_tp_rank(self) -> int:
        return self.ps.tp_rank

    # ----- drafter pass --------------------------------------------------------------
    def _ddtree_reserved_seq_lens(self, draft_input):
        return draft_input.reserved_seq_lens_cpu, draft_input.reserved_seq_lens_sum

    def _ddtree_kv_loc_plan(self, batch, window, w):
        return None  # one location space: the window's locations are what every pool writes

    def _ddtree_bind_kv_loc_plan(self, plan, forward_batch, blk) -> None:
        pass

    def _ddtree_embed(self, block_ids):
        return self.target_worker.model_runner.model.get_input_embeddings()(block_ids)

    def _ddtree_draft_spec_info(self, batch, bs, blk):
        return self._draft_block_spec_info

    def _ddtree_draft_batch_extra(self, batch, bs, blk) -> dict:
        return {}

    def _ddtree_draft_tp(self):
        return contextlib.nullcontext()

    # ----- verify, accept, commit ----------------------------------------------------
    def _ddtree_verify_input_extra(self, draft, d) -> dict:
        return {}

    def _ddtree_finish_verify_logits(self, batch, logits_output):
        return None  # 0.5.17's verify returns full-vocab logits

    def _ddtree_sampling_ops(self):
        from sgl_kernel import top_k_renorm_prob, top_p_renorm_prob, tree_speculative_sampling_target_only

        return _verify_coins, tree_speculative_sampling_target_only, top_k_renorm_prob, top_p_renorm_prob

    def _ddtree_sync_greedy(self, target_predict) -> None:
        pass  # every rank computes the same argmax of the same gathered logits

    def _ddtree_sync_sampled(self, *tensors) -> None:
        tp_group = get_tp_group()  # ranks may sample differently at float ties; rank 0 decides
        follow_rank0(tensors, tp_group.world_size, tp_group.broadcast)

    def _ddtree_draft_window_ids(self, draft, window):
        return window  # the drafter's KV pool shares the target's location ids

    def _ddtree_commit_recurrent_state(self, batch, new_seq_lens, c) -> None:
        self._commit_tree_recurrent_state(batch, self._seq_lens_pre_verify, new_seq_lens, c.commit_lens,
                                          c.accept_slots, c.accept_length, c.recurrent_step, c.track_steps)

    def _ddtree_mamba_track_interval(self, batch) -> int:
        return int(get_exec().mamba.mamba_track_interval)

    def _ddtree_glue_track_interval(self) -> int:
        return int(get_exec().mamba.mamba_track_interval or 0)  # fixed at start (server args)

    def _ddtree_result_extra(self, target_out) -> dict:
        return {}

    # ----- shadow-linear ---------------------------------------------------------------
    def _forward_shadow(self, batch, on_publish, grammar_barrier):
        """DFlash's chain step commits; the tree built from the same drafter
        distributions is walked with the chain verify's greedy predictions and
        its would-accept length is reported per request as ``cap_lens``
        (SGLang 0.5.17 reports it as ``meta_info["spec_num_cap_tokens"]``)."""
        bonus = batch.spec_info.bonus_tokens.clone() if batch.spec_info is not None else None
        self._shadow_armed, self._shadow_cands = True, None
        try:
            out = super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier)
        finally:
            self._shadow_armed = False
        cands, self._shadow_cands = self._shadow_cands, None
        si = batch.sampling_info
        if cands is None or bonus is None or out.logits_output is None:
            return out
        if si is not None and not si.is_all_greedy:
            self.shadow_stats.skip("sampling", len(batch.reqs))
            return out
        bs, blk = bonus.shape[0], int(self.block_size)
        lp, ids = cands
        tree = build_tree_from_candidates(lp.view(bs, blk - 1, -1), ids.view(bs, blk - 1, -1), self.ddtree.budget)
        chain = torch.empty((bs, blk), dtype=torch.int64, device=bonus.device)
        chain[:, 0] = bonus
        chain[:, 1:] = ids.view(bs, blk - 1, -1)[:, :, 0]
        pred = torch.argmax(out.logits_output.next_token_logits, dim=-1).view(bs, blk)
        acc, exact = shadow_tree_accept(tree, chain, pred)
        out.cap_lens = (acc + 1).to(torch.int32)
        self.shadow_stats.update(out.accept_lens.tolist(), acc.tolist(), exact.tolist())
        if self.shadow_stats.steps % self._shadow_log_every == 0 and self.ps.tp_rank == 0:
            logger.info("DDTREE shadow-linear (B=%d): %s", self.ddtree.budget, self.shadow_stats.summary())
        return out
