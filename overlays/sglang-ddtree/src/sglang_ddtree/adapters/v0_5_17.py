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


def handle_server_args(self, server_args) -> None:
    """What 0.5.17's DFLASH handler does beyond DDTREE's validator: resolve the
    drafter's attention backend (the draft worker reads it)."""
    from sglang.srt.arg_groups.speculative_hook import _resolve_dflash_draft_attention_backend

    _resolve_dflash_draft_attention_backend(server_args)


def make_spec_class():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from .common import spec_class

    return spec_class(CustomSpecAlgo, SpeculativeAlgorithm, {"handle_server_args": handle_server_args})


def worker_factory(server_args):
    from .v0_5_17_worker import DDTreeWorker

    return DDTreeWorker
