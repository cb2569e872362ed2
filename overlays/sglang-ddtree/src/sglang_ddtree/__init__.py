"""DDTree speculative decoding for SGLang 0.5.23, packaged as an SGLang plugin.

Importing this package does not import SGLang.  Submodules:

* :mod:`sglang_ddtree.tree`         - best-first draft-tree builders (reference heap, batched torch)
* :mod:`sglang_ddtree.compile`      - tree -> SGLang verify inputs (ids, positions, mask, retrieve_*)
* :mod:`sglang_ddtree.verify`       - tree verify walk (greedy exact, lossless sampling)
* :mod:`sglang_ddtree.indexing`     - accept-index / KV-slot / recurrent-state index arithmetic
* :mod:`sglang_ddtree.capabilities` - the capability declaration (reads capabilities.json)
* :mod:`sglang_ddtree.plugin`       - the ``sglang.srt.plugins`` entry point (imports SGLang)
* :mod:`sglang_ddtree.worker`       - the DFlash-v2-derived tree-verify worker (imports SGLang)
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("sglang-ddtree")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"
