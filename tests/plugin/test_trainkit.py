"""The training kit (sglang_ddtree_tools.trainkit): configs SGLang reads, training that learns, checkpoints that
round-trip, determinism per seed, and the drafter being SGLang 0.5.17's DFlash computation."""

import dataclasses
import hashlib
import importlib.metadata
import json
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from sglang_ddtree_tools import markov, trainkit as tk  # noqa: E402

TOY = tk.PRESETS["toy"]


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_configs_keep_tiny_architecture_and_carry_what_sglang_reads():
    for fam in tk.FAMILIES:
        p = tk.PRESETS["full"]
        t, d = tk.target_config(fam, p), tk.drafter_config(fam, p)
        assert t["vocab_size"] == d["vocab_size"] == p.vocab and t["hidden_size"] == d["hidden_size"] == p.hidden
        assert t["num_hidden_layers"] == tk.NUM_LAYERS and t["torch_dtype"] == "bfloat16"
        assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
        dc = d["dflash_config"]
        assert dc == {"block_size": p.block, "num_target_layers": tk.NUM_LAYERS, "target_layer_ids": [1, 2],
                      "mask_token_id": p.vocab - 1}
        assert d["num_target_layers"] == tk.NUM_LAYERS and d["block_size"] == p.block
        assert max(dc["target_layer_ids"]) < tk.NUM_LAYERS - 1  # SGLang captures before layer id + 1
    h = tk.target_config("hybrid", tk.PRESETS["full"])
    assert h["architectures"] == ["Qwen3NextForCausalLM"] and h["full_attention_interval"] == 2
    assert h["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert h["num_experts_per_tok"] == h["num_experts"] == 2
    assert tk.target_config("dense", TOY)["architectures"] == ["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="target_layer_ids"):
        tk.validate_layer_ids([1, 3], 4)
    with pytest.raises(ValueError, match="target_layer_ids"):
        tk.validate_layer_ids([2, 1], 4)


@pytest.mark.parametrize("family", tk.FAMILIES)
def test_captured_features_are_the_layer_outputs_sglang_captures(family):
    model, _ = tk.build_target(family, TOY, 0, "cpu")
    outs = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda m, a, o, i=i: outs.__setitem__(i, o[0] if isinstance(o, tuple) else o)) for i in range(tk.NUM_LAYERS)]
    x = torch.randint(4, TOY.vocab - 1, (2, 9))
    with torch.no_grad():
        out = model.model(input_ids=x, output_hidden_states=True)
    for h in hooks:
        h.remove()
    feats = tk.capture_features(out, tk.TARGET_LAYER_IDS)
    assert torch.equal(feats, torch.cat([outs[i] for i in tk.TARGET_LAYER_IDS], -1))


def test_block_layout_masks_context_before_the_anchor_and_other_blocks():
    seq = torch.arange(10, 30).unsqueeze(0)  # one sequence of 20 tokens
    anchors = torch.tensor([[5, 17]])
    ids, pos, mask, labels, valid = tk.block_layout(anchors, 20, 4, 99, seq)
    assert ids.tolist() == [[15, 99, 99, 99, 27, 99, 99, 99]]
    assert pos.tolist() == [[5, 6, 7, 8, 17, 18, 19, 20]]
    assert labels.tolist() == [[[15, 16, 17, 18], [27, 28, 29, 29]]] and valid[0, 1].tolist() == [True] * 3 + [False]
    m = mask[0]
    assert m[0, :20].tolist() == [True] * 5 + [False] * 15  # context strictly before the bonus
    assert m[4, :20].tolist() == [True] * 17 + [False] * 3
    assert m[0, 20:].tolist() == [True] * 4 + [False] * 4 and m[7, 20:].tolist() == [False] * 4 + [True] * 4


