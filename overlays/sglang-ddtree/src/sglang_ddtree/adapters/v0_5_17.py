"""SGLang 0.5.17 adapter: registration glue (CPU-safe; the worker is the shared
:mod:`sglang_ddtree.adapters.worker` with 0.5.17's hooks in
:mod:`sglang_ddtree.adapters.v0_5_17_worker`).

0.5.17 specifics: server arguments are plain attributes (``resolved_view``
gives the values resolved so far); the builtin DFLASH handler (which a plugin
algorithm does not get) also resolves the drafter's attention backend, so
DDTREE's ``handle_server_args`` does the same with 0.5.17's own helper.
"""

from __future__ import annotations

from ..capabilities import load_capabilities as _caps

VERSION = "0.5.17"
# Whether tree-verify may run under decode CUDA graphs with this release (capabilities.json says it per version).
TREE_VERIFY_CUDA_GRAPHS = bool(_caps()["per_version"][VERSION].get("tree_verify_cuda_graphs", False))
# Whether tree-verify may run under SGLang's overlap scheduler (DFLASH's default) with this release.
OVERLAP_SCHEDULE = bool(_caps()["per_version"][VERSION].get("overlap_schedule", False))
# Whether a budget schedule's chain entries are SGLang's own DFLASH step by default with this release (the worker's
# SGLANG_DDTREE_CHAIN_STEP overrides it): on once a GPU run has served it lossless.
DFLASH_CHAIN_STEP = bool(_caps()["per_version"][VERSION].get("dflash_chain_step", False))


def attention_backends(server_args) -> dict:
    """The attention backends as resolved so far (SGLang resolves them before
    the speculative hooks run)."""
    try:
        from sglang.srt.arg_groups.overrides import resolved_view

        view = resolved_view(server_args)
    except Exception:  # a plain namespace in tests, or a record without declarations
        view = server_args
    return {k: getattr(view, k, None) for k in (
        "attention_backend", "decode_attention_backend", "prefill_attention_backend",
        "speculative_draft_attention_backend")}


def drafter_block_size(server_args):
    """The DFlash drafter's block width from its config (as 0.5.17's DFLASH handler reads it); None when the
    config cannot be read here (the validator then keeps tree-verify off the overlap scheduler)."""
    try:
        from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
        from sglang.srt.utils.hf_transformers_utils import get_config

        cfg = get_config(server_args.speculative_draft_model_path,
                         trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
                         revision=getattr(server_args, "speculative_draft_model_revision", None))
        blk = parse_dflash_draft_config(draft_hf_config=cfg).resolve_block_size(default=None)
        return None if blk is None else int(blk)
    except Exception as exc:  # noqa: BLE001 - unknown block: overlap stays off, with the reason logged
        import logging

        logging.getLogger(__name__).warning("DDTREE: cannot read the drafter's block width (%s: %s)",
                                            type(exc).__name__, exc)
        return None


def handle_server_args(self, server_args) -> None:
    """What 0.5.17's DFLASH handler does beyond DDTREE's validator: resolve the
    drafter's attention backend (the draft worker reads it)."""
    from sglang.srt.arg_groups.speculative_hook import _resolve_dflash_draft_attention_backend

    _resolve_dflash_draft_attention_backend(server_args)


# The drafter's graph width. SGLang captures the draft model's decode graphs at the target's verify width
# (D = B + 1 for DDTREE), so a block-16 drafter under B = 31 ran eagerly (~25 launches a step). The worker sets
# this to its drafter block before the graphs are captured (init_cuda_graphs), only when blk <= D: buffers
# sized earlier at D then hold the blk-wide graph too.
DRAFTER_GRAPH_WIDTH = {"value": None}


def num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
    """SpeculativeAlgorithm's hook: the target verifies D tokens a request; the drafter runs its own block."""
    w = DRAFTER_GRAPH_WIDTH["value"]
    if is_draft_worker and w is not None and 1 <= int(w) <= int(num_draft_tokens):
        return int(w)
    return int(num_draft_tokens)


def make_spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from .common import spec_class

    return spec_class(CustomSpecAlgo, SpeculativeAlgorithm, {
        "handle_server_args": handle_server_args,
        "get_num_tokens_per_req_for_target_verify": num_tokens_per_req_for_target_verify})
