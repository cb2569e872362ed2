"""Each decode CUDA-graph bucket of the target verified at its own width (SGLang 0.5.17): a budget schedule's
steps replay graphs at every batch size.

SGLang 0.5.17's decode graph runner captures every batch-size bucket at one width, ``captured_req_width`` (the
server's ``D``), and replays a verify forward only when the batch's width equals it (``can_run_graph``'s
uniform-width check). A budget schedule verifies a step of ``bs`` requests at its own width ``B(bs) + 1``, so
without this module every step whose budget is not the largest runs the target's verify forward eagerly.

:func:`install` makes the runner's width a function of the bucket instead, for the target's TARGET_VERIFY runner
in this process only (the drafter's runner and every other process are untouched): each bucket ``b`` is captured,
admitted and replayed at ``width_of(b)``. The number of graphs is the same as before (one per bucket); each is
captured with the spec info, buffers and attention metadata of its own width. The worker picks a step's budget
by the bucket its batch pads to (``DDTreeWorker._step_budget``), so a step always has its bucket's width.

What reads the width, and how each part gets the bucket's:

* the runner (``capture_one_shape``, ``can_run_graph``, ``load_batch``) reads ``self.captured_req_width`` for the
  token count, the capture's spec info (``draft_token_num``) and the admission check: it is set to the bucket's
  width for the duration of each call (:func:`_bucket_width`) and restored after;
* the Triton attention backend takes the verify width from the spec info's ``draft_token_num`` at capture and at
  replay (its buffers are sized for the largest width);
* the hybrid linear-attention backend (GDN/Mamba layers) builds its verify ``query_start_loc`` from one arange
  of step ``D`` and sizes its per-bucket ``retrieve_*`` buffers ``[b, D]``: :func:`_init_state` gives every
  bucket buffers of its own width and one arange per width, and the metadata calls read the arange of the spec
  info's width.

A schedule's ``chain`` buckets (``is_chain(b)``) are SGLang's own DFLASH steps (the worker hands them to
``DFlashWorkerV2.forward_batch_generation``), so their graphs are captured the way DFLASH captures them, and stay
right when a DFLASH step replays them:

* the Triton backend's verify graph is captured causal (the mask policy's own answer, :func:`capturing_chain`),
  not with the tree-mask buffer: DFLASH's verify input carries no mask, so a captured mask buffer would be read
  with whatever mask the last tree step left there;
* the hybrid backend's tree-link buffers of a chain bucket hold the chain's links (each slot's child is the next
  slot, no siblings) from the start: DFLASH's verify input carries no links and its replays leave the buffers as
  they are, so the recurrent layers read the chain's order, each slot starting from the previous one's state.

``SGLANG_DDTREE_BUCKET_WIDTHS=0`` (:data:`ENV`) keeps SGLang's one width (steps at other widths run eagerly).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Callable, Iterable, Optional

import torch

logger = logging.getLogger(__name__)

ENV = "SGLANG_DDTREE_BUCKET_WIDTHS"

# width_of(bucket) -> D of that bucket; widths: every width it can answer; is_chain(bucket): the bucket's entry is
# chain (a DFLASH step); capturing: the bucket whose graph is being captured; None when not installed
_STATE = {"width_of": None, "widths": (), "is_chain": None, "capturing": None, "installed": False}


def enabled(environ=os.environ) -> bool:
    """Whether per-bucket widths are wanted (default yes; ``SGLANG_DDTREE_BUCKET_WIDTHS=0`` turns them off)."""
    value = str(environ.get(ENV, "1")).strip().lower()
    if value not in ("0", "1", "", "true", "false", "on", "off"):
        raise ValueError(f"{ENV}={environ.get(ENV)!r} must be 0 or 1")
    return value not in ("0", "false", "off")


def install(width_of: Callable[[int], int], widths: Iterable[int],
            is_chain: Optional[Callable[[int], bool]] = None) -> None:
    """Capture, admit and replay each target verify bucket ``b`` at ``width_of(b)`` (idempotent; the last call's
    functions apply). ``widths`` lists every width ``width_of`` answers (the hybrid backend's aranges);
    ``is_chain(b)``: bucket ``b`` runs DFLASH's own chain step (captured as DFLASH captures it; none without it)."""
    widths = tuple(sorted({int(w) for w in widths}))
    if not widths or widths[0] < 1:
        raise ValueError(f"bucket widths must be >= 1, got {widths}")
    _STATE["width_of"], _STATE["widths"], _STATE["is_chain"] = width_of, widths, is_chain
    if _STATE["installed"]:
        return
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    for cls, name, wrapper in (
        (DecodeCudaGraphRunner, "capture_one_shape", _wrap_capture_one_shape),
        (DecodeCudaGraphRunner, "can_run_graph", _wrap_batch_call),
        (DecodeCudaGraphRunner, "load_batch", _wrap_batch_call),
        (MambaAttnBackendBase, "init_cuda_graph_state", _wrap_init_state),
        (MambaAttnBackendBase, "_capture_metadata", _wrap_metadata),
        (MambaAttnBackendBase, "_replay_metadata", _wrap_metadata),
    ):
        original = getattr(cls, name)
        patched = wrapper(original)
        patched.__wrapped__ = original
        patched._ddtree_bucket_widths = True
        setattr(cls, name, patched)
    _STATE["installed"] = True


def uninstall() -> None:
    """Put SGLang's own methods back (tests)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import MambaAttnBackendBase
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    for cls in (DecodeCudaGraphRunner, MambaAttnBackendBase):
        for name, value in list(vars(cls).items()):
            if getattr(value, "_ddtree_bucket_widths", False):
                setattr(cls, name, value.__wrapped__)
    _STATE.update(width_of=None, widths=(), is_chain=None, capturing=None, installed=False)


def installed() -> bool:
    return bool(_STATE["installed"] and _STATE["width_of"] is not None)


def is_chain_bucket(bucket: Optional[int]) -> bool:
    """Whether captured bucket ``bucket`` is a chain bucket (DFLASH's step, captured as DFLASH captures it)."""
    is_chain = _STATE["is_chain"]
    return bool(installed() and is_chain is not None and bucket is not None and is_chain(int(bucket)))


def capturing_chain() -> bool:
    """Whether the target verify graph being captured now is a chain bucket's (the mask policy answers DFLASH's
    own way for it: causal on backends that express a chain causally)."""
    return is_chain_bucket(_STATE["capturing"])


# ----- the runner ---------------------------------------------------------------------------------------------
def _applies(runner) -> bool:
    """Only the target's TARGET_VERIFY runner, uniform (not ragged) capture, no DP-attention gather."""
    if _STATE["width_of"] is None:
        return False
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    mr = runner.model_runner
    return (not getattr(mr, "is_draft_worker", False)
            and runner.capture_forward_mode == ForwardMode.TARGET_VERIFY
            and not getattr(runner, "ragged_verify_mode", False)
            and not getattr(runner, "require_mlp_tp_gather", False))


def bucket_of(runner, bs: int) -> Optional[int]:
    """The captured bucket a batch of ``bs`` requests pads to; None past the largest (no graph: eager)."""
    buckets = runner.capture_bs
    if bs < 1 or bs > max(buckets):
        return None
    return min(b for b in buckets if b >= bs)


@contextlib.contextmanager
def _bucket_width(runner, bucket: Optional[int]):
    """``runner.captured_req_width`` = the bucket's width for the duration of one call."""
    if bucket is None or not _applies(runner):
        yield
        return
    own = runner.captured_req_width
    w = int(_STATE["width_of"](int(bucket)))
    if not 1 <= w <= own:  # buffers, KV reservation and masks are sized for the server's D
        raise RuntimeError(f"DDTREE bucket width {w} at batch size {bucket} is outside [1, D = {own}]")
    runner.captured_req_width = w
    try:
        yield
    finally:
        runner.captured_req_width = own


def _wrap_capture_one_shape(original):
    @functools.wraps(original)
    def capture_one_shape(self, size, *args, **kwargs):
        _STATE["capturing"] = int(size) if _applies(self) else None
        try:
            with _bucket_width(self, int(size)):
                return original(self, size, *args, **kwargs)
        finally:
            _STATE["capturing"] = None
    return capture_one_shape


def _wrap_batch_call(original):
    @functools.wraps(original)
    def call(self, forward_batch, *args, **kwargs):
        bucket = bucket_of(self, int(forward_batch.batch_size)) if _applies(self) else None
        with _bucket_width(self, bucket):
            return original(self, forward_batch, *args, **kwargs)
    return call


# ----- the hybrid linear-attention backend --------------------------------------------------------------------
def _wrap_init_state(original):
    @functools.wraps(original)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        original(self, max_bs, max_num_tokens)
        width_of = _STATE["width_of"]
        if width_of is None:
            return
        d = max_num_tokens // max_bs
        qsl = self.cached_cuda_graph_verify_query_start_loc
        self._ddtree_verify_qsl = {d: qsl}
        for w in _STATE["widths"]:
            if w != d and w <= d:
                self._ddtree_verify_qsl[w] = torch.arange(0, max_bs * w + 1, step=w, dtype=qsl.dtype,
                                                          device=qsl.device)
        # each bucket's tree links at its own width (the captured graph reads them by pointer)
        for i in range(max_bs):
            w = int(width_of(i + 1))
            if w < d:
                for name in ("retrieve_next_token_list", "retrieve_next_sibling_list", "retrieve_parent_token_list"):
                    lst = getattr(self, name, None)
                    if lst is not None and i < len(lst):
                        lst[i] = torch.zeros((i + 1, w), dtype=lst[i].dtype, device=lst[i].device)
            if w <= d and is_chain_bucket(i + 1):  # DFLASH's replays never write them: the chain's links for good
                nxt = getattr(self, "retrieve_next_token_list", None)
                sib = getattr(self, "retrieve_next_sibling_list", None)
                if nxt is not None and sib is not None and i < len(nxt) and i < len(sib):
                    nxt[i].copy_(chain_links(i + 1, w, nxt[i].dtype, nxt[i].device))
                    sib[i].fill_(-1)
    return init_cuda_graph_state


def chain_links(rows: int, width: int, dtype=torch.int64, device="cpu") -> torch.Tensor:
    """``retrieve_next_token`` of ``rows`` chains of ``width`` slots: slot ``j``'s child is ``j + 1``, the last
    slot has none (-1); a chain's ``retrieve_next_sibling`` is all -1."""
    row = torch.arange(1, width + 1, dtype=dtype, device=device)
    row[-1] = -1
    return row.expand(rows, width).clone()


def _wrap_metadata(original):
    @functools.wraps(original)
    def metadata(self, bs, req_pool_indices, forward_mode, spec_info, *args, **kwargs):
        table = getattr(self, "_ddtree_verify_qsl", None)
        w = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        if table is None or w is None or not forward_mode.is_target_verify() or int(w) not in table:
            return original(self, bs, req_pool_indices, forward_mode, spec_info, *args, **kwargs)
        own = self.cached_cuda_graph_verify_query_start_loc
        self.cached_cuda_graph_verify_query_start_loc = table[int(w)]
        try:
            return original(self, bs, req_pool_indices, forward_mode, spec_info, *args, **kwargs)
        finally:
            self.cached_cuda_graph_verify_query_start_loc = own
    return metadata