def test_a_few_steps_reduce_both_losses():
    p = dataclasses.replace(TOY, target_steps=12, drafter_steps=12, drafter_seqs=16)
    src = markov.make_source(0, vocab=p.vocab)
    g = torch.Generator().manual_seed(0)
    target, _ = tk.build_target("dense", p, 0, "cpu")
    info = tk.train_target(target, src, p, p.target_steps, g, "cpu", log_every=1)
    first, last = info["losses"][0][1], min(v for _, v in info["losses"][-3:])
    assert info["steps"] == 12 and info["ended_by"] == "steps"
    assert last < first - 0.5, info["losses"]
    data = tk.drafter_dataset(target, src, p, g, "cpu")
    drafter = tk.DFlashDrafter(tk.drafter_config("dense", p))
    dinfo = tk.train_drafter(drafter, target, data[:3], p, p.drafter_steps, g, "cpu", log_every=1)
    assert min(v for _, v in dinfo["losses"][-3:]) < dinfo["losses"][0][1] - 0.2, dinfo["losses"]


def test_time_cap_ends_a_phase_with_the_schedule_completed():
    p = dataclasses.replace(TOY, target_steps=10_000)
    target, _ = tk.build_target("dense", p, 0, "cpu")
    info = tk.train_target(target, markov.make_source(0, vocab=p.vocab), p, p.target_steps,
                           torch.Generator().manual_seed(0), "cpu", log_every=10_000, seconds=1.0)
    assert info["ended_by"] == "seconds" and 1 <= info["steps"] < 10_000


def test_chain_target_stops_the_drafter_on_held_out_sequences_and_says_so():
    p = dataclasses.replace(TOY, drafter_steps=40, drafter_eval_every=10)
    target, _ = tk.build_target("dense", p, 0, "cpu")
    data = tk.drafter_dataset(target, markov.make_source(0, vocab=p.vocab), p, torch.Generator().manual_seed(0), "cpu")

    def train(chain_target, steps=40):
        torch.manual_seed(3)  # the same drafter and batches each time: the same trajectory up to a stop
        return tk.train_drafter(tk.DFlashDrafter(tk.drafter_config("dense", p)), target, data[:3],
                                dataclasses.replace(p, drafter_chain_target=chain_target), steps,
                                torch.Generator().manual_seed(1), "cpu", log_every=1000)

    never = train(float(p.block))  # unreachable: trained to the end, checked every 10 steps on held-out rows
    assert never["ended_by"] == "steps" and never["steps"] == 40
    assert [s for s, _ in never["held_out_chain_checks"]] == [10, 20, 30, 40]
    assert all(1.0 <= c <= p.block for _, c in never["held_out_chain_checks"])
    first, c1 = never["held_out_chain_checks"][0]
    hit = train(c1)  # reached at the first check: stops there
    assert hit["ended_by"] == "chain_target" and hit["steps"] == first
    assert hit["held_out_chain_checks"] == [[first, c1]]
    torch.manual_seed(3)
    plain = tk.train_drafter(tk.DFlashDrafter(tk.drafter_config("dense", p)), target, data[:3], p, 2,
                             torch.Generator().manual_seed(1), "cpu", log_every=1000)
    assert "held_out_chain_checks" not in plain and plain["steps"] == 2


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("kit") / "tiny"
    manifest = tk.run(str(out), 0, tk.FAMILIES, "cpu", TOY, "toy", log_every=100)
    return out, manifest


