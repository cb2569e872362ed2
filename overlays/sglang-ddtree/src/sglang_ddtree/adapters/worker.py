"""The DDTree worker, written once for every supported SGLang version.

:class:`DDTreeWorkerBase` subclasses the installed SGLang's ``DFlashWorkerV2``
(``sglang.srt.speculative.dflash_worker_v2`` in 0.5.17 and 0.5.23 alike, so this
import gives that release's own class).  Each version's worker is a thin
subclass in its adapter's ``*_worker`` module (:mod:`.v0_5_17_worker`,
:mod:`.v0_5_23_worker`, ``worker`` in ``capabilities.json``) that SGLang's worker
factory returns (:func:`sglang_ddtree.adapters.load_worker`); it sets
``_ddtree_adapter`` (the adapter module: ``VERSION``, ``TREE_VERIFY_CUDA_GRAPHS``,
``attention_backends``) and supplies the ``_ddtree_*`` hooks, nothing else of
the step.  Every name imported here sits at the same place in both releases
(``tests/plugin/test_worker_glue.py`` checks that against each installed SGLang).

Prefill, idle batches and (in shadow-linear mode) the committing decode step are
DFlash's own.  The tree-verify decode step, here, is four methods, each a thin
layer over SGLang's forwards and kernels with every index computation in
:mod:`sglang_ddtree.step` (pure, CPU-tested):

1. :meth:`DDTreeWorkerBase._tree_draft` - the drafter's block ``[bonus, mask*(blk-1)]``
   at its own width ``blk`` into the step's KV window, and the per-depth global
   top-K of the target LM head on its hidden states (vocab-parallel safe);
2. :meth:`DDTreeWorkerBase._tree_verify` - the tree (best-first, budget ``B``),
   compiled to ``D = B + 1`` verify tokens with depth positions, the ancestor
   mask and the ``retrieve_*`` links, verified in one target forward (Triton
   attention with the custom mask; the hybrid linear-attention backend takes
   its tree path because ``speculative_eagle_topk >= 2``, so each node starts
   from its parent's conv window and SSM state);
3. SGLang's tree accept: the ``verify_tree_greedy`` kernel (greedy, in
   :meth:`DDTreeWorkerBase._glue_commit_fn`) or ``tree_speculative_sampling_target_only``
   with zero draft probabilities (:meth:`DDTreeWorkerBase._tree_sample_accept`:
   lossless sampling, in bounded-memory groups), then the accept counters and
   the commit indices (``step.accept_commit``);
4. :meth:`DDTreeWorkerBase._tree_commit` - the accepted path becomes the sequence:
   ``req_to_token[prefix : prefix + D]`` is permuted so the path's KV slots come
   first, the recurrent state of the deepest accepted node is committed, the
   accepted hidden states go into the drafter's KV, and the result has DFlash's
   shape with stride ``D``.

Also here, for both versions: the ``record_function("ddtree.*")`` phase ranges
(``sglang_ddtree_tools.profile_step`` sums them), the accept counters logged as
``DDTREE accept stats {json}`` (:class:`sglang_ddtree.step.TreeAcceptStats`),
the CUDA-graph check of :meth:`init_cuda_graphs` (graphs are allowed where the
adapter's capability ``tree_verify_cuda_graphs`` says so - 0.5.17, whose worker
installs the tree-mask capture - and refused elsewhere), the drafter-candidate
top-K, the shadow-linear candidate hook, and the admission fallback.

Per version (the ``_ddtree_*`` hooks of each ``*_worker`` module), and why - the
release's internals differ there, nothing else does:

* ``_ddtree_check_supported`` - refusals: 0.5.17 the compact drafter cache;
  0.5.23 also selector / LiLiCorr / Domino drafters and DP attention (it has them);
* ``_ddtree_drafter_block``, ``_ddtree_set_drafter_block`` - the drafter's own
  width: 0.5.17 ``resolve_block_size`` or the model's attribute, nothing to set;
  0.5.23 ``cfg.block_size`` and ``draft_model.set_block_size`` (its convolutions);
* ``_ddtree_install_tree_mask_capture``, ``_ddtree_tree_mask_capture_installed`` -
  0.5.17 only: wraps ``dflash_utils.resolve_dflash_verify_mask_policy`` so the
  target's verify graph is captured with the tree-mask buffer (0.5.23: graphs
  refused, no hook);
* ``_ddtree_install_bucket_widths``, ``_ddtree_graph_bucket`` - 0.5.17 only: a budget
  schedule's target verify graphs, each bucket captured and replayed at its own
  width (``v0_5_17_graph_widths``), and the bucket a step's batch pads to (its
  budget's batch size); elsewhere no hook and the batch size itself;
* ``_ddtree_lm_head``, ``_ddtree_head_weight`` - 0.5.17 the plain ``lm_head``;
  0.5.23 LoRA-unwrapped, ``is_dense_head_weight``;
* ``_ddtree_tp_group``, ``_ddtree_tp_rank`` - ``get_tp_group()`` / ``ps.tp_rank``
  vs ``get_parallel()``;
* ``_ddtree_reserved_seq_lens`` - the draft input's host bound of the step's KV
  reservation: ``reserved_seq_lens_*`` vs ``nxt_kv_lens_*`` (renamed);
* ``_ddtree_kv_loc_plan``, ``_ddtree_bind_kv_loc_plan``, ``_ddtree_verify_input_extra``,
  ``_ddtree_draft_window_ids`` - 0.5.17 has one KV location space (nothing to
  plan; the drafter writes the target's locations); 0.5.23 plans the window with
  the KV index translator, binds it to the drafter's batch and the verify input,
  and the drafter writes its own ids;
* ``_ddtree_embed`` - the drafter block's embeddings: the target's input
  embeddings vs DFlash's resolved (or cached full) embedding and noise scale;
* ``_ddtree_draft_spec_info``, ``_ddtree_draft_batch_extra``, ``_ddtree_draft_tp`` -
  0.5.17 DFlash's block spec info, no extra fields, no context; 0.5.23 an
  all-True drafter mask (its ``topk > 1`` path reads one), the non-padded token
  counts, ``draft_tp_context``;
* ``_ddtree_finish_verify_logits`` - 0.5.23 only does anything: a deferred vocab
  shard, finished by argmax (greedy) or by the gather;
* ``_ddtree_verify_tree_greedy``, ``_ddtree_sampling_ops`` - where the kernels
  live: ``eagle_utils`` / ``sgl_kernel`` vs ``sglang.kernels.ops``;
* ``_ddtree_sync_greedy``, ``_ddtree_sync_sampled`` - TP agreement on the accept:
  0.5.17 broadcasts sampled results from rank 0; 0.5.23 its ``SpecTpSync`` sites;
* ``_ddtree_commit_recurrent_state``, ``_ddtree_mamba_track_interval`` - both end in
  :meth:`DDTreeWorkerBase._commit_tree_recurrent_state`: 0.5.17 directly, with
  ``get_exec().mamba``'s interval; 0.5.23 through DFlash's overridden
  ``_update_target_mamba_state_after_verify``, with ``mamba_track_grid``;
* ``_ddtree_glue_track_interval`` - the track interval before any batch, so the
  accept's glue graph can compute the recurrent commit's indices (glue level 2):
  0.5.17's ``get_exec().mamba`` is fixed at start; 0.5.23's grid depends on the
  batch's tree cache: ``None`` (they stay in the commit, eager);
* ``_ddtree_result_extra`` - 0.5.23's result also carries the routed-experts /
  indexer outputs.

Per version too, with that release's signatures (an override must match its
base): ``forward_batch_generation`` (0.5.23 adds ``pp_proxy_tensors``; both call
:meth:`DDTreeWorkerBase._ddtree_forward`) and shadow-linear's ``_forward_shadow``
(0.5.17 walks the tree after DFlash's step, with host counters; 0.5.23 hooks its
``_accept_block`` and keeps device-side sums).

Requests tree-verify cannot serve are rejected at admission
(:mod:`sglang_ddtree.admission`); should one reach a batch anyway, the step
serves it greedily/with its plain sampling parameters and logs why instead of
raising (an exception here would stop the scheduler loop for every request).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.profiler import record_function

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.managers.scheduler import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.speculative.dflash_info import DFlashVerifyInput
from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
from sglang.srt.speculative.draft_worker_common import build_block_pos_offsets, make_draft_block_spec_info
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from .. import contract
from ..admission import logprobs_past_dflash, tree_verify_rejection
from ..compile import with_full_mask
from ..config import SHADOW_LINEAR, TREE_VERIFY, resolve_ddtree_config
from ..indexing import recurrent_state_step
from ..step import (
    ShadowStats,
    TreeAcceptStats,
    accept_commit,
    draft_topk_candidates,
    mamba_track_steps,
    step_budget,
    tp_merged_candidates,
    tree_verify_inputs,
)
from ..glue_graphs import GlueGraph, glue_graph_level
from ..tree_sampling import max_bytes_from_env, sample_tree_accept
from . import common

logger = logging.getLogger(__name__)

SHADOW_LOG_EVERY_ENV = "SGLANG_DDTREE_SHADOW_LOG_EVERY"
# Tree-verify accept counters (accepted tokens off the first branch, accepted-depth histogram), logged as
# one "DDTREE accept stats {json}" line every this many steps (one host sync each time).
STATS_EVERY_ENV = "SGLANG_DDTREE_STATS_EVERY"
# For the leak demonstration only (ddtree_checks.serve_matrix): the recurrent layers get no tree
# links, so they process the verify slots in chain order and a node starts from the previous
# slot's state (often a sibling), not its parent's. Wrong on purpose; refused unless spelled out.
UNSAFE_CHAIN_STATE_ENV = "SGLANG_DDTREE_UNSAFE_CHAIN_STATE"
# A budget schedule's chain entries (contract.CHAIN_STEP_ENV: DFLASH's own step or the plugin's).
CHAIN_STEP_ENV = contract.CHAIN_STEP_ENV


def chain_step_from_env(environ=os.environ, default: str = contract.CHAIN_STEP_PLUGIN) -> str:
    """Which step serves a schedule's chain entries (:data:`CHAIN_STEP_ENV` in ``environ``; ``default`` unset)."""
    return contract.parse_chain_step(environ.get(CHAIN_STEP_ENV), default)


