"""GPU-side checks and measurements of the DDTree plugin, kept OUT of the serving wheel.

Run from the repository root with ``PYTHONPATH=overlays/sglang-ddtree/src:overlays/sglang-ddtree-tools/src:overlays/sglang-ddtree/gpu_checks``:

* ``python -m ddtree_checks.hybrid_gdn`` - hybrid (GDN) tree-state correctness with SGLang's
  own Triton kernels (one layer, random parameters, float64 per-path reference);
* ``python -m ddtree_checks.serve_matrix`` - real SGLang servers (plain, DFLASH, DDTREE
  shadow-linear / tree-verify) on tiny seeded models: the lossless statistic, sampling,
  accept lengths and tokens/s (``benchmarks/results/ddtree_serving_h200.*``).

The pure-torch reference parts import no SGLang and are unit-tested on CPU in CI.
"""
