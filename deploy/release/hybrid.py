"""The hybrid-model gate: tree-verify on a model with recurrent layers (Mamba, GDN, linear attention) needs a
plugin that keeps recurrent state per tree node. Pure functions over a model's config.json (read on the host)
and the plugin's capabilities.json (read from the wheel, SGLang is never imported).
"""
from __future__ import annotations

import re

from .. import contract

RECURRENT_LAYER_RE = re.compile(r"mamba|linear[_-]?attention|gated[_-]?delta|gdn|ssm|recurrent|rwkv|deltanet", re.I)
HYBRID_MODEL_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "jamba", "nemotron_h", "falcon_h1", "granitemoehybrid",
                      "zamba", "zamba2", "bamba", "mamba", "mamba2", "lfm2", "plamo2", "minimax", "minimax_m1",
                      "kimi_linear", "hunyuan_v1_hybrid"}
HYBRID_KEYS = ("linear_attn_config", "full_attention_interval", "linear_num_value_heads", "mamba_d_state",
               "ssm_state_size", "mamba_expand", "attn_layer_period", "hybrid_override_pattern")
CAPABILITY = "tree_aware_recurrent_state"


def hybrid_reason(config: dict) -> str | None:
    """Why this config.json describes a hybrid recurrent model, or None. Looks into `text_config` too."""
    scopes = [(c, w) for c, w in ((config, ""), (config.get("text_config"), "text_config.")) if isinstance(c, dict)]
    for cfg, where in scopes:  # the layer list is the strongest evidence: name it first
        for key in ("layer_types", "layers_block_type", "block_types"):
            kinds = cfg.get(key)
            if isinstance(kinds, list):
                rec = sorted({str(k) for k in kinds if RECURRENT_LAYER_RE.search(str(k))})
                if rec:
                    n = sum(1 for k in kinds if RECURRENT_LAYER_RE.search(str(k)))
                    return f"{where}{key} has {n}/{len(kinds)} recurrent layers ({', '.join(rec)})"
    for cfg, where in scopes:
        mt = str(cfg.get("model_type", "")).lower()
        if mt in HYBRID_MODEL_TYPES:
            return f"{where}model_type {mt!r} is a hybrid recurrent architecture"
        for a in cfg.get("architectures") or []:
            if re.search(r"mamba|jamba|nemotronh|qwen3next|qwen3_5|falconh1|zamba|bamba|hybrid|linear", str(a), re.I):
                return f"{where}architectures has {a}"
        for k in HYBRID_KEYS:
            if cfg.get(k) not in (None, [], {}):
                return f"{where}{k} is set (recurrent layers)"
    return None


def decide(mode: str, reason: str | None, capabilities: dict, allow_unsafe: bool) -> tuple[str, str]:
    """('ok'|'unsafe'|'refuse', message) for one service."""
    if mode != contract.TREE_VERIFY or reason is None:
        return "ok", ""
    if capabilities.get(CAPABILITY) is True:
        return "ok", f"hybrid model ({reason}); the plugin declares {CAPABILITY}"
    if allow_unsafe:
        return "unsafe", (f"tree-verify on a hybrid model ({reason}) with a plugin that does not declare "
                          f"{CAPABILITY}: sibling tree nodes share recurrent state, OUTPUTS MAY DIFFER FROM THE "
                          f"MODEL'S (--allow-hybrid-unsafe)")
    return "refuse", (f"tree-verify refused: hybrid model ({reason}) and the plugin in this release does not "
                      f"declare {CAPABILITY}; use shadow-linear or linear, or --allow-hybrid-unsafe to accept "
                      f"outputs that may differ from the model's")


def mode_supported(mode: str, capabilities: dict) -> bool:
    """A DDTree mode must be listed in the plugin's declared modes, when it declares any."""
    modes = capabilities.get("modes")
    if mode == contract.LINEAR or not isinstance(modes, list):
        return True
    return mode in modes
