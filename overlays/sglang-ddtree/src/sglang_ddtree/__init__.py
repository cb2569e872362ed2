"""DDTree speculative decoding for SGLang 0.5.17 and 0.5.23, packaged as an SGLang plugin.

Importing this package does not import SGLang.  Submodules:

* :mod:`sglang_ddtree.tree`          - best-first draft-tree builders (reference heap, batched torch, Triton)
* :mod:`sglang_ddtree.compile`       - tree -> SGLang verify inputs (ids, positions, mask, retrieve_*)
* :mod:`sglang_ddtree.verify`        - tree verify walk (greedy exact, lossless sampling)
* :mod:`sglang_ddtree.indexing` / :mod:`sglang_ddtree.step` - index arithmetic and the pure step core
* :mod:`sglang_ddtree.tree_sampling` - bounded-memory target-only tree sampling (temperature/top-k/top-p/min-p)
* :mod:`sglang_ddtree.config`        - modes, budget and every server-argument rule (pure)
* :mod:`sglang_ddtree.admission`     - which requests tree-verify serves (pure)
* :mod:`sglang_ddtree.capabilities`  - the capability declaration (reads capabilities.json)
* :mod:`sglang_ddtree.plugin`        - the ``sglang.srt.plugins`` entry point
* :mod:`sglang_ddtree.adapters`      - one adapter (registration glue + worker) per supported SGLang version
* :mod:`sglang_ddtree.glue_graphs`   - the tree-verify step's glue captured into CUDA graphs

The measurement and training tools (bench, smoke, paired, tiny models, the training kit) are a second
distribution, ``sglang-ddtree-tools`` (package ``sglang_ddtree_tools``), never installed into a serving venv.
"""

from importlib.metadata import PackageNotFoundError, version as _version

try:
    __version__ = _version("sglang-ddtree")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"
