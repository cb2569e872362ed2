"""The tiny-model kit (sglang_ddtree_tools.tiny): configs SGLang reads, and seeded weights that load."""

import json

import pytest

from sglang_ddtree_tools import tiny


def test_configs_are_what_sglang_0517_can_serve():
    h = tiny.target_config("hybrid")
    assert h["architectures"] == ["Qwen3NextForCausalLM"]
    assert h["full_attention_interval"] == 2 and h["linear_conv_kernel_dim"] == 4
    assert h["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert h["num_experts_per_tok"] == h["num_experts"]  # no routing flips between kernels
    d = tiny.target_config("dense")
    assert d["architectures"] == ["Qwen3ForCausalLM"] and "layer_types" not in d
    for fam in tiny.FAMILIES:
        dr = tiny.drafter_config(fam)
        assert dr["architectures"] == ["DFlashDraftModel"] and dr["hidden_size"] == tiny.target_config(fam)["hidden_size"]
        dc = dr["dflash_config"]
        assert dc["num_target_layers"] == tiny.target_config(fam)["num_hidden_layers"]
        assert max(dc["target_layer_ids"]) < dc["num_target_layers"]
        assert dc["mask_token_id"] < tiny.target_config(fam)["vocab_size"]
    with pytest.raises(ValueError, match="unknown tiny family"):
        tiny.target_config("moe")


@pytest.mark.sglang_api
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_writes_seeded_weights_that_load_and_vary(family, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    paths = tiny.write_family(tmp_path, family, seed=0)
    cfg = json.loads((tmp_path / f"{family}-target" / "config.json").read_text())
    assert cfg == tiny.target_config(family)
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32)
    ids = torch.tensor([[5, 900, 17, 3000, 42, 7]])
    out = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=2)[0, 6:].tolist()
    assert len(set(out)) >= 1 and any(t in tiny.PRIOR_TOKENS for t in out)
    w = model.lm_head.weight
    assert float(w[list(tiny.PRIOR_TOKENS), 0].max()) > 0 and float(w[:900, 0].abs().max()) == 0
    # seeded: the same seed writes the same tensors; another seed does not
    again = tiny.write_family(tmp_path / "again", family, seed=0)
    other = tiny.write_family(tmp_path / "other", family, seed=1)
    a, b = load_file(paths["drafter"] + "/model.safetensors"), load_file(again["drafter"] + "/model.safetensors")
    c = load_file(other["drafter"] + "/model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["fc.weight"], c["fc.weight"])
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= set(a)


def test_written_models_are_readable_by_the_servers_user_whatever_the_writer_chose(tmp_path, monkeypatch):
    """transformers' shard writer leaves 0600 files: a server run as the service user could list the model folder
    but not open its weights. write_family leaves every file 0644 (the folder's owner decides who gets in)."""
    import os
    import stat

    from sglang_ddtree_tools import tiny as tinymod

    def private(out, family, seed):
        out.mkdir(parents=True, exist_ok=True)
        for n in ("model.safetensors", "config.json"):
            fd = os.open(out / n, os.O_WRONLY | os.O_CREAT, 0o600)
            os.close(fd)
        (out / "sub").mkdir(mode=0o700)
    monkeypatch.setattr(tinymod, "_write_target", private)
    monkeypatch.setattr(tinymod, "_write_drafter", private)
    paths = tinymod.write_family(tmp_path, "hybrid")
    for d in paths.values():
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o755
        assert stat.S_IMODE(os.stat(os.path.join(d, "sub")).st_mode) == 0o755
        for n in ("model.safetensors", "config.json"):
            assert stat.S_IMODE(os.stat(os.path.join(d, n)).st_mode) == 0o644
