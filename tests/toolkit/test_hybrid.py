"""The hybrid-model gate over real-shaped config.json files."""
from __future__ import annotations

import pytest

from deploy.release import hybrid

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 36}
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
              "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12}
QWEN35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
          "text_config": {"model_type": "qwen3_5_text",
                          "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
              "hybrid_override_pattern": "M-M-M*-M-M-"}
JAMBA = {"architectures": ["JambaForCausalLM"], "model_type": "jamba", "attn_layer_period": 8}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.mark.parametrize("cfg", [QWEN3, LLAMA])
def test_dense_models_are_not_hybrid(cfg):
    assert hybrid.hybrid_reason(cfg) is None


@pytest.mark.parametrize("cfg, word", [(QWEN3_NEXT, "36/48 recurrent"), (QWEN35, "text_config.layer_types"),
                                       (NEMOTRON_H, "nemotron_h"), (JAMBA, "jamba")])
def test_hybrid_models_are_detected(cfg, word):
    assert word in hybrid.hybrid_reason(cfg)


def test_decide():
    r = hybrid.hybrid_reason(QWEN3_NEXT)
    assert hybrid.decide("tree-verify", r, {}, False)[0] == "refuse"
    assert hybrid.decide("tree-verify", r, {"tree_aware_recurrent_state": False}, False)[0] == "refuse"
    v, msg = hybrid.decide("tree-verify", r, {}, True)
    assert v == "unsafe" and "MAY DIFFER" in msg
    assert hybrid.decide("tree-verify", r, {"tree_aware_recurrent_state": True}, False)[0] == "ok"
    assert hybrid.decide("shadow-linear", r, {}, False)[0] == "ok"
    assert hybrid.decide("tree-verify", None, {}, False)[0] == "ok"


def test_mode_supported():
    assert hybrid.mode_supported("tree-verify", {"modes": ["tree-verify"]})
    assert not hybrid.mode_supported("shadow-linear", {"modes": ["tree-verify"]})
    assert hybrid.mode_supported("linear", {"modes": []}) and hybrid.mode_supported("tree-verify", {})
