"""Tensor-parallel services: the checks a TP group (one SGLang server over several GPUs) must pass, pure.

* Heads: SGLang splits attention heads over the group (QKVParallelLinear): ``num_attention_heads`` must be a
  multiple of tp, and ``num_key_value_heads`` a multiple of tp or a divisor of it (then each KV head is
  replicated ``tp / kv`` times). Read from the model's config.json (the text config of a multimodal model).
* P2P: the GPUs' links as ``nvidia-smi topo -m`` prints them (deploy/facts.py parses the matrix). NVLink
  (``NV#``) and PCIe paths that stay under one host bridge (``PIX``, ``PXB``, ``PHB``) carry peer-to-peer;
  ``NODE`` (across host bridges) and ``SYS`` (across the CPU sockets' interconnect) do not: NCCL then stages
  every all-reduce through host memory, and SGLang's custom all-reduce (CUDA IPC) cannot run. A group over such
  a link is refused unless its service says ``accept_no_p2p: true``.
"""
from __future__ import annotations

import re

P2P_LINKS = ("PIX", "PXB", "PHB")     # PCIe paths under one host bridge; NV# is NVLink
NO_P2P_LINKS = ("NODE", "SYS", "SOC")  # SOC: older drivers' name of SYS


def heads(config: dict) -> tuple[int | None, int | None]:
    """(num_attention_heads, num_key_value_heads) of a model's config.json (its text_config / llm_config where
    the model nests one); None where the config does not say."""
    for c in (config, config.get("text_config"), config.get("llm_config")):
        if isinstance(c, dict) and isinstance(c.get("num_attention_heads"), int):
            kv = c.get("num_key_value_heads")
            return c["num_attention_heads"], kv if isinstance(kv, int) and kv > 0 else c["num_attention_heads"]
    return None, None


def heads_problem(config: dict, tp: int) -> str | None:
    """Why a model with this config.json cannot be split over ``tp`` GPUs (None when it can, or tp is 1);
    'not checked: ...' when the config names no attention heads."""
    if tp <= 1:
        return None
    h, kv = heads(config)
    if h is None:
        return "not checked: its config.json names no num_attention_heads"
    if h % tp:
        return f"num_attention_heads {h} is not a multiple of tp {tp}"
    if kv % tp and tp % kv:
        return f"num_key_value_heads {kv} neither divides nor is a multiple of tp {tp}"
    return None


def link_p2p(link: str) -> bool | None:
    """Whether a `nvidia-smi topo -m` cell lets two GPUs do peer-to-peer: True (NV#, PIX, PXB, PHB), False
    (NODE, SYS), None (a cell this table does not know)."""
    if re.fullmatch(r"NV\d+", link) or link in P2P_LINKS:
        return True
    if link in NO_P2P_LINKS:
        return False
    return None


def p2p_problem(matrix: dict, gpus) -> str | None:
    """Why the GPUs `gpus` cannot form a P2P group per the parsed matrix ({"GPU0": {"GPU1": "NV18", ...}}), or
    None when every pair can. Pairs the matrix does not name are problems (never assumed fine)."""
    bad = []
    gpus = list(gpus)
    for i, a in enumerate(gpus):
        for b in gpus[i + 1:]:
            link = (matrix.get(f"GPU{a}") or {}).get(f"GPU{b}")
            if link is None:
                bad.append(f"GPU{a}-GPU{b} not in the matrix")
            elif not link_p2p(link):
                bad.append(f"GPU{a}-GPU{b} {link}")
    if not bad:
        return None
    return ("no peer-to-peer between " + ", ".join(bad) + " (nvidia-smi topo -m: NODE/SYS cross host bridges or "
            "CPU sockets; NCCL would stage every all-reduce through host memory)")
