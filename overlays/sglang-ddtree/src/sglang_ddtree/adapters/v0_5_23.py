"""SGLang 0.5.23 adapter: registration glue (CPU-safe; the worker is the shared
:mod:`sglang_ddtree.adapters.worker` with 0.5.23's hooks in
:mod:`sglang_ddtree.adapters.v0_5_23_worker`).

0.5.23 specifics: server arguments resolve through a record (``resolving_view``
/ ``resolved_view``); a plugin's hooks get a stand-in whose assignments are
recorded as declared resolutions.  0.5.23 pins torch 2.14.1, so this adapter
cannot run on the fleet's torch 2.11.0 hosts; it is tested on CPU only.
"""

from __future__ import annotations

from ..capabilities import load_capabilities as _caps

VERSION = "0.5.23"
# Whether tree-verify may run under decode CUDA graphs with this release (capabilities.json says it per version).
TREE_VERIFY_CUDA_GRAPHS = bool(_caps()["per_version"][VERSION].get("tree_verify_cuda_graphs", False))
# Tree-verify under the overlap scheduler: not with this release (never served on a GPU; capabilities.json).
OVERLAP_SCHEDULE = bool(_caps()["per_version"][VERSION].get("overlap_schedule", False))
# Whether a budget schedule's chain entries are SGLang's own DFLASH step by default with this release (the worker's
# SGLANG_DDTREE_CHAIN_STEP overrides it): on once a GPU run has served it lossless.
DFLASH_CHAIN_STEP = bool(_caps()["per_version"][VERSION].get("dflash_chain_step", False))


def drafter_block_size(server_args):
    """Not needed while OVERLAP_SCHEDULE is off for this release (the validator asks only in tree-verify)."""
    return None


def attention_backends(server_args) -> dict:
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view

        view = resolved_view(server_args)
    except Exception:  # the validator's stand-in, or a plain namespace in tests
        view = server_args
    return {k: getattr(view, k, None) for k in (
        "attention_backend", "decode_attention_backend", "prefill_attention_backend",
        "speculative_draft_attention_backend")}


def handle_server_args(self, server_args) -> None:
    """The drafter's attention backend (the builtin DFLASH handler resolves it; a
    plugin algorithm does not get that handler): Triton unless given, the one
    backend DDTREE's tree-verify supports and one DFlash's drafter supports."""
    if getattr(server_args, "speculative_draft_attention_backend", None) is None:
        server_args.speculative_draft_attention_backend = "triton"


def _max_draft_tokens(self, server_args):
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args).speculative_num_draft_tokens


def make_spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from .common import spec_class

    return spec_class(CustomSpecAlgo, SpeculativeAlgorithm, {
        "handle_server_args": handle_server_args,
        "supports_prefill_shared_read_done": lambda self: True,
        "resolve_max_speculative_num_draft_tokens": _max_draft_tokens,
    })
