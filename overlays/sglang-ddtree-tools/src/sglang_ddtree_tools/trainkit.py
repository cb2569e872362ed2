"""Train a tiny target and its DFlash drafter on the synthetic language, per family, in minutes.

``python -m sglang_ddtree_tools.trainkit OUT --seed S [--family hybrid|dense|both] [--device cuda]
[--preset full|small|toy] [--target-steps N] [--drafter-steps N] [--target-seconds S]
[--drafter-seconds S]`` writes, per family,
``OUT/<family>-target`` and ``OUT/<family>-drafter`` (config.json +
model.safetensors, bf16; load in SGLang 0.5.17 as ``--model-path`` /
``--speculative-draft-model-path`` with ``--skip-tokenizer-init``), ``OUT/prompts.jsonl``
(held-out prompts as token ids) and ``OUT/manifest.json`` (seed, steps, losses,
greedy agreement, offline accept lengths, sha256 of every file).  It needs only
torch, transformers and safetensors.  OUT must not exist (or be empty): the kit
writes into ``OUT.partial`` and renames it at the end, so a failed run leaves
nothing that looks finished.

What it does, per family
------------------------
1. **Target** (:func:`target_config`): the architecture of :mod:`sglang_ddtree_tools.tiny`
   (hybrid: ``Qwen3NextForCausalLM``, GDN linear attention + full attention, two
   experts both routed; dense: ``Qwen3ForCausalLM``; 4 layers, 8/2 heads of 64), at a
   smaller width and the language's vocabulary, trained from scratch with AdamW on
   fresh samples of :class:`sglang_ddtree_tools.markov.MarkovSource`.  Printed: loss against
   the source's entropy rate; then on held-out prompts the target's own greedy
   continuation (autoregressive, KV cache) against the source's greedy continuation.
2. **Drafter** (:class:`DFlashDrafter`): a one-layer DFlash draft model trained on the
   frozen target's hidden states over ``prompt + the target's own greedy continuation``
   sequences (transformers ``generate``), the text it sees when serving greedy requests
   - so it learns the target as trained, whatever its agreement with the source.  Loss: cross-entropy of the target's
   LM head on the drafter's hidden states at block positions ``1..blk-1``, weighted
   ``exp(-(k-1)/gamma)`` as in DFlash.
3. **Offline estimate**: on the held-out prompts and the target's greedy
   continuation, at every anchor, the drafter's chain accept length (blocks 8 and 16)
   and the DDTree accept length at budgets 15/31/63, the tree built by the plugin's
   own path (:func:`sglang_ddtree.step.draft_topk_candidates`,
   :func:`~sglang_ddtree.step.merge_vocab_shards`,
   :func:`~sglang_ddtree.step.build_tree_from_candidates`); plus the per-depth rank
   histogram of the true token and :func:`sglang_ddtree_tools.markov.expected_accept` on
   the measured profile.  Accept lengths count the bonus token, as SGLang's do.  Each
   is given twice: the mean over every anchor, and the figure a server decoding the
   same prompts reports (``offline["decode"]``, :func:`sglang_ddtree_tools.markov.decode_walk`):
   a server visits only the anchors where its last step stopped, right after a
   rejection, so its accept length is lower than the mean over every anchor whenever
   the drafter is better on some stretches than on others.  Hold a served accept
   length against ``decode``.

The drafter is SGLang 0.5.17's DFlash computation
-------------------------------------------------
Read from ``sglang/srt/models/dflash.py`` and ``speculative/dflash_worker_v2.py``
(0.5.17), and mirrored op for op by :class:`DFlashDrafter` (tests compare it with a
transcription of SGLang's modules on random weights):

* context features: SGLang's target captures the residual stream *before* layer
  ``i + 1`` for each ``i`` in ``dflash_config.target_layer_ids``
  (``set_dflash_layers_to_capture`` adds 1), i.e. the output of layer ``i``, which is
  ``hidden_states[i + 1]`` of transformers' ``output_hidden_states`` (index 0 is the
  embedding output); ids must be ``< num_layers - 1`` (a capture before a layer that
  does not exist never happens).  Features are concatenated in ascending layer order
  and projected once: ``ctx = hidden_norm(fc(cat))``;
* every drafter layer's context K/V come from that same ``ctx`` with **no**
  ``input_layernorm``: ``K = rope(k_norm(W_k ctx))``, ``V = W_v ctx`` at the context
  tokens' absolute positions (``_append_target_hidden_*``);
* the block is ``[bonus, mask * (blk - 1)]`` at positions ``p .. p + blk - 1`` (``p`` =
  committed length), embedded with the **target's** embedding (``mask_token_id`` =
  ``vocab - 1``, a row the target never trained on);
* each layer: pre-norm (``input_layernorm``), Q/K/V of the block with per-head
  ``q_norm``/``k_norm`` (Qwen3) and neox RoPE (``rotary_dim = head_dim``), attention
  **non-causal** (``layer_types`` unset gives ``ENCODER_ONLY``) over context ``[0, p)``
  plus the whole block, ``o_proj``, residual, ``post_attention_layernorm``, SiLU MLP,
  residual; final ``norm``;
* logits: the **target's** ``lm_head`` on the hidden states at block positions
  ``1..blk-1`` (position ``k`` predicts the token at ``p + k``).
RMSNorm is SGLang's: ``(x * rsqrt(mean(x^2) + eps) * w).to(dtype)`` in float32.

SpecForge
---------
SpecForge 0.2.0 (PyPI wheel read and run here) has the same computation
(``specforge/modeling/draft/dflash.py``: ``DFlashDraftModel``, K/V of
``hidden_norm(fc(target_hidden))`` without layernorm, non-causal block) and a trainer
(``specforge/algorithms/common/dflash_family_model.py``: ``OnlineDFlashModel``, anchors,
flex-attention or SDPA mask, decayed CE).  Those two modules import and run with torch
2.11 + transformers 5.12.1 and nothing else, but the kit does not depend on them:

* its training entry point (``specforge.cli`` / ``launch``) expects chat datasets
  through a tokenizer and chat template, ``datasets``/``accelerate``/``yunchang``/
  ``wandb``/``tensorboard``, and a target served by its own backends (HF or SGLang
  0.5.14, which it pins); this language has no tokenizer and the H200 has no registry
  to install those from;
* using only its two modules would add a carried wheel for ~300 lines of model code
  that the kit needs anyway to stay runnable with torch + transformers + safetensors
  alone (the integrator's constraint), and its ``DFlashDraftModel`` subclasses
  ``Qwen3PreTrainedModel`` from transformers' private module layout (5.8.1 pinned).
So the trainer is plain torch.  Checked once against SpecForge 0.2.0 (its wheel unpacked
on the CPU, transformers 5.12.1): SpecForge's ``DFlashDraftModel`` (SDPA) loads
:class:`DFlashDrafter`'s ``state_dict`` with no missing or unexpected keys, its
``create_dflash_sdpa_mask`` equals :func:`block_layout`'s mask, and on random weights
with three anchors the two forwards agree exactly (max abs difference 0.0, fp32).  The
test suite checks the drafter against SGLang 0.5.17's own ``DFlashDraftModel`` code
(``tests/plugin/test_trainkit.py``), which is what serves it.

Budget: the ``full`` preset is meant for one H200 in under 4 minutes for both
families: each family's target and drafter training are capped at 60 s and 22 s of
wall clock (the learning-rate schedule runs on ``max(step / steps, elapsed / cap)``,
so a capped phase still ends annealed; the manifest says which ended it), plus data
generation and evaluation (not yet timed on a GPU; printed per phase).  ``small``
gives meaningful-but-weak figures on a CPU in ~10 minutes per family; ``toy`` runs
the whole pipeline on a CPU in seconds (tests).  CUDA runs are seeded but not
bit-identical (atomic adds in backward, and the caps depend on speed); CPU runs
without caps are.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

FAMILIES = ("hybrid", "dense")
TARGET_LAYER_IDS = [1, 2]
NUM_LAYERS = 4
BUDGETS = (15, 31, 63)
MAX_BYTES = 64 * 1024 * 1024
POOL_STEPS = 200

__all__ = ["Preset", "PRESETS", "target_config", "drafter_config", "DFlashDrafter", "block_layout", "draft_rows",
           "offline_accept", "run", "main"]


@dataclasses.dataclass(frozen=True)
class Preset:
    vocab: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    dense_inter: int
    moe_inter: int
    linear_head_dim: int
    linear_k_heads: int
    linear_v_heads: int
    drafter_inter: int
    block: int
    seq_len: int  # training sequence length (>= prompt_len + eval_new)
    target_steps: int
    target_batch: int
    target_lr: float
    drafter_seqs: int
    drafter_steps: int
    drafter_batch: int
    anchors: int
    drafter_lr: float
    prompt_len: int
    eval_prompts: int
    eval_new: int
    loss_gamma: float = 7.0
    member_noise: float = 0.0  # the language's knobs (markov.make_source): per-token member rules,
    components: int = 4  # and the regime vector's length
    target_seconds: Optional[float] = None  # per-family wall-clock caps of the two training phases
    drafter_seconds: Optional[float] = None
    # Stop the drafter's training at the first check (every drafter_eval_every steps, held-out sequences) whose
    # chain accept length at the preset's block reaches this; None trains to the end. A near-perfect drafter
    # leaves a tree nothing to win (a chain already accepts ~15 of 16); real DFlash drafters accept ~3-7.
    drafter_chain_target: Optional[float] = None
    drafter_eval_every: int = 50


PRESETS: Dict[str, Preset] = {
    # one H200, both families < 4 min; sizes keep all four checkpoints well under 64 MiB
    # (steps are an upper bound: on an H200 the wall-clock caps are expected to end both phases)
    "full": Preset(vocab=2048, hidden=256, heads=8, kv_heads=2, head_dim=64, dense_inter=768, moe_inter=256,
                   linear_head_dim=64, linear_k_heads=4, linear_v_heads=8, drafter_inter=1536, block=16,
                   seq_len=256, target_steps=3000, target_batch=256, target_lr=3e-3,
                   drafter_seqs=8192, drafter_steps=3000, drafter_batch=128, anchors=16, drafter_lr=2e-3,
                   prompt_len=64, eval_prompts=64, eval_new=128, target_seconds=60.0, drafter_seconds=22.0,
                   drafter_chain_target=4.0),
    # a CPU-sized run whose figures mean something (minutes on 2 cores), to check the design without a GPU
    "small": Preset(vocab=512, hidden=128, heads=4, kv_heads=2, head_dim=32, dense_inter=384, moe_inter=128,
                    linear_head_dim=32, linear_k_heads=2, linear_v_heads=4, drafter_inter=512, block=16,
                    seq_len=160, target_steps=400, target_batch=32, target_lr=3e-3,
                    drafter_seqs=1024, drafter_steps=400, drafter_batch=16, anchors=16, drafter_lr=2e-3,
                    prompt_len=48, eval_prompts=16, eval_new=96),
    # the whole pipeline on a CPU in seconds (tests); figures mean nothing at this size
    "toy": Preset(vocab=128, hidden=64, heads=4, kv_heads=2, head_dim=16, dense_inter=128, moe_inter=64,
                  linear_head_dim=16, linear_k_heads=2, linear_v_heads=4, drafter_inter=128, block=8,
                  seq_len=48, target_steps=12, target_batch=8, target_lr=3e-3,
                  drafter_seqs=32, drafter_steps=12, drafter_batch=8, anchors=4, drafter_lr=2e-3,
                  prompt_len=16, eval_prompts=4, eval_new=16),
}


def _log(msg: str) -> None:
    print(f"[trainkit {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------
# configs (pure)
# ------------------------------------------------------------------------------------------------
def target_config(family: str, p: Preset) -> dict:
    """config.json of the trained target: tiny.py's architecture at the preset's sizes."""
    from . import tiny

    cfg = dict(tiny.target_config(family))
    cfg.update(vocab_size=p.vocab, hidden_size=p.hidden, num_hidden_layers=NUM_LAYERS, num_attention_heads=p.heads,
               num_key_value_heads=p.kv_heads, head_dim=p.head_dim, bos_token_id=1, eos_token_id=2,
               max_position_embeddings=4096)
    if family == "dense":
        cfg.update(intermediate_size=p.dense_inter)
    else:
        cfg.update(intermediate_size=p.dense_inter, moe_intermediate_size=p.moe_inter,
                   shared_expert_intermediate_size=p.moe_inter, linear_key_head_dim=p.linear_head_dim,
                   linear_value_head_dim=p.linear_head_dim, linear_num_key_heads=p.linear_k_heads,
                   linear_num_value_heads=p.linear_v_heads)
    return cfg


def drafter_config(family: str, p: Preset) -> dict:
    """config.json of the drafter: tiny.py's DFlash layout, trained layer ids, the language's mask token."""
    from . import tiny

    cfg = dict(tiny.drafter_config(family))
    dflash = {"block_size": p.block, "num_target_layers": NUM_LAYERS, "target_layer_ids": list(TARGET_LAYER_IDS),
              "mask_token_id": p.vocab - 1}
    cfg.update(vocab_size=p.vocab, hidden_size=p.hidden, num_attention_heads=p.heads, num_key_value_heads=p.kv_heads,
               head_dim=p.head_dim, intermediate_size=p.drafter_inter, num_hidden_layers=1,
               num_target_layers=NUM_LAYERS, block_size=p.block, bos_token_id=1, eos_token_id=2,
               dflash_config=dflash)
    return cfg


def validate_layer_ids(ids: List[int], num_layers: int) -> None:
    """SGLang captures "before layer i + 1": ids must be sorted, distinct and < num_layers - 1."""
    if list(ids) != sorted(set(ids)) or not ids or ids[0] < 0 or ids[-1] >= num_layers - 1:
        raise ValueError(f"target_layer_ids {ids} must be sorted, distinct, in [0, {num_layers - 2}]")


# ------------------------------------------------------------------------------------------------
# the drafter (SGLang 0.5.17's DFlash computation, trainable)
# ------------------------------------------------------------------------------------------------
def _torch():
    import torch

    return torch


def _nn():
    import torch.nn as nn

    return nn


def _build_modules():
    torch = _torch()
    nn = _nn()
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * self.weight.float()).to(x.dtype)

    def rope(x, pos, theta: float):
        """neox RoPE over the whole head dim; x [B, h, T, d], pos [B, T]."""
        d = x.shape[-1]
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        ang = pos.to(torch.float32).unsqueeze(-1) * inv  # [B, T, d/2]
        cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
        x1, x2 = x[..., : d // 2].float(), x[..., d // 2:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            h, hd = cfg["hidden_size"], cfg["head_dim"]
            self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
            self.theta = float(cfg.get("rope_theta", 1000000.0))
            self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
            self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
            self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
            self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
            eps = float(cfg.get("rms_norm_eps", 1e-6))
            self.q_norm, self.k_norm = RMSNorm(hd, eps), RMSNorm(hd, eps)

        def forward(self, x, pos, ctx, ctx_pos, mask):
            b, q_len, _ = x.shape
            s = ctx.shape[1]
            q = self.q_norm(self.q_proj(x).view(b, q_len, self.nh, self.hd)).transpose(1, 2)
            k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(b, s + q_len, self.nkv, self.hd)
            v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(b, s + q_len, self.nkv, self.hd)
            k = self.k_norm(k).transpose(1, 2)
            v = v.transpose(1, 2)
            q = rope(q, pos, self.theta)
            k = rope(k, torch.cat([ctx_pos, pos], 1), self.theta)
            rep = self.nh // self.nkv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1), scale=self.hd ** -0.5)
            return self.o_proj(o.transpose(1, 2).reshape(b, q_len, self.nh * self.hd))

    class MLP(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            h, i = cfg["hidden_size"], cfg["intermediate_size"]
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Layer(nn.Module):
        def __init__(self, cfg):
            super().__init__()
            eps = float(cfg.get("rms_norm_eps", 1e-6))
            self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
            self.self_attn = Attention(cfg)
            self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
            self.mlp = MLP(cfg)

        def forward(self, x, pos, ctx, ctx_pos, mask):
            x = x + self.self_attn(self.input_layernorm(x), pos, ctx, ctx_pos, mask)
            return x + self.mlp(self.post_attention_layernorm(x))

    class DFlashDrafter(nn.Module):
        """SGLang 0.5.17's ``DFlashDraftModel`` computation (module docstring), trainable.

        Parameter names are the checkpoint keys SGLang's ``load_weights`` reads."""

        def __init__(self, cfg: dict):
            super().__init__()
            h = cfg["hidden_size"]
            eps = float(cfg.get("rms_norm_eps", 1e-6))
            nfeat = len(cfg["dflash_config"]["target_layer_ids"])
            self.cfg = cfg
            self.fc = nn.Linear(nfeat * h, h, bias=False)
            self.hidden_norm = RMSNorm(h, eps)
            self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
            self.norm = RMSNorm(h, eps)

        def forward(self, block_embeds, block_pos, target_feats, ctx_pos, mask):
            """``block_embeds`` [B, Q, H] (target embedding of the blocks), ``block_pos`` [B, Q],
            ``target_feats`` [B, S, nfeat*H] (concatenated captured layers), ``ctx_pos`` [B, S],
            ``mask`` bool [B, Q, S + Q] (True = attend).  Returns the final-normed hidden [B, Q, H]."""
            ctx = self.hidden_norm(self.fc(target_feats))
            x = block_embeds
            for layer in self.layers:
                x = layer(x, block_pos, ctx, ctx_pos, mask)
            return self.norm(x)

    return DFlashDrafter