def test_run_writes_both_pairs_prompts_and_a_manifest_that_checks_out(kit):
    out, manifest = kit
    for fam in tk.FAMILIES:
        tcfg = json.loads((out / f"{fam}-target" / "config.json").read_text())
        dcfg = json.loads((out / f"{fam}-drafter" / "config.json").read_text())
        assert tcfg == tk.target_config(fam, TOY) and dcfg == tk.drafter_config(fam, TOY)
        fm = manifest["families"][fam]
        assert {"chain_block8", "tree_B15", "tree_B31", "tree_B63"} <= set(fm["offline"])
        assert 0.0 <= fm["greedy"]["greedy_token_agreement"] <= 1.0 and fm["target"]["steps"] == TOY.target_steps
    assert not (out.parent / "tiny.partial").exists()
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json"}
    assert on_disk == set(manifest["files"])
    for rel, meta in manifest["files"].items():
        assert _sha(out / rel) == meta["sha256"] and (out / rel).stat().st_size == meta["bytes"]
    assert manifest["checkpoint_bytes"] <= tk.MAX_BYTES
    lines = [json.loads(x) for x in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(lines) == TOY.eval_prompts and all(len(x["input_ids"]) == TOY.prompt_len for x in lines)
    src = markov.make_source(0, vocab=TOY.vocab)
    first = torch.tensor([lines[0]["input_ids"]])
    assert src.greedy_continuation(first, torch.tensor([lines[0]["regime"]]), TOY.eval_new)[0].tolist() == \
        lines[0]["source_greedy"]


def test_an_existing_out_dir_is_refused_and_left_alone(kit):
    out, _ = kit
    before = _sha(out / "manifest.json")
    with pytest.raises(SystemExit, match="not empty"):
        tk.run(str(out), 0, ("dense",), "cpu", TOY, "toy")
    assert _sha(out / "manifest.json") == before


@pytest.mark.parametrize("family", tk.FAMILIES)
def test_checkpoints_reload(kit, family):
    from safetensors.torch import load_file

    out, _ = kit
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out / f"{family}-target"), dtype=torch.float32)
    assert type(model).__name__ == tk.target_config(family, TOY)["architectures"][0]
    x = torch.randint(4, TOY.vocab - 1, (1, 12))
    assert model(input_ids=x).logits.shape == (1, 12, TOY.vocab)
    keys = set(load_file(str(out / f"{family}-target" / "model.safetensors")))
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= keys  # untied head
    if family == "hybrid":  # per-expert names (SGLang 0.5.17's FusedMoE expert mapping), GDN and attention layers
        assert {"model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.linear_attn.in_proj_qkvz.weight",
                "model.layers.1.self_attn.q_proj.weight", "model.layers.3.mlp.shared_expert_gate.weight"} <= keys
    else:
        assert {"model.layers.3.self_attn.q_norm.weight", "model.layers.3.mlp.gate_proj.weight"} <= keys
    sd = load_file(str(out / f"{family}-drafter" / "model.safetensors"))
    want = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.0.{k}.weight" for k in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
            "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")}
    assert set(sd) == want and all(v.dtype == torch.bfloat16 for v in sd.values())
    cfg = tk.drafter_config(family, TOY)
    assert sd["fc.weight"].shape == (TOY.hidden, TOY.hidden * len(tk.TARGET_LAYER_IDS))
    drafter = tk.DFlashDrafter(cfg)
    drafter.load_state_dict({k: v.float() for k, v in sd.items()})


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a = tk.run(str(tmp_path / "a"), 5, ("dense",), "cpu", TOY, "toy", log_every=100)
    b = tk.run(str(tmp_path / "b"), 5, ("dense",), "cpu", TOY, "toy", log_every=100)
    c = tk.run(str(tmp_path / "c"), 6, ("dense",), "cpu", TOY, "toy", log_every=100)
    for rel in ("dense-target/model.safetensors", "dense-drafter/model.safetensors", "prompts.jsonl"):
        assert a["files"][rel]["sha256"] == b["files"][rel]["sha256"]
        assert a["files"][rel]["sha256"] != c["files"][rel]["sha256"]


# ------------------------------------------------------------------------------------------------
# the drafter against SGLang 0.5.17's own DFlash modules
# ------------------------------------------------------------------------------------------------
def _sglang_0517():
    try:
        ver = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("SGLang is not installed")
    if ver != "0.5.17":
        pytest.skip(f"SGLang {ver}: the drafter is checked against 0.5.17's DFlash (tests/test_plugin_sglang_versions"
                    ".py runs this file under 0.5.17)")