def _full_attn_backend(backend):
    """The full-attention backend inside a hybrid wrapper (what holds the verify mask)."""
    for _ in range(4):
        inner = getattr(backend, "full_attn_backend", None)
        if inner is None:
            return backend
        backend = inner
    return backend


@dataclass
class DDTreeVerifyInput(DFlashVerifyInput):
    """DFlash verify input carrying the tree links: SGLang's hybrid
    linear-attention backend reads ``spec_info.retrieve_next_token`` /
    ``retrieve_next_sibling`` in TARGET_VERIFY when ``topk > 1`` (tree path:
    each node reads its parent's conv window / SSM state)."""

    retrieve_index: Optional[torch.Tensor] = None
    retrieve_next_token: Optional[torch.Tensor] = None
    retrieve_next_sibling: Optional[torch.Tensor] = None


@dataclass
class _Draft:
    window: torch.Tensor  # [bs, w] KV locations req_to_token[prefix : prefix + w]
    hidden: torch.Tensor  # [bs, blk-1, H] the drafter's hidden states at the mask positions
    kv_loc_plan: Any = None  # the KV index translator's plan for the window (0.5.23); None where there is none


class DDTreeWorkerBase(DFlashWorkerV2):
    """DFlash v2 worker with DDTree tree verify; a version's subclass sets
    ``_ddtree_adapter`` and the ``_ddtree_*`` hooks (see the module docstring)."""

    _ddtree_adapter = None  # the version's adapter module

    def __init__(self, server_args, *args, **kwargs):
        super().__init__(server_args, *args, **kwargs)
        adapter = self._ddtree_adapter
        self._tree_verify_graphs = bool(adapter.TREE_VERIFY_CUDA_GRAPHS)
        self.ddtree = resolve_ddtree_config(server_args, os.environ, backends=adapter.attention_backends(server_args),
                                            tree_verify_cuda_graphs=self._tree_verify_graphs)
        common.set_active_mode(self.ddtree.mode)
        self._vocab_size = int(self.model_runner.model_config.vocab_size)
        self._sampling_bytes = max_bytes_from_env()
        self.shadow_stats = ShadowStats()
        self._shadow_log_every = int(os.environ.get(SHADOW_LOG_EVERY_ENV, "200") or 200)
        self._shadow_armed = False
        self._shadow_cands = None
        self._warned_unsupported = False
        self._verify_used_graph = False
        self.accept_stats = None
        self._graph_widths = None
        self._graph_buckets = ()  # the target's captured decode-graph batch sizes (init_cuda_graphs)
        self._bucket_widths_on = False  # each bucket's verify graph at its own width (0.5.17, a schedule)
        self._glue_build = self._glue_commit = None
        # SGLang's overlap scheduler (config.overlap_decision; the validator set disable_overlap_schedule)
        self._overlap = not bool(getattr(server_args, "disable_overlap_schedule", True))
        self._unsafe_chain_state = os.environ.get(UNSAFE_CHAIN_STATE_ENV) == "1"
        # chain entries as DFLASH's own step (where the adapter captured their graphs DFLASH's way)
        default = contract.CHAIN_STEP_DFLASH if getattr(adapter, "DFLASH_CHAIN_STEP", False) else \
            contract.CHAIN_STEP_PLUGIN
        self._chain_dflash = (self.ddtree.mode == TREE_VERIFY and self.ddtree.schedule is not None
                              and self.ddtree.schedule.has_chain and not self._unsafe_chain_state
                              and chain_step_from_env(default=default) == contract.CHAIN_STEP_DFLASH)
        self.chain_steps = dict.fromkeys(contract.CHAIN_STEPS, 0)  # chain-entry steps served by each
        if self._unsafe_chain_state:
            logger.warning("DDTREE: %s=1 - recurrent state is processed in CHAIN order (siblings leak into each "
                           "other). Outputs are WRONG on hybrid models; for the leak demonstration only.",
                           UNSAFE_CHAIN_STATE_ENV)
        self._ddtree_check_supported()
        if self.ddtree.mode == TREE_VERIFY:
            self._init_tree_verify()
            if self._tree_verify_graphs:
                self._ddtree_install_tree_mask_capture()
                if self.ddtree.schedule is not None:
                    self._ddtree_install_bucket_widths()
            self.accept_stats = TreeAcceptStats(int(self.block_size) - 1,
                                                int(os.environ.get(STATS_EVERY_ENV, "50") or 50))
            # The step's own glue, replayed from CUDA graphs per batch size (glue_graphs.py). One GPU only:
            # with tensor parallelism the drafter's top-K all-gathers across ranks, kept eager.
            # Level 2 (the default without recurrent layers, opt-in on hybrid targets): the FULL mask's scatter
            # index in graph 1 and, where the adapter knows the track interval up front, the recurrent commit's
            # indices in graph 2; graph 2 reads graph 1's outputs (tree links, ranks) in place (share).
            hybrid = self._target_has_recurrent_layers()
            level = glue_graph_level(recurrent=hybrid) if int(getattr(server_args, "tp_size", 1) or 1) == 1 else 0
            self._glue_build = GlueGraph("build", self._glue_build_fn, enabled=level >= 1, share=level >= 2)
            self._glue_commit = GlueGraph("accept_commit", self._glue_commit_fn, enabled=level >= 1,
                                          share=level >= 2)
            self._glue_full_index = level >= 2
            self._glue_track_interval = self._glue_track_interval_or_none() if level >= 2 else None
        else:
            self._glue_full_index, self._glue_track_interval = False, None
        logger.info("DDTreeWorker (SGLang %s adapter): %s, drafter block %d, %s scheduler%s", adapter.VERSION,
                    self.ddtree, int(self.block_size), "overlap" if self._overlap else "synchronous",
                    "" if self.ddtree.schedule is None or not self.ddtree.schedule.has_chain else
                    ", chain entries: " + ("DFLASH's own step in captured chain buckets "
                                           f"({CHAIN_STEP_ENV}={contract.CHAIN_STEP_DFLASH})"
                                           if self._chain_dflash else "the plugin's one-branch tree step"))

    # ----- init -------------------------------------------------------------
    def _target_has_recurrent_layers(self) -> bool:
        """Whether the target has Mamba/GDN layers, from its config (DFlash's ``_need_mamba_verify_commit`` is
        only set later, when the scheduler initialises the attention backends); unknown counts as hybrid."""
        try:
            return mambaish_config(self.model_runner.model_config) is not None
        except Exception as exc:  # noqa: BLE001 - a config SGLang cannot read: the conservative default
            logger.warning("DDTREE: cannot tell whether the target is hybrid (%s: %s); glue level 1 by default",
                           type(exc).__name__, exc)
            return True

    def _init_tree_verify(self) -> None:
        d = self.ddtree.num_draft_tokens
        # DFlash sized its block by --speculative-num-draft-tokens (= D, the tree width here);
        # the drafter keeps its own trained block width blk.
        blk = self.ddtree.drafter_block_size
        if blk is None:
            blk = self._ddtree_drafter_block(
                parse_dflash_draft_config(draft_hf_config=self.draft_model_runner.model_config.hf_config))
        if blk is None:
            raise ValueError(
                "DDTREE tree-verify needs the drafter's block width: set --speculative-dflash-block-size "
                "or use a drafter whose config declares block_size."
            )
        blk = int(blk)
        if self._overlap and blk > d:  # the validator keeps overlap off then; a hand-set flag must not slip by
            raise ValueError(
                f"DDTREE tree-verify under the overlap scheduler needs the drafter block ({blk}) <= D = {d}: the "
                "scheduler reserves 2*D KV slots from a committed length one step behind. Use a node budget "
                f"B >= {blk - 1} or --disable-overlap-schedule."
            )
        if not 2 <= blk <= 2 * d:
            raise ValueError(
                f"DDTREE drafter block {blk} must be in [2, 2*D = {2 * d}]: the scheduler reserves 2*D KV slots "
                "per request and step and the drafter writes its whole block there."
            )
        if self.ddtree.schedule is not None and self.ddtree.schedule.has_chain and blk > d:
            raise ValueError(f"DDTREE budget schedule {self.ddtree.schedule}: chain verifies the drafter block "
                             f"{blk}, wider than D = {d}; pass --speculative-dflash-block-size {blk}.")
        self.block_size = blk
        self._ddtree_set_drafter_block(blk)
        self._block_pos_offsets = build_block_pos_offsets(length=blk, device=self.device)
        self._draft_block_spec_info = make_draft_block_spec_info(draft_token_num=blk, device=self.device)
        self.speculative_num_draft_tokens = d

    def init_cuda_graphs(self):
        super().init_cuda_graphs()
        # The scheduler captured the target's graphs before this call (after __init__, which installed
        # the tree-mask capture policy where the adapter has one). Check that the captured verify graph
        # reads the tree mask: a graph captured causal would verify the tree as a chain (silently wrong),
        # so refuse to serve.
        if self.ddtree.mode == TREE_VERIFY and getattr(self.model_runner, "decode_cuda_graph_runner", None):
            if not self._tree_verify_graphs:
                raise RuntimeError(
                    f"DDTREE tree-verify found a target decode CUDA graph (SGLang {self._ddtree_adapter.VERSION} "
                    "captures it causal, topk=1); run with --cuda-graph-backend-decode disabled."
                )
            backend = _full_attn_backend(self.model_runner.attn_backend)
            if getattr(backend, "verify_mask", None) is None or not self._ddtree_tree_mask_capture_installed():
                raise RuntimeError(
                    "DDTREE tree-verify found a target decode CUDA graph captured without the tree-mask buffer "
                    f"({type(backend).__name__}); run with --cuda-graph-backend-decode disabled."
                )
            runner = self.model_runner.decode_cuda_graph_runner
            self._graph_widths = (int(runner.captured_req_width),
                                  getattr(getattr(self.draft_model_runner, "decode_cuda_graph_runner", None),
                                          "captured_req_width", None))
            self._graph_buckets = tuple(sorted(int(b) for b in getattr(runner, "capture_bs", ()) or ()))
            logger.info("DDTREE tree-verify: target verify graphs captured with the tree mask (width %d); "
                        "drafter graphs width %s, drafter block %d (%s)", self._graph_widths[0],
                        self._graph_widths[1], int(self.block_size),
                        "replayed" if self._graph_widths[1] == int(self.block_size) else "eager: widths differ")
            if self.ddtree.schedule is not None:
                logger.info("DDTREE budget schedule %s: verify graph width per batch-size bucket %s",
                            self.ddtree.schedule, self.bucket_widths())

    def _maybe_build_draft_sampler(self):
        # DDTREE needs the drafter's hidden states (per-position distributions), not the
        # greedy ids a sampler folded into the draft graph would produce.
        return None

    # ----- entry ----------------------------------------------------------------
    def _ddtree_forward(self, batch, on_publish, **passthrough):
        """The body of each version's ``forward_batch_generation`` (which has that release's
        signature and passes its other arguments through): prefill, idle and mixed batches are
        DFlash's; a decode batch is shadow-linear's or tree-verify's."""
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle():
            # the prefill-only logprob request admission lets through: the target's own forward scores it
            with logprobs_past_dflash(batch, self.target_worker):
                return super().forward_batch_generation(batch, on_publish=on_publish, **passthrough)
        if self.ddtree.mode == SHADOW_LINEAR:
            return self._forward_shadow(batch, on_publish, **passthrough)
        if self._chain_dflash and self._dflash_chain_step(batch):
            with record_function("ddtree.chain_dflash"):
                return super().forward_batch_generation(batch, on_publish=on_publish, **passthrough)
        return self._forward_tree_verify(batch, on_publish)

    def _dflash_chain_step(self, batch) -> bool:
        """Whether this decode step is SGLang's own DFLASH step: its batch's schedule entry is chain, the adapter
        captured that bucket's verify graph DFLASH's way (``_ddtree_dflash_chain_bucket``), and every request is
        greedy (DFLASH's step has no rejection sampling on every build; the plugin's chain step samples). The
        KV window, the drafter's KV and the recurrent state a DFLASH step leaves are what a tree step starts
        from, and the other way round: both commit the accepted tokens at the committed prefix."""
        bs = len(batch.seq_lens)
        if bs < 1 or not self._chain_at(self._ddtree_graph_bucket(bs)):
            return False
        si = batch.sampling_info
        dflash = (si is None or si.is_all_greedy) and self._ddtree_dflash_chain_bucket(bs)
        self.chain_steps[contract.CHAIN_STEP_DFLASH if dflash else contract.CHAIN_STEP_PLUGIN] += 1
        return dflash

    def _chain_at(self, batch: int) -> bool:
        """Whether the schedule's entry at batch size ``batch`` is chain."""
        return self.ddtree.schedule is not None and contract.budget_for(self.ddtree.schedule, int(batch)) == \
            contract.CHAIN

    def _ddtree_dflash_chain_bucket(self, bs: int) -> bool:
        """Whether a step of ``bs`` requests may be DFLASH's own step (this version: no; the plugin's chain)."""
        return False

    # ----- drafter candidates (vocab-parallel safe) ---------------------------
    def _draft_candidates(self, hidden_states: torch.Tensor, lm_head, k: int, chunk: int = 256):
        """Global-vocab top-``k`` log-probs / ids of the target LM head on the
        drafter's hidden states ``[R, H]`` -> ``([R, k] float64, [R, k] int64)``."""
        weight = self._ddtree_head_weight(lm_head)
        shard = getattr(lm_head, "shard_indices", None)
        if shard is None:
            start, num_org = 0, min(int(weight.shape[0]), self._vocab_size)
        else:
            if int(shard.num_added_elements) != 0:
                raise NotImplementedError("DDTREE does not support LoRA-added vocabulary in the lm_head.")
            start, num_org = int(shard.org_vocab_start_index), int(shard.num_org_elements)
        tp_group = self._ddtree_tp_group()
        tp = int(tp_group.world_size) if shard is not None else 1
        vals, ids, lses = [], [], []
        for a in range(0, hidden_states.shape[0], chunk):
            hs = hidden_states[a : a + chunk].to(weight.dtype)
            v, i, l = draft_topk_candidates(torch.matmul(hs, weight[:num_org].T), k, vocab_start=start)
            vals.append(v), ids.append(i), lses.append(l)
        # every rank merges the same gathered shards: the same candidates, hence the same tree (step's docstring)
        return tp_merged_candidates(torch.cat(vals), torch.cat(ids), torch.cat(lses), k, tp,
                                    tp_group.all_gather_into_tensor)

    # ----- shadow-linear: the drafter's candidates of DFlash's own chain step ------
    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        out = super()._greedy_sample_from_vocab_parallel_head(
            hidden_states=hidden_states, lm_head=lm_head, chunk_size=chunk_size
        )
        if self._shadow_armed:
            self._shadow_cands = self._draft_candidates(hidden_states, lm_head, min(self.ddtree.budget, self._vocab_size))
        return out

    # ----- tree-verify -------------------------------------------------------------
    def _unsupported_in_batch(self, batch) -> None:
        """Admission rejects these; if one got into a batch anyway (an admission path
        this adapter does not know), serve it with its plain sampling parameters and
        say so once instead of raising inside the scheduler loop. A request's features
        are fixed when it is admitted, so each request is looked at in its first step
        only (marked ``_ddtree_checked``): the scan costs the new requests of a step,
        not the whole batch every step."""
        if self._warned_unsupported:
            return
        for req in batch.reqs:
            if getattr(req, "_ddtree_checked", False):
                continue
            why = tree_verify_rejection(req)
            try:
                req._ddtree_checked = True
            except AttributeError:  # an object without a __dict__: looked at again next step
                pass
            if why:
                self._warned_unsupported = True
                logger.error("DDTREE: a request reached tree-verify unchecked (%s); serving it without "
                             "those features.", why)
                return

    def _forward_tree_verify(self, batch, on_publish):
        self._unsupported_in_batch(batch)
        if batch.spec_info is None:
            batch.spec_info = DFlashDraftInputV2.create_idle_input(device=self.device)
        # `seq_lens` may come from another stream (DFlash's own decode step records it the same way).
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        # record_function ranges name the step's phases in a torch-profiler trace (SGLang's /start_profile;
        # sglang_ddtree_tools.profile_step sums them); without a profiler they cost ~1 us each.
        with record_function("ddtree.draft"):
            draft = self._tree_draft(batch)
        with record_function("ddtree.tree_verify"):
            tree, vin, target_out, target_predict = self._tree_verify(batch, draft)
        with record_function("ddtree.accept"):
            d = int(vin.draft_token_num)
            window = draft.window[:, :d]
            draft_window_ids = self._ddtree_draft_window_ids(draft, window)
            greedy_predict = self._greedy_target_predict(batch, vin, target_out.logits_output, target_predict)
            if greedy_predict is not None:  # accept + counters + commit indices: one graph replay
                predict, accept_index, accept_num, counts, commit = self._glue_commit(
                    greedy_predict, vin.draft_token.view(-1, d), vin.retrieve_index, vin.retrieve_next_token,
                    vin.retrieve_next_sibling, tree.ranks, batch.seq_lens, window, draft_window_ids,
                    batch.req_pool_indices)
            else:
                predict, accept_index, accept_num = self._tree_sample_accept(batch, vin, target_out.logits_output)
                counts, commit = accept_commit(predict, accept_index, accept_num, tree.ranks, batch.seq_lens, window,
                                               draft_window_ids, self.accept_stats.max_depth,
                                               **self._recurrent_commit_args())
                self._write_window(batch.seq_lens, batch.req_pool_indices, commit.window_locs, d)
            totals = self.accept_stats.add(counts)
            if totals is not None and self._ddtree_tp_rank() == 0:
                totals["glue_graphs"] = {g.name: g.stats() for g in (self._glue_build, self._glue_commit)}
                if self.ddtree.schedule is not None and self.ddtree.schedule.has_chain:
                    totals["chain_steps"] = dict(self.chain_steps)
                logger.info("DDTREE accept stats %s", json.dumps(totals, sort_keys=True))
        with record_function("ddtree.commit"):
            result = self._tree_commit(batch, vin, target_out, commit, on_publish)
        self._shared_writes_done()
        return result

    def _greedy_target_predict(self, batch, vin, logits_output, target_predict=None):
        """The target's greedy ids ``[N, D]`` int64 where the batch is all greedy (else None: sampling)."""
        si = batch.sampling_info
        if not (target_predict is not None or si is None or si.is_all_greedy):
            return None
        bs, d = len(batch.seq_lens), int(vin.draft_token_num)
        if target_predict is None:
            target_predict = torch.argmax(logits_output.next_token_logits, dim=-1)
        target_predict = target_predict.view(bs, d).to(torch.int64)
        self._ddtree_sync_greedy(target_predict)
        return target_predict

    def _tree_draft(self, batch) -> _Draft:
        draft_input = batch.spec_info
        device, bs = self.device, len(batch.seq_lens)
        blk, d = int(self.block_size), self._step_width(bs)
        w = max(blk, d)  # within the 2*D slots reserved for the server's D (d <= D)
        prefix = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        # The step's KV window, reserved by the scheduler (2*D slots from the committed prefix).
        window = assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices,
            req_to_token=req_to_token,
            start_offset=prefix,
            end_offset=prefix + w,
            batch_size=bs,
            draft_token_num=w,
            device=device,
        ).view(bs, w)
        kv_loc_plan = self._ddtree_kv_loc_plan(batch, window, w)
        block_ids = torch.full((bs, blk), int(self._mask_token_id), dtype=torch.long, device=device)
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        positions = (prefix.unsqueeze(1).to(torch.int64) + self._block_pos_offsets).reshape(-1)
        embeds = self._ddtree_embed(block_ids)
        reserved_cpu, _ = self._ddtree_reserved_seq_lens(draft_input)
        if batch.seq_lens_cpu is not None:
            seq_lens_cpu = (batch.seq_lens_cpu + blk).to(torch.int32)
        elif reserved_cpu is not None:
            seq_lens_cpu = reserved_cpu.to(torch.int32)
        else:
            seq_lens_cpu = prefix.to("cpu", dtype=torch.int32)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            batch_size=bs,
            input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices,
            seq_lens=prefix,
            out_cache_loc=window[:, :blk].reshape(-1),
            seq_lens_sum=int(seq_lens_cpu.sum()),
            seq_lens_cpu=seq_lens_cpu,
            positions=positions,
            input_embeds=embeds.view(-1, embeds.shape[-1]),
            spec_algorithm=SpeculativeAlgorithm.DFLASH,
            spec_info=self._ddtree_draft_spec_info(batch, bs, blk),
            capture_hidden_mode=CaptureHiddenMode.NULL,
            **self._ddtree_draft_batch_extra(batch, bs, blk),
        )
        self._ddtree_bind_kv_loc_plan(kv_loc_plan, fb, blk)
        with torch.inference_mode(), record_function("ddtree.draft_forward"), self._ddtree_draft_tp():
            out = self.draft_model_runner.forward(fb)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE: the DFlash draft model returned no hidden states.")
        hidden = hidden[: bs * blk].view(bs, blk, -1)
        return _Draft(window=window, hidden=hidden[:, 1:, :], kv_loc_plan=kv_loc_plan)

    # ----- the step's glue (pure functions of tensors: replayed from CUDA graphs, glue_graphs.py) -----
    def _glue_build_fn(self, hidden, bonus, prefix):
        """Drafter hidden states -> global top-K per depth -> the tree -> its verify inputs (``QLEN_ONLY`` mask;
        the FULL layout's size depends on the prefix lengths and is written after, eagerly)."""
        bs, depths, h = hidden.shape
        budget, k = self._step_budget(bs)
        with record_function("ddtree.draft_topk"), self._ddtree_draft_tp():
            lp, ids = self._draft_candidates(hidden.reshape(-1, h), self._ddtree_lm_head(), k)
        return tree_verify_inputs(lp.view(bs, depths, k), ids.view(bs, depths, k), bonus, prefix,
                                  budget, self.ddtree.topk, full_index=self._glue_full_index)

    def _step_budget(self, bs: int):
        """``(B, K)`` of a step of ``bs`` requests (``step.step_budget``: the budget schedule's entry for the
        graph bucket ``bs`` pads to, so that a step has its bucket's verify width ``B + 1``; past the largest
        bucket, and without graphs, the entry for ``bs`` itself)."""
        return self._budget_at(self._ddtree_graph_bucket(int(bs)))

    def _budget_at(self, batch: int):
        """``(B, K)`` of the schedule's entry at batch size ``batch`` (the budget without a schedule)."""
        sched = self.ddtree.budget if self.ddtree.schedule is None else self.ddtree.schedule
        return step_budget(sched, batch, int(self.block_size), self._vocab_size)

    def _width_at(self, batch: int) -> int:
        """The verify width of the schedule's entry at batch size ``batch``."""
        return contract.tree_width(self._budget_at(int(batch))[0])

    def bucket_widths(self) -> dict:
        """``{bucket: verify width}`` of the target's captured graph buckets (empty without graphs)."""
        return {b: self._width_at(b) for b in (getattr(self, "_graph_buckets", None) or ())}

    def _ddtree_graph_bucket(self, bs: int) -> int:
        """The batch size whose schedule entry a step of ``bs`` requests uses (this version: ``bs``)."""
        return bs

    def _ddtree_install_bucket_widths(self) -> None:
        """Per-bucket verify graph widths for a schedule (this version: none; other widths run eagerly)."""

    def _step_width(self, bs: int) -> int:
        """The verify width D of a step of ``bs`` requests (the server's D without a schedule)."""
        return contract.tree_width(self._step_budget(bs)[0])

    def _glue_commit_fn(self, target_predict, candidates, retrieve_index, retrieve_next_token,
                        retrieve_next_sibling, ranks, prefix, window, draft_window_ids, req_pool_indices):
        """Greedy tree accept (SGLang's kernel), the accept counters and every commit index, and the accepted
        path's KV window written to ``req_to_token`` (idempotent: a re-run writes the same values)."""
        bs, d = ranks.shape
        device = ranks.device
        m = min(int(self.block_size) - 1, d - 1) + 1  # = compile's max_tree_depth + 1 (this step's B = d - 1)
        predict = torch.zeros((bs * d,), dtype=torch.int32, device=device)
        accept_index = torch.full((bs, m), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros((bs,), dtype=torch.int32, device=device)
        predict, accept_index, accept_num = self._ddtree_verify_tree_greedy(
            predicts=predict,
            accept_index=accept_index,
            accept_token_num=accept_num,
            candidates=candidates,
            retrieve_index=retrieve_index,
            retrieve_next_token=retrieve_next_token,
            retrieve_next_sibling=retrieve_next_sibling,
            target_predict=target_predict,
            topk=int(self.ddtree.topk),
        )
        counts, c = accept_commit(predict, accept_index, accept_num, ranks, prefix, window, draft_window_ids,
                                  self.accept_stats.max_depth, **self._recurrent_commit_args())
        self._write_window(prefix, req_pool_indices, c.window_locs, d)
        return predict, accept_index, accept_num, counts, c

    def _glue_track_interval_or_none(self):
        """The adapter's start-time track interval; None (the indices stay in the commit) where it cannot say."""
        try:
            return self._ddtree_glue_track_interval()
        except (ValueError, AttributeError, TypeError) as exc:  # e.g. SGLang's config bag not published yet
            logger.warning("DDTREE glue level 2: no track interval at start (%s: %s); the recurrent commit's "
                           "indices stay in the commit", type(exc).__name__, exc)
            return None

    def _recurrent_commit_args(self) -> dict:
        """accept_commit's recurrent-index arguments: computed in the accept (glue graph 2) when the glue level
        and the adapter allow it (``_glue_track_interval`` not None) and the target has recurrent layers."""
        if self._glue_track_interval is None or not self._need_mamba_verify_commit:
            return {}
        return {"recurrent": True, "track_interval": int(self._glue_track_interval)}

    def _write_window(self, prefix, req_pool_indices, window_locs, d: int) -> None:
        """The accepted path becomes the sequence: the step's permuted window into req_to_token."""
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        cols = prefix.to(torch.int64).unsqueeze(1) + torch.arange(d, device=prefix.device).unsqueeze(0)
        req_to_token[req_pool_indices.to(torch.int64).unsqueeze(1), cols] = window_locs.to(req_to_token.dtype)

    def _tree_verify(self, batch, draft: _Draft):
        """Tree over the candidates -> compiled verify inputs -> one target verify forward.
        Returns the tree, the compiled inputs, the target's output and, where the adapter
        finished a deferred vocab shard by argmax, the target's greedy ids (else None)."""
        draft_input = batch.spec_info
        bs = len(batch.seq_lens)
        d = self._step_width(bs)  # this batch size's width (the schedule's; the server's D without one)
        with record_function("ddtree.tree_build"):  # drafter top-K, tree, verify inputs: one graph replay
            tree, vin = self._glue_build(draft.hidden, draft_input.bonus_tokens, batch.seq_lens)
        with record_function("ddtree.compile"):
            vin = with_full_mask(vin, batch.seq_lens, self._host_prefix_sum(batch, draft_input))
            assert vin.draft_token_num == d
            verify_input = DDTreeVerifyInput(
                draft_token=vin.draft_token,
                positions=vin.positions,
                draft_token_num=d,
                topk=vin.topk,
                custom_mask=vin.custom_mask,
                capture_hidden_mode=CaptureHiddenMode.FULL,
                retrieve_index=vin.retrieve_index,
                retrieve_next_token=None if self._unsafe_chain_state else vin.retrieve_next_token,
                retrieve_next_sibling=None if self._unsafe_chain_state else vin.retrieve_next_sibling,
                **self._ddtree_verify_input_extra(draft, d),
            )
        batch.out_cache_loc = draft.window[:, :d].reshape(-1)
        # The recurrent commit's chain-order track steps start from these lengths (not needed where the accept
        # computes them from the same prefix: glue level 2)
        self._seq_lens_pre_verify = batch.seq_lens.clone() \
            if self._need_mamba_verify_commit and self._glue_track_interval is None else None
        cpu_backup, sum_backup = batch.seq_lens_cpu, batch.seq_lens_sum
        reserved_cpu, reserved_sum = self._ddtree_reserved_seq_lens(draft_input)
        if cpu_backup is not None:
            batch.seq_lens_cpu = cpu_backup + d  # host bound: committed prefix + the verify width
            batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())
        elif reserved_cpu is not None:
            batch.seq_lens_cpu = reserved_cpu
            batch.seq_lens_sum = int(reserved_sum)
        # With graphs on, prepare_for_verify loads the captured verify graph's buffers: the Triton backend
        # copies vin.custom_mask into its mask buffer and the hybrid backend the retrieve_* links (the
        # graph was captured with both, see the adapter's tree-mask capture); else eager metadata.
        with record_function("ddtree.verify_forward"):
            verify_fb, can_run_graph = verify_input.prepare_for_verify(batch, self.target_worker)
            batch.seq_lens_cpu, batch.seq_lens_sum = cpu_backup, sum_backup
            if not self._tree_verify_graphs:  # no tree-mask capture in this release: never replay
                if can_run_graph:
                    raise RuntimeError("DDTREE tree-verify must not replay a decode CUDA graph (causal mask capture).")
                verify_fb.can_run_decode_cuda_graph = False
            out = self.target_worker.forward_batch_generation(
                batch=None, forward_batch=verify_fb, is_verify=True, skip_attn_backend_init=True
            )
        self._verify_used_graph = bool(out.can_run_cuda_graph)
        target_predict = self._ddtree_finish_verify_logits(batch, out.logits_output)
        return tree, vin, out, target_predict

    def _host_prefix_sum(self, batch, draft_input) -> Optional[int]:
        """The FULL mask's size needs ``sum(prefix)`` on the host: the batch's host lengths where the scheduler
        gives them (exact; under overlap too, with the Triton backend), else the scheduler's reservation (an
        upper bound: the layout is indexed from the device lengths, a longer buffer is only unused at its
        end); None only when neither exists (then one device sync)."""
        if batch.seq_lens_cpu is not None:
            total = batch.seq_lens_sum
            return int(batch.seq_lens_cpu.sum()) if total is None else int(total)
        _, reserved_sum = self._ddtree_reserved_seq_lens(draft_input)
        return None if reserved_sum is None else int(reserved_sum)

    def _shared_writes_done(self) -> None:
        """Under the overlap scheduler: where the step's last write to a pool the scheduler shares is.

        After a launch the scheduler orders its own stream's later work (freeing finished requests' KV tails and
        state slots, allocating the next step's slots, handing request slots to new requests: reads and writes
        of ``req_to_token`` and the pools) only behind the target runner's read-done event, which SGLang records
        at the verify graph's load - before this step writes the accepted path's window into ``req_to_token``
        (the accept's glue), the recurrent state and the drafter's KV (the commit). A request that finished in the
        last step is still in this batch (overlap learns it one step late), so the scheduler may free its tail
        while this step permutes it: the event is moved to the end of the step. The host never waits on it; the
        scheduler's stream starts its GPU work later, behind this step's last kernel, which is where the next
        step's forward (on the same stream) starts anyway."""
        if not self._overlap:
            return
        runner = self.target_worker.model_runner
        if not hasattr(runner, "war_fastpath_read_done_event"):
            return
        ev = torch.get_device_module(self.device).Event()
        ev.record()
        runner.war_fastpath_read_done_event = ev

    def _tree_sample_accept(self, batch, vin, logits_output):
        """SGLang's target-only tree sampling (zero draft probabilities: lossless), in bounded-memory groups.
        A greedy batch is accepted by :meth:`_glue_commit_fn` instead."""
        bs, d = len(batch.seq_lens), int(vin.draft_token_num)
        device = self.device
        candidates = vin.draft_token.view(bs, d)
        m = vin.max_tree_depth + 1
        predict = torch.zeros((bs * d,), dtype=torch.int32, device=device)
        accept_index = torch.full((bs, m), -1, dtype=torch.int32, device=device)
        accept_num = torch.zeros((bs,), dtype=torch.int32, device=device)
        si = batch.sampling_info
        logits = logits_output.next_token_logits
        verify_coins, kernel, top_k_renorm, top_p_renorm = self._ddtree_sampling_ops()
        coins, coins_final = verify_coins(
            sampling_info=si, seq_lens=batch.seq_lens, draft_token_num=d, candidates=candidates, device=device
        )
        sample_tree_accept(
            logits=logits,
            d=d,
            temperatures=si.temperatures,
            top_ks=si.top_ks if si.need_top_k_sampling else None,
            top_ps=si.top_ps if si.need_top_p_sampling else None,
            min_ps=si.min_ps if si.need_min_p_sampling else None,
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
            max_bytes=self._sampling_bytes,
        )
        self._ddtree_sync_sampled(predict, accept_index, accept_num)
        return predict, accept_index, accept_num

    def _commit_tree_recurrent_state(self, batch, seq_lens_pre, seq_lens_post, commit_lens, slots, length,
                                     state_step=None, track_steps=None) -> None:
        """Commit the recurrent state of each request's deepest accepted node (and the tracked
        states where a track boundary falls inside the accepted path). ``state_step`` / ``track_steps``: those
        indices as the accept computed them (``StepCommit.recurrent_step`` / ``track_steps``), else here."""
        backend = self.target_worker.model_runner.attn_backend
        steps_to_track = None
        if seq_lens_pre is None:  # not kept where the accept computes the indices (glue level 2): the same lengths
            seq_lens_pre = seq_lens_post - commit_lens.to(seq_lens_post.dtype)
        if batch.mamba_track_indices is not None:
            steps_to_track = track_steps if track_steps is not None else mamba_track_steps(
                seq_lens_pre, seq_lens_post, commit_lens, self._ddtree_mamba_track_interval(batch), slots, length,
            )
        backend.update_mamba_state_after_mtp_verify(
            last_correct_step_indices=state_step if state_step is not None else recurrent_state_step(slots, length),
            mamba_track_indices=batch.mamba_track_indices,
            mamba_steps_to_track=steps_to_track,
            model=self.target_worker.model_runner.model,
            req_pool_indices=batch.req_pool_indices[: commit_lens.shape[0]],
        )

    def _tree_commit(self, batch, vin, target_out, c, on_publish):
        """The accepted path becomes the sequence (its KV window already written by the accept step; recurrent
        state, drafter KV append) and the DFlash-shaped result. ``c``: the step's ``StepCommit``."""
        prefix = batch.seq_lens
        logits_output = target_out.logits_output
        # What leaves the step (the scheduler keeps it past the next step) must not live in a glue graph's
        # buffers, which the next replay overwrites.
        out_tokens, commit_lens, bonus = c.out_tokens.clone(), c.commit_lens.clone(), c.bonus.clone()
        new_seq_lens = c.new_seq_lens.to(prefix.dtype, copy=True)

        if self._need_mamba_verify_commit:
            with record_function("ddtree.commit_recurrent_state"):
                self._ddtree_commit_recurrent_state(batch, new_seq_lens, c)
        if on_publish is not None:
            on_publish(new_seq_lens)

        hidden = logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DDTREE verify requires target hidden states, but got None.")
        with record_function("ddtree.commit_draft_kv"):
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hidden.index_select(0, c.append_rows),
                cache_loc=c.append_cache_loc_2d.reshape(-1),
                cache_loc_2d=c.append_cache_loc_2d,
                positions=c.append_positions,
                commit_lens=c.commit_lens,
            )
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=out_tokens.reshape(-1),
            accept_lens=commit_lens,
            can_run_cuda_graph=self._verify_used_graph,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=int(vin.draft_token_num),
            new_seq_lens=new_seq_lens,
            **self._ddtree_result_extra(target_out),
        )