_DRAFTER_CLS = None


def DFlashDrafter(cfg: dict):  # noqa: N802 - a class factory, so importing this module needs no torch
    global _DRAFTER_CLS
    if _DRAFTER_CLS is None:
        _DRAFTER_CLS = _build_modules()
    return _DRAFTER_CLS(cfg)


def block_layout(anchors, seq_len: int, block: int, mask_token_id: int, tokens):
    """Inputs of ``N`` draft blocks per sequence, as SGLang lays each one out.

    ``anchors`` [B, N]: the bonus token's position ``p`` of each block (the committed
    length); ``tokens`` [B, S] the sequence.  Returns ``(block_ids [B, N*blk],
    block_pos [B, N*blk], mask [B, N*blk, S + N*blk], labels [B, N, blk], valid [B, N, blk])``:
    block ``n`` attends to context positions ``< anchors[n]`` and to its own block only."""
    torch = _torch()
    b, n = anchors.shape
    dev = anchors.device
    k = torch.arange(block, device=dev)
    pos = anchors.unsqueeze(-1) + k  # [B, N, blk]
    ids = torch.full((b, n, block), int(mask_token_id), dtype=torch.int64, device=dev)
    ids[:, :, 0] = tokens.gather(1, anchors)
    valid = pos < seq_len
    labels = tokens.gather(1, pos.clamp_max(seq_len - 1).reshape(b, -1)).view(b, n, block)
    q_block = torch.arange(n, device=dev).repeat_interleave(block)  # [Q]
    ctx_ok = torch.arange(seq_len, device=dev).view(1, 1, -1) < anchors.repeat_interleave(block, 1).unsqueeze(-1)
    blk_ok = (q_block.view(-1, 1) == q_block.view(1, -1)).unsqueeze(0).expand(b, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], -1)
    return ids.view(b, -1), pos.view(b, -1), mask, labels, valid


