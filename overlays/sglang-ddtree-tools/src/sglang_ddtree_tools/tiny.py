"""Tiny seeded models for GPU checks: a target and a DFlash drafter per family.

``python -m sglang_ddtree_tools.tiny OUT_DIR [--family hybrid|dense|all] [--seed 0]``
writes, per family, ``OUT_DIR/<family>-target`` and ``OUT_DIR/<family>-drafter``
(config.json + model.safetensors, bf16), ready for
``sglang.launch_server --skip-tokenizer-init`` with ``input_ids``:

* ``hybrid``: ``Qwen3NextForCausalLM`` - GDN linear-attention layers mixed with
  full attention (and a small MoE), the hybrid class that SGLang 0.5.17 can use
  as a DFLASH target (it implements ``set_dflash_layers_to_capture``;
  ``Qwen3_5ForCausalLM`` does not there);
* ``dense``: ``Qwen3ForCausalLM``;
* each with a one-layer ``DFlashDraftModel`` drafter of the same hidden size
  reading target layers 1 and 2.

Why seeded weights and not ``--load-format dummy``: dummy weights are uniform
+-1e-3 and every step emits the same token, which proves nothing.  The target
is written by transformers' ``save_pretrained`` of a model initialised from
``--seed``; the drafter's tensors are drawn from the same generator.

One deliberate structure, so that speculation accepts something with random
weights: a context-independent *prior* over ``PRIOR_TOKENS``.  Every token's
embedding gets the constant ``C`` in coordinate 0, which the residual stream
carries to the final norm, and the LM head's column 0 holds ``linspace(S, 0)``
for the prior tokens (0 elsewhere): a bias both the target and the drafter
(which borrows the target's embedding and head) see.  The next-token argmax
then mostly falls among the prior tokens while *which* one still depends on
the context, so a wide tree accepts at depth 1 and beyond far more often than
a chain, and the commit of accepted non-first siblings - the part of a tree
verify that can go silently wrong on a hybrid model - is exercised.  The head
is not scaled (scaling it would amplify bf16 noise past the lossless margin),
and the hybrid target's MoE routes every token to all its experts (a routing
flip between prefill and decode kernels is a discontinuity no tie margin
absorbs).

The config part (:func:`target_config`, :func:`drafter_config`) is pure; writing
weights needs torch, transformers and safetensors (what an SGLang host has).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

FAMILIES = ("hybrid", "dense")
VOCAB = 32000
HIDDEN = 512
LAYERS = 4
PRIOR_TOKENS = tuple(range(1000, 1016))  # the 16 tokens of the prior (see the module docstring)
PRIOR = {"dense": (0.4, 1.5), "hybrid": (0.3, 1.0)}  # (embedding constant C, prior spread S), per family
MASK_TOKEN_ID = VOCAB - 1
DRAFT_BLOCK = 8
TARGET_LAYER_IDS = [1, 2]

_COMMON = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2,
}

__all__ = ["FAMILIES", "target_config", "drafter_config", "write_family"]


def target_config(family: str) -> dict:
    """config.json of the tiny target of ``family`` (what SGLang 0.5.17 reads)."""
    if family == "dense":
        return dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=1536)
    if family == "hybrid":
        layer_types = ["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(LAYERS)]
        return dict(
            _COMMON,
            architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", intermediate_size=1024,
            # SGLang 0.5.17 reads full_attention_interval and the linear_* sizes from config.json
            full_attention_interval=2, layer_types=layer_types, linear_conv_kernel_dim=4,
            linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
            num_experts=2, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
            decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[], partial_rotary_factor=0.25,
        )
    raise ValueError(f"unknown tiny family {family!r}; choose one of {FAMILIES}")


def drafter_config(family: str) -> dict:
    """config.json of the tiny DFlash drafter for ``family``'s target."""
    target_config(family)  # validates the family
    return dict(
        _COMMON,
        architectures=["DFlashDraftModel"], model_type="qwen3", intermediate_size=1536, num_hidden_layers=1,
        num_target_layers=LAYERS, block_size=DRAFT_BLOCK,
        dflash_config={"block_size": DRAFT_BLOCK, "num_target_layers": LAYERS,
                       "target_layer_ids": TARGET_LAYER_IDS, "mask_token_id": MASK_TOKEN_ID},
    )


def _write_target(out: Path, family: str, seed: int) -> None:
    import torch
    import transformers as T

    torch.manual_seed(seed)
    cfg_dict = target_config(family)
    if family == "dense":
        cfg = T.Qwen3Config(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "torch_dtype")})
        model = T.Qwen3ForCausalLM(cfg)
    else:
        cfg = T.Qwen3NextConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type", "torch_dtype")})
        model = T.Qwen3NextForCausalLM(cfg)
    c, spread = PRIOR[family]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = c
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[list(PRIOR_TOKENS), 0] = torch.linspace(spread, 0, len(PRIOR_TOKENS))
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    # transformers may drop fields SGLang reads: write the config we mean
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=1) + "\n")


def _write_drafter(out: Path, family: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    cfg = drafter_config(family)
    g = torch.Generator().manual_seed(seed + 1)
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    t = {"fc.weight": rnd(h, h * len(TARGET_LAYER_IDS)), "hidden_norm.weight": ones(h), "norm.weight": ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        t.update({
            p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
            p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
        })
    out.mkdir(parents=True, exist_ok=True)
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")


def write_family(out_dir: str | os.PathLike, family: str, seed: int = 0) -> dict:
    """Write ``<family>-target`` and ``<family>-drafter`` under ``out_dir``; returns their paths.

    Every file is left readable (0644, folders 0755) whatever mode its writer chose (transformers' shard writer
    leaves 0600 files): the servers that load the models run as the service user, and who may read them is
    decided by ``out_dir``'s own mode and owner (the smoke run's is private to that user)."""
    root = Path(out_dir)
    target, drafter = root / f"{family}-target", root / f"{family}-drafter"
    target.mkdir(parents=True, exist_ok=True)
    _write_target(target, family, seed)
    _write_drafter(drafter, family, seed)
    for d in (target, drafter):
        d.chmod(0o755)
        for dirpath, dirs, files in os.walk(d):
            for n in dirs:
                os.chmod(os.path.join(dirpath, n), 0o755)
            for n in files:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o644)
    return {"target": str(target), "drafter": str(drafter)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.tiny", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--family", choices=FAMILIES + ("all",), default="all")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    fams = FAMILIES if a.family == "all" else (a.family,)
    paths = {f: write_family(a.out_dir, f, a.seed) for f in fams}
    json.dump(paths, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
