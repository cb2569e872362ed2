"""The kit replayed as a server decodes it (sglang_ddtree_tools.replay): lossless text, and trainkit's decode walk
is exactly what step-by-step decoding reports, for DFLASH's chain and DDTREE's tree on both families."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sglang_ddtree_tools import replay, trainkit as tk  # noqa: E402

TOY = tk.PRESETS["toy"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "kit"
    return out, tk.run(str(out), 3, tk.FAMILIES, "cpu", TOY, "toy", log_every=100)


@pytest.mark.parametrize("family", tk.FAMILIES)
def test_the_walk_is_what_decoding_reports_and_the_text_is_the_targets(kit, family):
    out, _ = kit
    res = replay.replay_family(out, family, budgets=(15,), new=24)
    assert res["prompts"] == TOY.eval_prompts and set(res["modes"]) == {"chain", "tree_B15"}
    for mode, m in res["modes"].items():
        assert m["texts_equal_greedy"] == TOY.eval_prompts, mode  # speculation changed no output
        assert m["replayed_steps"] > 0
        assert (m["replayed_tokens"], m["replayed_steps"]) == (m["walk_tokens"], m["walk_steps"]), mode
        assert 1.0 <= m["replayed"] <= TOY.block and 1.0 <= m["every_anchor"] <= TOY.block


def test_every_step_commits_its_accepted_drafts_and_the_targets_token(kit):
    out, _ = kit
    target, drafter, cfg = replay.load_pair(out, "dense", "cpu")
    prompt = json.loads((out / "prompts.jsonl").read_text().splitlines()[0])["input_ids"]
    mask = cfg["dflash_config"]["mask_token_id"]
    for budget in (None, 7):
        got = replay.decode(target, drafter, prompt, 20, TOY.block, mask, budget)
        assert len(got["tokens"]) == 20
        # the first token is the prefill's; each step's bonus sits where the previous one stopped
        anchors = [s["anchor"] for s in got["steps"]]
        assert anchors[0] == 0
        assert all(b == a + s["accept"] for a, b, s in zip(anchors, anchors[1:], got["steps"]))
        assert 1 + sum(s["accept"] for s in got["steps"]) == 20
        assert all(1 <= s["accept"] <= TOY.block for s in got["steps"])
        assert all(s["drafts"] == (TOY.block - 1 if budget is None else budget) for s in got["steps"])


def test_trainkit_reports_the_decode_walk_beside_the_every_anchor_mean(kit):
    _, manifest = kit
    for fam in tk.FAMILIES:
        off = manifest["families"][fam]["offline"]
        assert set(off["decode"]) == {"chain_block8"} | {f"tree_B{b}" for b in tk.BUDGETS}
        assert all(1.0 <= v <= TOY.block for v in off["decode"].values())


def test_cli_prints_every_mode_and_writes_json(kit, tmp_path, capsys):
    out, _ = kit
    report = tmp_path / "r.json"
    assert replay.main([str(out), "--family", "hybrid", "--budgets", "15", "--new", "12", "--prompts", "2",
                        "--json", str(report)]) == 0
    text = capsys.readouterr().out
    assert "hybrid: 2 prompts x 12 tokens" in text and "tree_B15" in text and "chain" in text
    (fam,) = json.loads(report.read_text())["families"]
    assert fam["family"] == "hybrid" and fam["prompts"] == 2


@pytest.mark.parametrize("argv, msg", [(["--budgets", "0"], "--budgets"), (["--budgets", "x"], "integers"),
                                       (["--new", "0"], "--new")])
def test_cli_refuses_bad_flags(kit, capsys, argv, msg):
    out, _ = kit
    with pytest.raises(SystemExit):
        replay.main([str(out), *argv])
    assert msg in capsys.readouterr().err


def test_cli_refuses_a_folder_that_is_no_kit(tmp_path, capsys):
    with pytest.raises(SystemExit):
        replay.main([str(tmp_path)])
    assert "prompts.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("line, msg", [("not json", ":2: not JSON"), ('{"input_ids": [1, 99999]}', ":2: token 99999"),
                                       ('{"input_ids": []}', ":2: a prompt is"), ('{"ids": [1]}', ":2: a prompt is")])
def test_a_bad_prompt_line_is_named_by_its_number(kit, tmp_path, line, msg):
    import shutil

    out, _ = kit
    bad = tmp_path / "kit"
    shutil.copytree(out, bad)
    first = (out / "prompts.jsonl").read_text().splitlines()[0]
    (bad / "prompts.jsonl").write_text(first + "\n" + line + "\n")
    with pytest.raises(SystemExit, match=msg):
        replay.replay_family(bad, "dense", budgets=(), new=8)


def test_decoding_runs_in_the_kits_precision(kit, monkeypatch):
    """On CUDA trainkit trains and measures a kit under bfloat16 autocast (trainkit._autocast), makes the target's
    greedy reference under it (greedy_generate), and the server serves the kit in bfloat16: replay decodes inside
    that same context, so its text check compares like with like (a float32 replay against the bfloat16 reference
    holds two different texts against each other)."""
    import contextlib

    out, _ = kit
    depth = {"n": 0}
    seen = []

    @contextlib.contextmanager
    def precision(device):
        depth["n"] += 1
        try:
            yield
        finally:
            depth["n"] -= 1

    real_decode = replay.decode

    def decode(*a, **k):
        seen.append(depth["n"])
        return real_decode(*a, **k)

    monkeypatch.setattr(tk, "_autocast", precision)
    monkeypatch.setattr(replay, "decode", decode)
    res = replay.replay_family(out, "dense", budgets=(), new=16, prompts=1)
    assert res["modes"]["chain"]["texts_equal_greedy"] == 1
    assert seen and all(d >= 1 for d in seen)