# ------------------------------------------------------------------------------------------------
# targets
# ------------------------------------------------------------------------------------------------
def build_target(family: str, p: Preset, seed: int, device):
    torch = _torch()
    import transformers as T

    cfg = target_config(family, p)
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")}
    torch.manual_seed(seed)
    if family == "dense":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**kw))
    else:
        if not hasattr(T, "Qwen3NextForCausalLM"):
            raise SystemExit(f"trainkit: transformers {T.__version__} has no Qwen3NextForCausalLM (need >= 4.57)")
        model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**kw))
    return model.to(device), cfg


def capture_features(out, layer_ids):
    """SGLang's DFLASH context features from a transformers forward with ``output_hidden_states``."""
    torch = _torch()
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], -1)


def _autocast(device):
    torch = _torch()
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


def _finite(v: float, what: str, step: int) -> float:
    if not math.isfinite(v):
        raise SystemExit(f"trainkit: {what} loss is {v} at step {step + 1}; stopping (lower the learning rate in the "
                         f"preset, or report the seed and device)")
    return v


class _Schedule:
    """Warmup + cosine learning rate over *progress* = max(step / steps, elapsed / seconds).

    ``seconds`` (the preset's per-phase wall-clock cap) ends a phase early on a slower
    GPU with the schedule completed rather than cut at a high learning rate; the
    manifest records the steps actually run and why the phase ended."""

    def __init__(self, opt, base_lr: float, steps: int, seconds: Optional[float]):
        self.opt, self.base, self.steps, self.seconds = opt, base_lr, steps, seconds
        self.step, self.t0, self.lr, self.reason = -1, time.time(), 0.0, "steps"

    def elapsed(self) -> float:
        return time.time() - self.t0

    def progress(self) -> float:
        p = (self.step + 1) / self.steps
        if self.seconds:
            p = max(p, self.elapsed() / self.seconds)
        return p

    def next(self) -> bool:
        if self.step >= 0 and self.progress() >= 1.0:
            if (self.step + 1) < self.steps:
                self.reason = "seconds"
            return False
        self.step += 1
        prog = min(1.0, self.step / self.steps if not self.seconds else max(self.step / self.steps,
                                                                               self.elapsed() / self.seconds))
        warm = 0.05
        f = (prog + 1.0 / self.steps) / warm if prog < warm else \
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (prog - warm) / (1 - warm)))
        self.lr = self.base * min(1.0, f)
        for g in self.opt.param_groups:
            g["lr"] = self.lr
        return True

    def last(self) -> bool:
        return self.progress() >= 1.0

    def summary(self, losses) -> dict:
        return {"steps": self.step + 1, "steps_planned": self.steps, "ended_by": self.reason,
                "losses": losses, "seconds": round(self.elapsed(), 2)}