class _Linear(torch.nn.Module):
    """QKV/Merged/RowParallelLinear at tensor-parallel size 1: ``(x @ W.T, None)``, unquantized."""

    def __init__(self, w):
        super().__init__()
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

        self.weight = torch.nn.Parameter(w)
        self.bias = None
        self.quant_method = UnquantizedLinearMethod()

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class _PrefixAttention:
    """RadixAttention for one request in TARGET_VERIFY with an ENCODER_ONLY layer: the block's queries see the
    context K/V already in the cache plus every block token (non-causal).  Plain float64 softmax attention."""

    def __init__(self, ctx_k, ctx_v, nh, nkv, hd):
        self.ctx_k, self.ctx_v, self.nh, self.nkv, self.hd = ctx_k, ctx_v, nh, nkv, hd

    def __call__(self, q, k, v, forward_batch):
        kk = torch.cat([self.ctx_k.reshape(-1, self.nkv, self.hd), k.reshape(-1, self.nkv, self.hd)]).double()
        vv = torch.cat([self.ctx_v.reshape(-1, self.nkv, self.hd), v.reshape(-1, self.nkv, self.hd)]).double()
        qq = q.reshape(-1, self.nh, self.hd).double()
        rep = self.nh // self.nkv
        kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        w = torch.softmax(torch.einsum("qhd,khd->hqk", qq, kk) * self.hd ** -0.5, -1)
        return torch.einsum("hqk,khd->qhd", w, vv).reshape(q.shape[0], -1).to(q.dtype)


def _sglang_drafter(mine, cfg, monkeypatch):
    """SGLang 0.5.17's DFlashDraftModel / DFlashDecoderLayer / DFlashAttention / DFlashMLP objects (their own
    forward code) holding ``mine``'s weights; only the parallel linears and RadixAttention are stand-ins."""
    from sglang.srt.layers import activation, layernorm
    from sglang.srt.layers.rotary_embedding import base as rope_base
    from sglang.srt.models import dflash as sd

    # SGLang's rope picks a CUDA/vLLM kernel unless it believes it is on a CPU, and reads a published exec
    # config (so does SiluAndMul); neither concerns the math (forward_native is used below)
    exec_cfg = types.SimpleNamespace(deterministic=types.SimpleNamespace(rl_on_policy_target=None))
    monkeypatch.setattr(rope_base, "_is_cpu", True)
    monkeypatch.setattr(rope_base, "get_exec", lambda: exec_cfg)
    monkeypatch.setattr(activation, "get_exec", lambda: exec_cfg)
    from sglang.srt.layers.rotary_embedding import get_rope

    nn = torch.nn
    eps = cfg["rms_norm_eps"]

    def norm(w):
        n = layernorm.RMSNorm(w.shape[0], eps=eps)
        n.weight.data.copy_(w)
        n.forward = n.forward_native
        return n

    def new(cls):
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        return obj

    model = new(sd.DFlashDraftModel)
    model.config = types.SimpleNamespace(hidden_size=cfg["hidden_size"])
    model.num_context_features = len(cfg["dflash_config"]["target_layer_ids"])
    model.fc = nn.Linear(mine.fc.in_features, mine.fc.out_features, bias=False)
    model.fc.weight.data.copy_(mine.fc.weight)
    model.hidden_norm, model.norm = norm(mine.hidden_norm.weight), norm(mine.norm.weight)
    layers = []
    for ml in mine.layers:
        layer = new(sd.DFlashDecoderLayer)
        layer.input_layernorm = norm(ml.input_layernorm.weight)
        layer.post_attention_layernorm = norm(ml.post_attention_layernorm.weight)
        a, ma = new(sd.DFlashAttention), ml.self_attn
        a.num_heads, a.num_kv_heads, a.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        a.q_size, a.kv_size = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        a.qkv_proj = _Linear(torch.cat([ma.q_proj.weight, ma.k_proj.weight, ma.v_proj.weight]).detach().clone())
        a.o_proj = _Linear(ma.o_proj.weight.detach().clone())
        a.q_norm, a.k_norm = norm(ma.q_norm.weight), norm(ma.k_norm.weight)
        a.rotary_emb = get_rope(a.head_dim, rotary_dim=a.head_dim, max_position=cfg["max_position_embeddings"],
                                base=cfg["rope_theta"], is_neox_style=True)
        a.rotary_emb.forward = a.rotary_emb.forward_native
        layer.self_attn = a
        mlp = new(sd.DFlashMLP)
        mlp.gate_up_proj = _Linear(torch.cat([ml.mlp.gate_proj.weight, ml.mlp.up_proj.weight]).detach().clone())
        mlp.down_proj = _Linear(ml.mlp.down_proj.weight.detach().clone())
        mlp.act_fn = activation.SiluAndMul()
        mlp.act_fn.forward = mlp.act_fn.forward_native
        layer.mlp = mlp
        layers.append(layer)
    model.layers = nn.ModuleList(layers)
    return model


