"""SGLang plugin entry point: registers the ``DDTREE`` speculative algorithm.

Loaded by SGLang's plugin framework from the entry point group
``sglang.srt.plugins`` (name ``ddtree``) in every SGLang process; allow-list
it with ``SGLANG_PLUGINS=ddtree``.  :func:`register` picks the adapter of the
installed SGLang version (:mod:`sglang_ddtree.adapters`) and refuses any other
version with a message naming the supported ones.  The server-argument rules
live in :mod:`sglang_ddtree.config`, the request admission rules in
:mod:`sglang_ddtree.admission`.
"""

from __future__ import annotations

from .adapters import UnsupportedSGLangVersion, check_sglang_version, load_adapter
from .config import (  # noqa: F401  (re-exported: the plugin's public contract)
    ALGORITHM_NAME,
    BUDGET_ENV,
    MODE_ENV,
    OVERLAP_ENV,
    SHADOW_LINEAR,
    TREE_VERIFY,
    DDTreeConfig,
    DDTreeConfigError,
    overlap_decision,
    resolve_ddtree_config,
    server_arg_writes,
)

__all__ = ["register", "check_sglang_version", "UnsupportedSGLangVersion", "ALGORITHM_NAME"]


def register() -> None:
    """Entry point (``sglang.srt.plugins`` -> ``ddtree``).  Idempotent."""
    from .adapters import common

    common.register(load_adapter())