def train_target(model, source, p: Preset, steps: int, gen, device, log_every: int,
                 seconds: Optional[float] = None) -> dict:
    torch = _torch()
    F = torch.nn.functional
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=p.target_lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = _Schedule(opt, p.target_lr, steps, seconds)
    # training text drawn POOL_STEPS batches at a time (seq_len vectorised steps, not seq_len per batch)
    losses, pool = [], None
    while sched.next():
        step = sched.step
        if step % POOL_STEPS == 0:
            pool, _ = source.sample(min(POOL_STEPS, steps - step) * p.target_batch, p.seq_len, gen, device=device)
        j = step % POOL_STEPS
        x = pool[j * p.target_batch:(j + 1) * p.target_batch]
        with _autocast(device):
            logits = model(input_ids=x).logits
        # the regime's markers and two uniform tokens come first: predict the chain after them
        k = source.prefix_len
        loss = F.cross_entropy(logits[:, k - 1:-1].float().reshape(-1, logits.shape[-1]), x[:, k:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or sched.last():
            v = _finite(float(loss.detach()), "target", step)
            losses.append([step, round(v, 5)])
            _log(f"  target step {step + 1}/{steps} loss {v:.4f} lr {sched.lr:.2e} ({sched.elapsed():.1f}s)")
    model.eval()
    return sched.summary(losses)


def greedy_generate(model, prompts, new: int):
    """The target's own greedy continuation (transformers generate, KV cache; no EOS stop)."""
    torch = _torch()
    with torch.no_grad(), _autocast(prompts.device):
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[:, prompts.shape[1]:]


def eval_target(model, source, prompts, regimes, new: int, device) -> dict:
    torch = _torch()
    gen = greedy_generate(model, prompts, new)
    ref = source.greedy_continuation(prompts, regimes, new)
    same = gen == ref
    prefix = same.long().cumprod(1).sum(1).float()
    with torch.no_grad(), _autocast(device):
        seq = torch.cat([prompts, ref], 1)
        pred = model(input_ids=seq).logits[:, prompts.shape[1] - 1:-1].argmax(-1)
    return {
        "greedy_token_agreement": round(float(same.float().mean()), 4),
        "greedy_prefix_agreement": round(float(prefix.mean()) / new, 4),
        "greedy_all_equal": int((prefix == new).sum()), "prompts": int(prompts.shape[0]),
        "teacher_forced_agreement": round(float((pred == ref).float().mean()), 4),
        "distinct_tokens_per_prompt": round(float(sum(len(set(r)) for r in gen.tolist())) / gen.shape[0], 1),
    }, gen


# ------------------------------------------------------------------------------------------------
# drafter training and evaluation
# ------------------------------------------------------------------------------------------------
def drafter_dataset(target, source, p: Preset, gen, device, chunk: int = 4096):
    """Sequences ``prompt + the target's own greedy continuation`` and its captured features.

    The text a greedy request makes the drafter see when serving (prompts from the
    source, then whatever the target emits), so the drafter learns the target as it
    is, not the source.  Also returns the fraction of continuation tokens equal to the
    source's greedy continuation of the same prompt."""
    torch = _torch()
    seqs, feats, starts = [], [], []
    agree = total = 0
    n = p.drafter_seqs
    lo, hi = max(source.prefix_len + 4, p.prompt_len // 2), p.prompt_len
    with torch.no_grad():
        for i in range(0, n, chunk):
            c = min(chunk, n - i)
            plen = int(torch.randint(lo, hi + 1, (1,), generator=gen, device=gen.device))
            prompts, r = source.sample(c, plen, gen, device=device)
            cont = greedy_generate(target, prompts, p.seq_len - plen)
            agree += int((cont == source.greedy_continuation(prompts, r, cont.shape[1])).sum())
            total += cont.numel()
            seq = torch.cat([prompts, cont], 1)
            for j in range(0, c, 256):
                with _autocast(device):
                    out = target.model(input_ids=seq[j:j + 256], output_hidden_states=True)
                f = capture_features(out, TARGET_LAYER_IDS)
                feats.append(f.to(torch.bfloat16) if torch.device(device).type == "cuda" else f.float())
            seqs.append(seq)
            starts.append(torch.full((c,), plen, dtype=torch.int64, device=device))
    return torch.cat(seqs), torch.cat(feats), torch.cat(starts), agree / max(1, total)


def drafter_loss(drafter, embed, lm_head, seq, feats, anchors, block: int, mask_id: int, gamma: float):
    torch = _torch()
    F = torch.nn.functional
    b, s = seq.shape
    ids, pos, mask, labels, valid = block_layout(anchors, s, block, mask_id, seq)
    ctx_pos = torch.arange(s, device=seq.device).expand(b, -1)
    with torch.no_grad():
        emb = embed(ids)
    hidden = drafter(emb, pos, feats, ctx_pos, mask)
    logits = lm_head(hidden).float().view(b, anchors.shape[1], block, -1)
    k = torch.arange(block, device=seq.device)
    w = torch.exp(-(k - 1).clamp_min(0).float() / gamma) * (k > 0).float()
    w = w * valid.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(w)
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():  # depth-1 accuracy, left on the device (read only when logged)
        acc1 = ((logits[:, :, 1].argmax(-1) == labels[:, :, 1]) & valid[:, :, 1]).float().sum() / valid[:, :, 1].sum().clamp_min(1)
    return loss, acc1


def held_out_chain(drafter, embed, lm_head, seqs, feats, starts, block: int, mask_id: int, gen, rows: int = 512):
    """Chain accept length (bonus included) of ``drafter`` at ``rows`` seeded anchors of held-out sequences."""
    torch = _torch()
    n, s = seqs.shape
    i = torch.randint(0, n, (rows,), generator=gen, device=gen.device).to(seqs.device)
    st = starts[i]
    u = torch.rand(rows, generator=gen, device=gen.device).to(seqs.device)
    anc = st + (u * (s - block - st).clamp_min(1).float()).long()  # a full block inside the sequence
    was = drafter.training
    drafter.eval()
    with torch.no_grad(), _autocast(seqs.device):
        logits, truth = draft_rows(drafter, embed, lm_head, seqs[i], feats[i], anc, block, mask_id)
    drafter.train(was)
    from .markov import accept_lengths

    return float(accept_lengths(logits, truth)["chain"].float().mean())


def train_drafter(drafter, target, data, p: Preset, steps: int, gen, device, log_every: int,
                  seconds: Optional[float] = None) -> dict:
    torch = _torch()
    seqs, feats, starts = data
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    for prm in target.parameters():
        prm.requires_grad_(False)
    drafter.train()
    opt = torch.optim.AdamW(drafter.parameters(), lr=p.drafter_lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = _Schedule(opt, p.drafter_lr, steps, seconds)
    n, s = seqs.shape
    held = 0
    if p.drafter_chain_target is not None:  # the last sequences are the stop check's, never trained on
        held = max(1, min(256, n // 8))
        n -= held
        eval_gen = torch.Generator(device=gen.device).manual_seed(12345)
    checks = []
    losses = []
    while sched.next():
        step = sched.step
        idx = torch.randint(0, n, (p.drafter_batch,), generator=gen, device=gen.device).to(device)
        st = starts[idx]
        u = torch.rand(p.drafter_batch, p.anchors, generator=gen, device=gen.device).to(device)
        anchors = st.unsqueeze(1) + (u * (s - 1 - st).unsqueeze(1).float()).long()  # in [start, s - 2]
        with _autocast(device):
            loss, acc1 = drafter_loss(drafter, embed, lm_head, seqs[idx], feats[idx], anchors, p.block,
                                      p.vocab - 1, p.loss_gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or sched.last():
            v = _finite(float(loss.detach()), "drafter", step)
            losses.append([step, round(v, 5)])
            _log(f"  drafter step {step + 1}/{steps} loss {v:.4f} depth-1 acc {float(acc1):.3f} lr {sched.lr:.2e} "
                 f"({sched.elapsed():.1f}s)")
        if held and (step + 1) % p.drafter_eval_every == 0:
            eval_gen.manual_seed(12345)  # the same anchors at every check
            c = held_out_chain(drafter, embed, lm_head, seqs[n:], feats[n:], starts[n:], p.block, p.vocab - 1,
                               eval_gen)
            checks.append([step + 1, round(c, 3)])
            if c >= p.drafter_chain_target:
                _log(f"  drafter step {step + 1}: held-out chain accept {c:.3f} >= {p.drafter_chain_target}: stop")
                sched.reason = "chain_target"
                break
    drafter.eval()
    out = sched.summary(losses)
    if held:
        out["chain_target"] = p.drafter_chain_target
        out["held_out_chain_checks"] = checks
        out["held_out_sequences"] = held
    return out


def draft_rows(drafter, embed, lm_head, seq, feats, anchors, block: int, mask_id: int):
    """The drafter's logits at depths ``1..blk-1`` for one block per row, as one SGLang draft step each.

    ``seq`` [R, S], ``feats`` [R, S, F], ``anchors`` [R]: row ``r`` drafts the block whose bonus is
    ``seq[r, anchors[r]]`` from the context ``[0, anchors[r])``.  Returns ``(logits [R, blk-1, V]
    float32, truth [R, blk-1])``; ``truth`` is the sequence's own continuation (clamped at its end)."""
    torch = _torch()
    r, s = seq.shape
    ids, pos, mask, labels, _ = block_layout(anchors.view(r, 1), s, block, mask_id, seq)
    hidden = drafter(embed(ids), pos, feats, torch.arange(s, device=seq.device).expand(r, -1), mask)
    logits = lm_head(hidden).float()
    return logits[:, 1:], labels[:, 0, 1:]


def _walk_mean(lengths, n: int) -> float:
    """:func:`markov.decode_walk`'s accept length over ``n`` texts whose per-anchor lengths are ``lengths``
    (text-major, as :func:`offline_accept` lays its rows out), less each text's last anchor: a step there that
    accepts its whole block would end one token past the text."""
    from .markov import decode_walk

    w = decode_walk(lengths.view(n, -1)[:, :-1])
    return round(w["tokens"] / max(1, w["steps"]), 3)


def offline_accept(drafter, target, prompts, gen_tokens, p: Preset, device, budgets=BUDGETS, rows: int = 512) -> dict:
    """Chain (blocks 8 and 16) and DDTree (``budgets``) accept lengths of the drafter on the greedy text.

    Anchors: every position ``p`` of the target's greedy continuation with a full block inside it
    (``prompt_len <= p <= S - blk``).  Trees: the plugin's candidate path (top-K per depth with the
    tie rule, K = B) and ``build_tree_from_candidates`` on CPU tensors (its torch builder, identical
    to the Triton one), walked with the true continuation.

    Two figures per chain and tree: ``chain_block<k>`` / ``tree_B<b>`` are the mean over every anchor (how good
    the drafter is at an arbitrary position); ``decode["chain_block<k>"]`` / ``decode["tree_B<b>"]`` are what a
    server decoding these prompts greedily reports (:func:`markov.decode_walk`: it visits only the anchors where
    its last step stopped, the hard ones), the figure to hold a served accept length against."""
    torch = _torch()
    from .markov import accept_lengths, expected_accept

    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    seq_all = torch.cat([prompts, gen_tokens], 1)
    n, s = seq_all.shape
    plen = prompts.shape[1]
    with torch.no_grad(), _autocast(device):
        feats_all = torch.cat([capture_features(target.model(input_ids=seq_all[i:i + 64], output_hidden_states=True),
                                                TARGET_LAYER_IDS) for i in range(0, n, 64)])
    blocks = sorted({b for b in (8, 16) if b <= p.block} | {p.block})
    kmax = min(max(budgets), p.vocab)
    res: Dict[str, object] = {}
    decode: Dict[str, float] = {}
    res["decode"] = decode
    for blk in blocks:
        anc = torch.arange(plen, s - blk + 1, device=device)
        row_seq = torch.arange(n, device=device).repeat_interleave(anc.numel())
        row_anc = anc.repeat(n)
        chain, ranks, prof_sum = [], [], None
        trees = {b: [] for b in budgets}
        for i in range(0, row_seq.numel(), rows):
            sq, an = row_seq[i:i + rows], row_anc[i:i + rows]
            with torch.no_grad(), _autocast(device):
                logits, truth = draft_rows(drafter, embed, lm_head, seq_all[sq], feats_all[sq], an, blk, p.vocab - 1)
            logits = logits.float()
            acc = accept_lengths(logits, truth, budgets if blk == p.block else ())
            chain.append(acc["chain"])
            if blk != p.block:
                continue
            ranks.append((logits > logits.gather(2, truth.unsqueeze(-1))).sum(-1).cpu())
            top = torch.topk(torch.softmax(logits, -1), kmax, -1).values.sum(0).double().cpu()
            prof_sum = top if prof_sum is None else prof_sum + top
            for b in budgets:
                trees[b].append(acc[f"tree_B{b}"])
        chain_t = torch.cat(chain).float()
        res[f"chain_block{blk}"] = round(float(chain_t.mean()), 3)
        decode[f"chain_block{blk}"] = _walk_mean(torch.cat(chain), n)
        if blk != p.block:
            continue
        rk = torch.cat(ranks)
        res["truth_rank_hist_per_depth"] = [
            [round(float((rk[:, d] == j).float().mean()), 4) for j in range(3)] + [round(float((rk[:, d] >= 3).float().mean()), 4)]
            for d in range(rk.shape[1])]  # [P(rank 0), P(1), P(2), P(>=3)] at depths 1..blk-1
        for b in budgets:
            t = torch.cat(trees[b]).float()
            res[f"tree_B{b}"] = round(float(t.mean()), 3)
            res[f"tree_B{b}_over_chain"] = round(float(t.mean()) / float(chain_t.mean()), 3)
            decode[f"tree_B{b}"] = _walk_mean(torch.cat(trees[b]), n)
        # the estimator on the measured profile (mean sorted probabilities, the truth's rank frequencies):
        # how far the independence model is from the direct measurement above
        prof = prof_sum / rk.shape[0]
        rp = torch.stack([torch.bincount(rk[:, d].clamp_max(kmax), minlength=kmax + 1)[:kmax]
                          for d in range(rk.shape[1])]).double() / rk.shape[0]
        prof = torch.sort(prof, -1, descending=True).values
        res["estimator"] = {f"B{b}": {k: round(v, 3) for k, v in expected_accept(prof, b, rank_probs=rp).items()}
                            for b in budgets}
        res["anchors"] = int(rk.shape[0])
    return res


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
def write_target(model, cfg: dict, out: Path) -> None:
    torch = _torch()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    # transformers may drop fields SGLang reads (full_attention_interval): write the config we mean
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")


def write_drafter(drafter, cfg: dict, out: Path) -> None:
    torch = _torch()
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    t = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 20), b""):
            h.update(blk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def _check_env(device: str):
    try:
        import torch
        import transformers
        import safetensors  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"trainkit: needs torch, transformers and safetensors: {e}")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("trainkit: --device cuda but torch.cuda.is_available() is False")
    return torch, transformers


def run(out_dir: str, seed: int, families, device: str, preset: Preset, preset_name: str,
        target_steps: Optional[int] = None, drafter_steps: Optional[int] = None, log_every: int = 50) -> dict:
    torch, transformers = _check_env(device)
    from . import markov

    t_start = time.time()
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"trainkit: {out} exists and is not empty; pick a new OUT (nothing was changed)")
    part = out.with_name(out.name + ".partial")
    if part.exists():  # a failed earlier run's output, never renamed to OUT
        _log(f"removing {part} left by an earlier run that did not finish")
        shutil.rmtree(part)
    part.mkdir(parents=True)
    p = dataclasses.replace(preset, **{k: v for k, v in (("target_steps", target_steps),
                                                          ("drafter_steps", drafter_steps)) if v is not None})
    if p.seq_len < p.prompt_len + p.eval_new:
        raise SystemExit(f"trainkit: seq_len {p.seq_len} < prompt_len + eval_new ({p.prompt_len + p.eval_new})")
    validate_layer_ids(TARGET_LAYER_IDS, NUM_LAYERS)
    torch.manual_seed(seed)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the fp32 master weights' matmuls outside autocast
    source = markov.make_source(seed, vocab=p.vocab, member_noise=p.member_noise, components=p.components,
                                device=dev)
    eval_gen = torch.Generator(device=dev).manual_seed(seed + 7919)
    prompts, regimes = source.sample(p.eval_prompts, p.prompt_len, eval_gen, device=dev)
    src_greedy = source.greedy_continuation(prompts, regimes, p.eval_new)
    entropy = -sum(q * math.log(q) for q in source.probs) - source.tail_prob * math.log(source.tail_prob / source.tail.shape[1])
    _log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {dev}, preset {preset_name}, "
         f"seed {seed}; source: vocab {p.vocab}, slot probs {source.probs}, entropy rate {entropy:.4f} nats")
    manifest = {"argv": sys.argv, "seed": seed, "preset": preset_name, "params": dataclasses.asdict(p), "device": str(dev),
                "torch": torch.__version__, "transformers": transformers.__version__,
                "source": {"vocab": p.vocab, "families": source.num_families, "member_noise": source.member_noise,
                           "components": source.components,
                           "probs": list(source.probs), "tail_prob": round(source.tail_prob, 6),
                           "n_tail": int(source.tail.shape[1]), "entropy_rate_nats": round(entropy, 5),
                           "mask_token_id": source.mask_token_id},
                "target_layer_ids": TARGET_LAYER_IDS, "families": {}}
    with open(part / "prompts.jsonl", "w") as f:
        for i, (pr, r, g) in enumerate(zip(prompts.tolist(), regimes.tolist(), src_greedy.tolist())):
            f.write(json.dumps({"id": i, "input_ids": pr, "regime": r, "source_greedy": g}) + "\n")
    for fi, family in enumerate(families):
        t_fam = time.time()
        gen = torch.Generator(device=dev).manual_seed(seed * 1000 + 17 * (fi + 1))
        _log(f"{family}: building the target")
        target, tcfg = build_target(family, p, seed + fi, dev)
        nparams = sum(x.numel() for x in target.parameters())
        _log(f"{family}: target {tcfg['architectures'][0]}, {nparams / 1e6:.2f}M params; training {p.target_steps} steps "
             f"x {p.target_batch} x {p.seq_len} tokens")
        tinfo = train_target(target, source, p, p.target_steps, gen, dev, log_every, p.target_seconds)
        tinfo["excess_loss_nats"] = round(tinfo["losses"][-1][1] - entropy, 4)
        t_eval = time.time()
        agree, gen_tokens = eval_target(target, source, prompts, regimes, p.eval_new, dev)
        _log(f"{family}: greedy vs source on {p.eval_prompts} held-out prompts x {p.eval_new}: {agree} "
             f"({time.time() - t_eval:.1f}s)")
        t_d = time.time()
        data = drafter_dataset(target, source, p, gen, dev)
        _log(f"{family}: drafter data {data[0].shape[0]} sequences of prompt + target greedy text "
             f"(token agreement with the source's greedy {data[3]:.4f}) ({time.time() - t_d:.1f}s)")
        dcfg = drafter_config(family, p)
        torch.manual_seed(seed + 100 + fi)
        drafter = DFlashDrafter(dcfg).to(dev)
        dinfo = train_drafter(drafter, target, data[:3], p, p.drafter_steps, gen, dev, log_every, p.drafter_seconds)
        data_agree = round(data[3], 4)
        del data
        t_o = time.time()
        est = offline_accept(drafter, target, prompts, gen_tokens, p, dev)
        _log(f"{family}: offline accept ({est.get('anchors')} anchors, {time.time() - t_o:.1f}s): "
             + ", ".join(f"{k} {v}" for k, v in est.items() if k.startswith(("chain", "tree"))))
        _log(f"{family}: decoded as a server does (the anchors where each step stopped): "
             + ", ".join(f"{k} {v}" for k, v in est["decode"].items()))
        _log(f"{family}: truth rank per depth [r0, r1, r2, r3+]: {est.get('truth_rank_hist_per_depth', [])[:6]}")
        write_target(target, tcfg, part / f"{family}-target")
        write_drafter(drafter, dcfg, part / f"{family}-drafter")
        manifest["families"][family] = {"target": tinfo, "greedy": agree, "drafter": dinfo,
                                        "drafter_data_source_greedy_agreement": data_agree,
                                        "offline": est, "seconds": round(time.time() - t_fam, 1)}
        _log(f"{family}: done in {time.time() - t_fam:.1f}s")
        del target, drafter
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    files = {}
    for path in sorted(part.rglob("*")):
        if path.is_file():
            files[str(path.relative_to(part))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    weights = sum(v["bytes"] for k, v in files.items() if k.endswith(".safetensors"))
    manifest["files"] = files
    manifest["checkpoint_bytes"] = weights
    manifest["seconds"] = round(time.time() - t_start, 1)
    if weights > MAX_BYTES:
        raise SystemExit(f"trainkit: checkpoints are {weights / 2**20:.1f} MiB > 64 MiB; left in {part}")
    (part / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if out.exists():
        out.rmdir()
    os.replace(part, out)
    _log(f"wrote {out} ({weights / 2**20:.1f} MiB of checkpoints) in {manifest['seconds']}s")
    for fam, fm in manifest["families"].items():
        o, g = fm["offline"], fm["greedy"]
        _log(f"SUMMARY {fam}: target greedy = source greedy on {g['greedy_all_equal']}/{g['prompts']} prompts "
             f"(prefix agreement {g['greedy_prefix_agreement']}, teacher-forced {g['teacher_forced_agreement']}); "
             + "; ".join(f"{k} {v}" for k, v in o.items() if k.startswith(("chain", "tree")))
             + "; decoded: " + "; ".join(f"{k} {v}" for k, v in o["decode"].items()))
    return manifest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.trainkit", description=__doc__.split("\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", choices=FAMILIES + ("both",), default="both")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None,
                    help="full (default on cuda) or toy (default on cpu)")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--drafter-steps", type=int, default=None)
    ap.add_argument("--target-seconds", type=float, default=None,
                    help="wall-clock cap of each target's training (0: none; default: the preset's)")
    ap.add_argument("--drafter-seconds", type=float, default=None,
                    help="wall-clock cap of each drafter's training (0: none; default: the preset's)")
    ap.add_argument("--member-noise", type=float, default=None,
                    help="the language's share of per-token member rules, 0..1 (default 0): higher makes the "
                         "drafter's deeper guesses harder (and the target's training longer)")
    ap.add_argument("--components", type=int, default=None,
                    help="length of the language's regime vector, 1..9 (default 4): fewer makes the drafter's job "
                         "easier (1 let it memorise the greedy future at small scale)")
    ap.add_argument("--drafter-chain-target", type=float, default=None,
                    help="stop the drafter's training once its held-out chain accept length (preset block, bonus "
                         "included) reaches this; 0 trains to the end (default: the preset's, full 4.0, else none)")
    ap.add_argument("--log-every", type=int, default=None)
    a = ap.parse_args(argv)
    name = a.preset or ("full" if a.device.startswith("cuda") else "toy")
    fams = FAMILIES if a.family == "both" else (a.family,)
    for v, flag in ((a.target_steps, "--target-steps"), (a.drafter_steps, "--drafter-steps")):
        if v is not None and v < 1:
            ap.error(f"{flag} must be >= 1")
    log_every = a.log_every or (100 if name == "full" else 4)
    preset = PRESETS[name]
    caps = {k: (v or None) for k, v in (("target_seconds", a.target_seconds), ("drafter_seconds", a.drafter_seconds))
            if v is not None}
    if any(v is not None and v < 0 for v in caps.values()):
        ap.error("--target-seconds / --drafter-seconds must be >= 0")
    if a.member_noise is not None:
        if not 0.0 <= a.member_noise <= 1.0:
            ap.error("--member-noise must be in [0, 1]")
        caps["member_noise"] = a.member_noise
    if a.components is not None:
        if not 1 <= a.components <= 9:
            ap.error("--components must be in [1, 9]")
        caps["components"] = a.components
    if a.drafter_chain_target is not None:
        if a.drafter_chain_target != 0 and not 1.0 < a.drafter_chain_target <= preset.block:
            ap.error(f"--drafter-chain-target must be 0 (none) or in (1, {preset.block}]")
        caps["drafter_chain_target"] = a.drafter_chain_target or None
    preset = dataclasses.replace(preset, **caps)
    run(a.out_dir, a.seed, fams, a.device, preset, name, a.target_steps, a.drafter_steps, log_every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
