#!/usr/bin/env bash
# Here (not on the device): the wheel batches that put SGLang 0.5.17 on the lent H200 (torch 2.11.0+cu130 and
# triton 3.6.0 are already there, Python 3.12, no registry). Each batch stays under the device's 64 MiB a call:
#   .gpu/A  sglang 0.5.17, sglang-kernel 0.4.5 without FA3/sm100 (a tgz), most of the server's small dependencies
#           (~49 MiB: with the checkout, ~3 MiB, it stays under a call's 64 MiB)
#   .gpu/B  ipython and what it pulls, jsonschema, soundfile, xgrammar
#   .gpu/C  transformers 5.12.1 + tokenizers 0.22.2 (the host's 5.17 breaks 0.5.17's configs), flashinfer 0.6.15.post1,
#           fastapi 0.124.4 / starlette 0.50.0, loguru, frozendict, docstring-parser, cachetools, and anthropic,
#           pycryptodomex, openai-harmony, llguidance (moved from A for its size), py-spy 0.4.3 (bench --spy: SPY=1)
# Why these versions: ../shared/gpu/README.md (measured). Writes .gpu/batches.txt (every file and its sha256).
# Usage: bash benchmarks/h200/batches.sh        (from the repository root; .gpu/ is ignored through .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
PY=${PYTHON:-python3}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64)
dl() {  # batch, requirement...
  local dir; case $1 in /*) dir=$1 ;; *) dir=.gpu/$1 ;; esac; shift
  mkdir -p "$dir"
  local log; log=$(mktemp)
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" -d "$dir" "$@" >"$log" 2>&1; then
    grep -v "is ignored: it is neither a file nor a directory" "$log" >&2
    rm -f "$log"; echo "batches: pip download into $dir failed" >&2; exit 1
  fi
  rm -f "$log"
}
dl A sglang==0.5.17 apache-tvm-ffi==0.1.11 pydantic pydantic-core annotated-types typing-inspection uvicorn orjson \
  pybase64 msgspec pyzmq setproctitle partial-json-parser python-multipart interegular llguidance compressed-tensors \
  openai==2.6.1 jiter distro sniffio blobfile==3.0.0 easydict watchfiles torch_memory_saver gguf
dl B ipython traitlets jedi parso prompt-toolkit pexpect ptyprocess decorator matplotlib-inline stack-data asttokens \
  executing pure-eval wcwidth ipython-pygments-lexers dill jsonschema jsonschema-specifications referencing rpds-py \
  attrs soundfile cffi pycparser xgrammar==0.2.1
dl C transformers==5.12.1 tokenizers==0.22.2 loguru frozendict docstring-parser cachetools \
  flashinfer-python==0.6.15.post1 fastapi==0.124.4 starlette==0.50.0 anthropic pycryptodomex openai-harmony llguidance \
  py-spy==0.4.3
# pydantic-core must match pydantic's pin (pip download --no-deps takes the newest of each): fetch the one it names
pin=$(unzip -p .gpu/A/pydantic-[0-9]*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
if [ -n "$pin" ] && ! ls .gpu/A/pydantic_core-"$pin"-* >/dev/null 2>&1; then
  rm -f .gpu/A/pydantic_core-*.whl
  dl A "pydantic-core==$pin"
fi
# sglang-kernel 0.4.5 is 383 MB because of FA3 (flash_ops, 1.1 GB unpacked): carried without it (and without the
# sm100 and infllm ops), as a tgz that unpacks into the install target. The servers use --attention-backend triton.
if [ ! -f .gpu/A/sgl_kernel-0.4.5-trimmed.tgz ]; then
  k=$(mktemp -d)
  dl "$k" sglang-kernel==0.4.5
  (cd "$k" && unzip -q ./*.whl -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' 'sgl_kernel/infllm_ops*' \
     && rm -f ./*.whl && tar czf sgl_kernel-0.4.5-trimmed.tgz -- *)
  mv "$k/sgl_kernel-0.4.5-trimmed.tgz" .gpu/A/
  rm -rf "$k"
fi
(cd .gpu && sha256sum A/* B/* C/* > batches.txt)
for b in A B C; do  # one version of each distribution a batch (two stop the whole install)
  dup=$(ls .gpu/$b | sed -n 's/^\([A-Za-z0-9_.]*\)-[0-9].*\.whl$/\L\1/p' | sort | uniq -d)
  [ -z "$dup" ] || { echo "batches: .gpu/$b holds two versions of: $dup" >&2; exit 1; }
done
du -sh .gpu/A .gpu/B .gpu/C
