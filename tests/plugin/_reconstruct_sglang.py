"""Run SGLang 0.5.23's own ``reconstruct_indices_from_tree_mask`` Triton kernel on
the CPU through Triton's interpreter (TRITON_INTERPRET=1) and print its outputs.

Executed as a subprocess by test_compile.py (the interpreter flag must be set
before the kernel module is imported).  On a non-CUDA host SGLang's module
imports ``sgl_kernel.speculative`` (the compiled CUDA op) at import time; that
package cannot exist here, so an empty placeholder module is registered under
that name - the compiled op is never called, only the Triton kernel is.
"""
import json
import os
import sys
import types

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

placeholder = types.ModuleType("sgl_kernel")
placeholder.__path__ = []
spec = types.ModuleType("sgl_kernel.speculative")
spec.reconstruct_indices_from_tree_mask = None
sys.modules.setdefault("sgl_kernel", placeholder)
sys.modules.setdefault("sgl_kernel.speculative", spec)

from sglang.kernels.ops.speculative.reconstruct_tree import (  # noqa: E402
    reconstruct_indices_from_tree_mask_triton,
)

req = json.load(sys.stdin)
mask = torch.tensor(req["mask"], dtype=torch.bool).reshape(-1)
seq = torch.tensor(req["seq_lens"], dtype=torch.int64)
bs, n = req["bs"], req["n"]
pos = torch.zeros(bs * n, dtype=torch.int64)
ri, rn, rs = pos.clone(), pos.clone(), pos.clone()
reconstruct_indices_from_tree_mask_triton(mask, seq, pos, ri, rn, rs, bs, n)
json.dump({"positions": pos.tolist(), "retrieve_index": ri.tolist(),
           "next_token": rn.tolist(), "next_sibling": rs.tolist()}, sys.stdout)
