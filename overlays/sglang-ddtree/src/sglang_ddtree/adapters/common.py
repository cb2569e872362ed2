"""Registration glue shared by every adapter (imports SGLang lazily, CPU-safe).

* :func:`spec_class` - the ``CustomSpecAlgo`` subclass SGLang dispatches on.  It
  answers like the DFLASH family (``is_dflash()`` ...), so the scheduler and
  model runner apply the DFlash plumbing the DDTree worker (a DFlash v2
  subclass) relies on, and it carries every other method the builtin
  ``SpeculativeAlgorithm`` has and ``CustomSpecAlgo`` lacks (SGLang 0.5.17 and
  0.5.23 call ``carries_draft_hidden_states()``, ``create_future_map()`` and
  ``need_topk()`` at startup; ``CustomSpecAlgo`` has none of them): those are
  the builtin's own methods, evaluated on DDTREE's ``is_*()`` answers, so they
  give what they give for DFLASH.
* :func:`make_validator` - the ``validate_server_args`` hook.
* admission - an AROUND hook on SGLang's ``validate_dflash_request`` (the check
  the scheduler runs on every new request of a DFLASH-family server) that adds
  DDTREE's rules (:mod:`sglang_ddtree.admission`), so a request tree-verify
  cannot serve is finished alone with an error before it joins a batch, and
  admits the prefill-only logprob request SGLang 0.5.17's DFLASH refuses.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Callable, Optional

from ..admission import dflash_verdict, rejection
from ..config import ALGORITHM_NAME, TREE_VERIFY, overlap_decision, resolve_ddtree_config, server_arg_writes
from . import load_worker

logger = logging.getLogger(__name__)

ADMISSION_TARGET = "sglang.srt.speculative.dflash_utils.validate_dflash_request"

# The DDTREE mode of the worker living in this process (set when SGLang builds it,
# in the scheduler process that also admits requests); None: no DDTREE worker here.
_ACTIVE_MODE: Optional[str] = None


def set_active_mode(mode: Optional[str]) -> None:
    global _ACTIVE_MODE
    _ACTIVE_MODE = mode


def admission_after_hook(result, req, *args, **kwargs):
    """HookType.AFTER on ``validate_dflash_request(req, enable_overlap)``: keep
    SGLang's own verdict (but admit the prefill-only logprob request, the
    target's own forward: admission.dflash_verdict), else DDTREE's (None on
    non-DDTREE servers)."""
    overlap = bool(args[0] if args else kwargs.get("enable_overlap", False))
    result = dflash_verdict(result, req, overlap)
    if result is not None:
        return result
    return rejection(_ACTIVE_MODE, req)


def admission_around_hook(original, req, *args, **kwargs):
    """HookType.AROUND on ``validate_dflash_request`` (what ``register`` installs): SGLang's verdict through
    ``admission_after_hook``. AROUND, not AFTER: SGLang keeps the original result where an AFTER hook returns
    None, so an AFTER hook cannot lift SGLang 0.5.17's refusal of the prefill-only logprob request."""
    return admission_after_hook(original(req, *args, **kwargs), req, *args, **kwargs)


def missing_enum_methods(custom_cls: type, enum_cls: type) -> list[str]:
    """Public methods of the builtin ``SpeculativeAlgorithm`` that ``custom_cls`` lacks."""
    out = []
    for name, fn in vars(enum_cls).items():
        if name.startswith("_") or isinstance(fn, (classmethod, staticmethod, property)):
            continue
        if callable(fn) and not isinstance(fn, type) and not hasattr(custom_cls, name):
            out.append(name)
    return sorted(out)


def spec_class(custom_base: type, enum_cls: type, overrides: dict) -> type:
    """``custom_base`` (SGLang's ``CustomSpecAlgo``) + DFLASH-family answers +
    the builtin's methods ``custom_base`` lacks (see module docstring)."""
    ns = {
        "__doc__": "DDTREE: answers like the DFLASH family; see sglang_ddtree.adapters.common.",
        "is_dflash": lambda self: True,
        "is_dflash_family": lambda self: True,
        "supports_target_verify_for_draft": lambda self: True,
    }
    ns.update(overrides)
    probe = type("_Probe", (custom_base,), ns)
    for name in missing_enum_methods(probe, enum_cls):
        ns[name] = vars(enum_cls)[name]
    return type("DDTreeSpecAlgo", (custom_base,), ns)


def make_validator(adapter: ModuleType) -> Callable:
    """The ``validate_server_args`` hook: refuse what cannot work (with the
    reason), then write what the builtin DFLASH handler would write."""

    def validate_server_args(server_args) -> None:
        # the SGLang version was checked when the plugin registered (load_adapter), in this process
        cfg = resolve_ddtree_config(server_args, os.environ, backends=adapter.attention_backends(server_args),
                                    tree_verify_cuda_graphs=adapter.TREE_VERIFY_CUDA_GRAPHS)
        steps = getattr(server_args, "speculative_num_steps", None)
        if steps is not None and int(steps) != 1:
            logger.warning("DDTREE drafts in one pass; overriding speculative_num_steps=%s to 1.", steps)
        blk = cfg.drafter_block_size
        if blk is None and cfg.mode == TREE_VERIFY:
            blk = adapter.drafter_block_size(server_args)
        overlap, why = overlap_decision(cfg, blk, bool(getattr(adapter, "OVERLAP_SCHEDULE", False)), os.environ,
                                        user_disabled=bool(getattr(server_args, "disable_overlap_schedule", False)))
        for k, v in server_arg_writes(server_args, cfg, overlap=overlap).items():
            setattr(server_args, k, v)
        logger.info(
            "DDTREE: mode=%s budget B=%d%s verify width D=%d topk=%d, overlap scheduling %s (%s) (SGLang %s adapter)",
            cfg.mode, cfg.budget, "" if cfg.schedule is None else f" (schedule {cfg.schedule}: each step the budget "
            "of its batch size; the worker logs each graph bucket's verify width)",
            cfg.num_draft_tokens, cfg.topk, "on" if overlap else "off", why, adapter.VERSION,
        )

    return validate_server_args


def register(adapter: ModuleType) -> bool:
    """Register DDTREE with SGLang for ``adapter``'s version; idempotent.
    Returns True when this call registered it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(ALGORITHM_NAME) is not None:
        return False
    SpeculativeAlgorithm.register(
        ALGORITHM_NAME,
        # the validator still turns overlap off per server where it cannot run (config.overlap_decision)
        supports_overlap=bool(getattr(adapter, "OVERLAP_SCHEDULE", False)),
        validate_server_args=make_validator(adapter),
        spec_class=adapter.make_spec_class(),
    )(lambda server_args: load_worker(adapter.VERSION).DDTreeWorker)  # SGLang's worker factory
    HookRegistry.register(ADMISSION_TARGET, admission_around_hook, HookType.AROUND)
    return True
