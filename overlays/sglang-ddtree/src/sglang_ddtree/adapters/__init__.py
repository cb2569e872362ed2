"""One adapter per supported SGLang version, chosen at load.

Everything that depends on an SGLang release's internals (its worker class, the
names and signatures of the kernels and helpers the worker calls, how it
resolves server arguments) lives in one adapter module per version:

* :mod:`sglang_ddtree.adapters.v0_5_17` - SGLang 0.5.17, the last release pinned
  to torch 2.11.0 (what the fleet runs);
* :mod:`sglang_ddtree.adapters.v0_5_23` - SGLang 0.5.23 (torch 2.14.1).

Each adapter module imports on a CPU host (registration glue only).  The worker
is written once, :mod:`sglang_ddtree.adapters.worker` (the tree-verify step, the
CUDA-graph check, the phase ranges and accept counters); each version's sibling
``*_worker`` module, imported when SGLang builds the worker, holds only that
release's differences (the names that moved, its KV index handling, TP sync,
the signatures its overrides must match) as a thin subclass of it.
Any other SGLang version is refused with a message naming the supported ones
(``capabilities.json`` says per version what is supported).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Optional

from ..capabilities import SUPPORTED_SGLANG_VERSIONS, load_capabilities

__all__ = ["UnsupportedSGLangVersion", "ADAPTER_MODULES", "WORKER_MODULES", "check_sglang_version", "load_adapter",
           "load_worker"]

# version -> adapter module (one file per SGLang release the plugin supports), as capabilities.json declares them
ADAPTER_MODULES = {v: d["adapter"] for v, d in load_capabilities()["per_version"].items()}
# version -> its worker module (which imports its adapter module; the adapter never imports its worker)
WORKER_MODULES = {v: d["worker"] for v, d in load_capabilities()["per_version"].items()}


class UnsupportedSGLangVersion(RuntimeError):
    pass


def check_sglang_version(installed: Optional[str] = None) -> str:
    """Return the installed SGLang version, or raise naming the supported ones."""
    if installed is None:
        try:
            installed = version("sglang")
        except PackageNotFoundError as e:  # pragma: no cover - the plugin is loaded by SGLang
            raise UnsupportedSGLangVersion("sglang-ddtree needs SGLang, which is not installed") from e
    if installed not in ADAPTER_MODULES:
        raise UnsupportedSGLangVersion(
            f"sglang-ddtree supports SGLang {', '.join(SUPPORTED_SGLANG_VERSIONS)} only (one adapter per "
            f"release: the worker subclasses that release's DFlash v2 worker and calls its kernels); found "
            f"SGLang {installed}. Install one of those SGLang versions, or a plugin build for {installed}."
        )
    return installed


def load_adapter(installed: Optional[str] = None) -> ModuleType:
    """The adapter module for the installed (or given) SGLang version."""
    v = check_sglang_version(installed)
    return importlib.import_module(ADAPTER_MODULES[v])


def load_worker(installed: Optional[str] = None) -> ModuleType:
    """The worker module (``DDTreeWorker``) for the installed (or given) SGLang version."""
    v = check_sglang_version(installed)
    return importlib.import_module(WORKER_MODULES[v])