def _sglang_block(model, target_hidden, anchor, block_embeds):
    """One DFLASH draft step as SGLang 0.5.17's worker runs it: materialise the context [0, anchor) into each
    layer's KV (``_append_target_hidden_sequential``), then the draft forward of the block."""
    ctx = model.project_target_hidden(target_hidden[:anchor])
    ctx_pos = torch.arange(anchor)
    for layer in model.layers:
        attn = layer.self_attn
        k, v = attn.kv_proj_only(model.prepare_context_hidden_for_kv(layer, ctx))
        k = attn.apply_k_rope(ctx_pos, attn.apply_k_norm(k))
        attn.attn = _PrefixAttention(k, v, attn.num_heads, attn.num_kv_heads, attn.head_dim)
    blk = block_embeds.shape[0]
    out = model.forward(input_ids=None, positions=torch.arange(anchor, anchor + blk), forward_batch=None,
                        input_embeds=block_embeds)
    return out.hidden_states


def test_drafter_forward_is_sglang_0517_dflash(monkeypatch):
    _sglang_0517()
    torch.manual_seed(0)
    cfg = tk.drafter_config("dense", TOY)
    mine = tk.DFlashDrafter(cfg)
    with torch.no_grad():  # non-trivial norms
        for n, prm in mine.named_parameters():
            if n.endswith("norm.weight"):
                prm.add_(0.3 * torch.randn_like(prm))
    ref = _sglang_drafter(mine, cfg, monkeypatch)
    s, blk, h = 20, TOY.block, cfg["hidden_size"]
    seq = torch.randint(4, TOY.vocab - 1, (1, s))
    feats = torch.randn(1, s, h * len(tk.TARGET_LAYER_IDS))
    embed = torch.nn.Embedding(TOY.vocab, h)
    anchors = torch.tensor([[3, 9, 12]])
    ids, pos, mask, _, _ = tk.block_layout(anchors, s, blk, TOY.vocab - 1, seq)
    with torch.no_grad():
        got = mine(embed(ids), pos, feats, torch.arange(s).unsqueeze(0), mask)[0].view(3, blk, h)
        for n, a in enumerate(anchors[0].tolist()):
            want = _sglang_block(ref, feats[0], a, embed(ids[0, n * blk:(n + 1) * blk]))
            torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-4)
        # and the comparison has teeth: a causal block, or context up to the anchor itself, differ
        causal = mask.clone()
        causal[0, :, s:] &= torch.ones(3 * blk, 3 * blk, dtype=torch.bool).tril()
        assert not torch.allclose(mine(embed(ids), pos, feats, torch.arange(s).unsqueeze(0), causal)[0], got.view(-1, h),
                                  atol=1e-3)
        leaky = _sglang_block(ref, feats[0], int(anchors[0, 0]) + 1, embed(ids[0, :blk]))
        assert not torch.allclose(leaky, got[0], atol=1e-3)


def test_offline_tree_accept_is_the_deepest_tree_prefix_of_the_truth():
    from sglang_ddtree.tree import build_tree_reference

    g = torch.Generator().manual_seed(0)
    r, depth, v, budget = 64, 5, 12, 9
    logits = torch.randn(r, depth, v, generator=g) * 2
    # truths that follow the drafter's top ranks for a while, then leave them
    order = logits.argsort(-1, descending=True)
    pick = torch.randint(0, 3, (r, depth), generator=g)
    truth = order.gather(2, pick.unsqueeze(-1)).squeeze(-1)
    acc = markov.accept_lengths(logits, truth, (budget,))
    got = acc[f"tree_B{budget}"]
    want = []
    for i in range(r):
        tree = build_tree_reference(torch.log_softmax(logits[i].double(), -1), budget)
        prefixes = {tree.prefix_tokens(s) for s in range(1, tree.num_nodes + 1)}
        d = 0
        while d < depth and tuple(truth[i, : d + 1].tolist()) in prefixes:
            d += 1
        want.append(1 + d)
    assert got.tolist() == want
    assert len(set(want)) > 2  # the cases are not all alike
    chain = [1 + next((d for d in range(depth) if int(pick[i, d]) != 0), depth) for i in range(r)]
    assert acc["chain"].tolist() == chain  # (a small tree can be shallower than the chain: no order between them)


