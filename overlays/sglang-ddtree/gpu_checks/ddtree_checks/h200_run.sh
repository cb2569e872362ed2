#!/usr/bin/env bash
# Run the hybrid GDN check (and the tree-build benchmark when present) on a GPU
# host that has torch + triton but no SGLang install, from the repository root:
#
#   bash overlays/sglang-ddtree/gpu_checks/ddtree_checks/h200_run.sh OUTDIR
#
# Expects in .whl/: sglang-0.5.23-kernels-srt.zip (sglang/kernels + sglang/srt +
# the dist-info, from the sglang 0.5.23 wheel, .so files left out, empty
# sglang/__init__.py) and cp312 wheels of msgspec, orjson, pybase64,
# pydantic_core, pyzmq, starlette (what those modules import at load time).
# On a host where SGLang 0.5.23 is installed, run the module directly instead:
#   python -m ddtree_checks.hybrid_gdn --jobs 6 --json out.json
set -u
out=${1:-${OUT:-/tmp/hybrid_out}}
mkdir -p "$out" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 -c "import zipfile; zipfile.ZipFile('.whl/sglang-0.5.23-kernels-srt.zip').extractall('/tmp/site')" || exit 3
export PYTHONPATH=/tmp/site:$PWD/overlays/sglang-ddtree/src:$PWD/overlays/sglang-ddtree-tools/src:$PWD/overlays/sglang-ddtree/gpu_checks
export PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$out/env.txt"
start=$(date +%s)
python3 -m ddtree_checks.hybrid_gdn --jobs 6 --json "$out/hybrid_gdn_h200.json" 2>&1 | tee "$out/hybrid_gdn_h200.txt"
rc=${PIPESTATUS[0]}
echo "hybrid_gdn exit $rc, $(( $(date +%s) - start )) s" | tee -a "$out/hybrid_gdn_h200.txt"
if [ -f benchmarks/tree_build.py ]; then
  start=$(date +%s)
  timeout "${TREE_BUILD_TIMEOUT:-240}" python3 benchmarks/tree_build.py 2>&1 | tee "$out/tree_build_h200.txt"
  echo "tree_build exit ${PIPESTATUS[0]}, $(( $(date +%s) - start )) s" | tee -a "$out/tree_build_h200.txt"
fi
exit "$rc"