def test_draft_rows_is_the_training_layout_one_block_per_row():
    torch.manual_seed(1)
    cfg = tk.drafter_config("dense", TOY)
    drafter = tk.DFlashDrafter(cfg)
    lm_head = torch.nn.Linear(TOY.hidden, TOY.vocab, bias=False)
    embed = torch.nn.Embedding(TOY.vocab, TOY.hidden)
    s, blk = 24, TOY.block
    seq = torch.randint(8, TOY.vocab - 1, (1, s))
    feats = torch.randn(1, s, 2 * TOY.hidden)
    anchors = torch.tensor([[4, 10, 15]])
    with torch.no_grad():
        ids, pos, mask, labels, _ = tk.block_layout(anchors, s, blk, TOY.vocab - 1, seq)
        multi = lm_head(drafter(embed(ids), pos, feats, torch.arange(s)[None], mask)).view(3, blk, -1)[:, 1:]
        rows, truth = tk.draft_rows(drafter, embed, lm_head, seq.expand(3, -1), feats.expand(3, -1, -1),
                                    anchors[0], blk, TOY.vocab - 1)
    torch.testing.assert_close(rows, multi, rtol=1e-5, atol=1e-5)
    assert torch.equal(truth, labels[0, :, 1:])


def test_cli_refuses_bad_flags_before_writing(tmp_path, capsys):
    out = tmp_path / "never"
    for argv in (["--member-noise", "2"], ["--target-steps", "0"], ["--target-seconds", "-1"], ["--components", "0"],
                 ["--drafter-chain-target", "1"], ["--drafter-chain-target", "99"]):
        with pytest.raises(SystemExit) as e:
            tk.main([str(out), "--device", "cpu", *argv])
        assert e.value.code == 2
    assert "must be" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "never.partial").exists()


def test_sglang_0517_reads_the_written_drafter_config(kit):
    _sglang_0517()
    from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config

    out, _ = kit
    for fam in tk.FAMILIES:
        cfg = transformers.AutoConfig.from_pretrained(str(out / f"{fam}-drafter"))  # as SGLang's get_config loads it
        dc = parse_dflash_draft_config(draft_hf_config=cfg)
        assert dc.resolve_block_size(default=None) == TOY.block
        assert dc.mask_token_id == TOY.vocab - 1
        assert list(dc.resolve_target_layer_ids(target_num_layers=tk.NUM_LAYERS, draft_num_layers=1)) == \
            tk.TARGET_LAYER_IDS


def test_the_gpu_kit_stops_its_drafter_at_chain_4_by_default_and_0_trains_to_the_end(monkeypatch, tmp_path):
    got = {}
    monkeypatch.setattr(tk, "run", lambda out, seed, fams, dev, preset, name, *a, **k: got.update(p=preset, name=name))
    tk.main([str(tmp_path / "a"), "--device", "cuda"])
    assert got["name"] == "full" and got["p"].drafter_chain_target == 4.0  # what ran on the H200
    tk.main([str(tmp_path / "b"), "--device", "cuda", "--drafter-chain-target", "0"])
    assert got["p"].drafter_chain_target is None
    tk.main([str(tmp_path / "c"), "--device", "cpu", "--drafter-chain-target", "2.5"])
    assert got["name"] == "toy" and got["p"].drafter_chain_target == 2.5
    tk.main([str(tmp_path / "d"), "--device", "cpu"])
    assert got["p"].drafter_chain_target is None  # the toy preset trains to the end
