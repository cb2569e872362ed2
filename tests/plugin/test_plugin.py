"""Plugin discovery, DDTREE registration and server-args validation against the REAL
SGLang installed in this interpreter: 0.5.23 in the main venv, 0.5.17 in
.venv-sglang-0.5.17 (tests/test_plugin_sglang_versions.py runs this suite there)."""

import argparse
import json
import os
import subprocess
import sys
import types
import zipfile
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest
import sglang  # hard import: the suite must fail loudly without SGLang
from sglang.srt.server_args import ServerArgs

import sglang_ddtree.plugin as plugin
from sglang_ddtree_tools import tiny
from sglang_ddtree.adapters import ADAPTER_MODULES, common, load_adapter
from sglang_ddtree.capabilities import load_capabilities

pytestmark = pytest.mark.sglang_api

SGLANG = version("sglang")
BASE = [
    "--model-path", "/models/target",
    "--speculative-algorithm", "DDTREE",
    "--speculative-draft-model-path", "/models/dflash-drafter",
    "--device", "cuda",
]
GRAPH_OFF = ["--cuda-graph-backend-decode", "disabled"]


@pytest.fixture(scope="module")
def loaded():
    os.environ["SGLANG_PLUGINS"] = "ddtree"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm


def _parse(argv):
    """The parsed command line as the validator sees it, without the model-loading part of
    ServerArgs.__post_init__ (which needs a real model directory; _full_pipeline does that)."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    if SGLANG == "0.5.23":
        from sglang.srt.arg_groups.arg_utils import record_fields

        sa = ServerArgs.from_cli_args(ns)
        # what run_resolution_pipeline records before any handler runs
        sa._raw_input = {f.name: getattr(sa, f.name) for f in record_fields(type(sa))}
        sa._resolved_overrides = []
        return sa
    return types.SimpleNamespace(**vars(ns))


def _validate(algo, sa):
    """Run the plugin's validator exactly as this SGLang's handle_speculative_decoding does."""
    if SGLANG == "0.5.23":
        from sglang.srt.arg_groups.overrides import record_foreign_defaults

        record_foreign_defaults(sa, "handle_speculative_decoding.custom_validate", algo.validate_server_args)
    else:
        algo.validate_server_args(sa)


def _result(sa, k):
    if SGLANG == "0.5.23":
        from sglang.srt.arg_groups.overrides import resolution_result

        return resolution_result(sa, k)
    return getattr(sa, k)


def _resolve(SpeculativeAlgorithm, argv, monkeypatch, env=None):
    monkeypatch.delenv(plugin.MODE_ENV, raising=False)
    monkeypatch.delenv(plugin.BUDGET_ENV, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    sa = _parse(argv)
    algo = SpeculativeAlgorithm.from_string(_result(sa, "speculative_algorithm"))
    _validate(algo, sa)
    return sa


def test_sglang_version_supported():
    caps = load_capabilities()
    assert caps["sglang_versions"] == ["0.5.17", "0.5.23"] == sorted(ADAPTER_MODULES)
    assert SGLANG in caps["sglang_versions"]
    assert set(caps["per_version"]) == set(caps["sglang_versions"])
    assert load_adapter().VERSION == SGLANG


def test_entry_point_discovered():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ddtree"]
    assert len(eps) == 1 and eps[0].value == "sglang_ddtree.plugin:register"
    assert eps[0].dist.name == "sglang-ddtree"


def test_ddtree_resolves_and_answers_what_the_scheduler_asks(loaded):
    algo = loaded.from_string("ddtree")
    assert algo.name == "DDTREE"
    assert algo.is_speculative() and algo.is_dflash_family() and algo.is_dflash()
    # registered overlap-capable where the adapter ran tree-verify under SGLang's overlap scheduler (0.5.17);
    # the validator still turns it off per server where it cannot run (test_overlap_decision_*)
    caps = load_capabilities()["per_version"][SGLANG]
    assert algo.supports_overlap is load_adapter().OVERLAP_SCHEDULE is caps["overlap_schedule"] is (SGLANG == "0.5.17")
    # the scheduler calls these at start-up; CustomSpecAlgo has none of them (defect 1)
    dflash = loaded.DFLASH
    for name in ("carries_draft_hidden_states", "need_topk"):
        assert getattr(algo, name)() == getattr(dflash, name)(), name
    assert callable(algo.create_future_map)
    # nothing the builtin enum dispatches on is missing from the plugin's class
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    assert common.missing_enum_methods(type(algo), loaded) == []
    assert set(common.missing_enum_methods(CustomSpecAlgo, loaded)) >= {
        "carries_draft_hidden_states", "create_future_map", "need_topk"}


def test_allowlist_excludes_plugin():
    code = (
        "import os; os.environ['SGLANG_PLUGINS']='someone-else';"
        "from sglang.srt.plugins import load_plugins; load_plugins();"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S\n"
        "try:\n S.from_string('DDTREE'); print('registered')\n"
        "except ValueError: print('absent')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "absent", out.stderr[-2000:]


def test_good_command_line(loaded, monkeypatch):
    sa = _resolve(loaded, BASE + GRAPH_OFF + ["--speculative-num-draft-tokens", "65"], monkeypatch)
    got = {k: _result(sa, k) for k in (
        "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
        "speculative_num_draft_tokens", "disable_overlap_schedule", "page_size", "max_running_requests")}
    assert got == {
        "speculative_algorithm": "DDTREE", "speculative_num_steps": 1, "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 65, "disable_overlap_schedule": True, "page_size": 1,
        "max_running_requests": 48,
    }


def test_budget_from_env_and_explicit_topk(loaded, monkeypatch):
    sa = _resolve(loaded, BASE + GRAPH_OFF + ["--speculative-eagle-topk", "4", "--max-running-requests", "8"],
                  monkeypatch, {plugin.BUDGET_ENV: "16"})
    assert _result(sa, "speculative_num_draft_tokens") == 17
    assert _result(sa, "speculative_eagle_topk") == 4
    assert _result(sa, "max_running_requests") == 8


def test_shadow_linear(loaded, monkeypatch):
    sa = _resolve(loaded, BASE + ["--speculative-num-draft-tokens", "16", "--attention-backend", "fa3"],
                  monkeypatch, {plugin.MODE_ENV: "shadow-linear", plugin.BUDGET_ENV: "64"})
    assert _result(sa, "speculative_num_draft_tokens") == 16
    assert _result(sa, "speculative_eagle_topk") == 1
    cfg = plugin.resolve_ddtree_config(_parse(BASE + ["--speculative-num-draft-tokens", "16"]),
                                       {plugin.MODE_ENV: "shadow-linear", plugin.BUDGET_ENV: "64"})
    assert (cfg.mode, cfg.budget, cfg.num_draft_tokens) == ("shadow-linear", 64, 16)


def test_budget_schedule_from_env(loaded, monkeypatch):
    """A schedule in the budget variable: the server's D is its largest width, each batch size its own budget."""
    env = {plugin.BUDGET_ENV: "1:127,4:31,16:15,64:chain"}
    sa = _resolve(loaded, BASE + GRAPH_OFF + ["--speculative-dflash-block-size", "16"], monkeypatch, env)
    assert _result(sa, "speculative_num_draft_tokens") == 128
    cfg = plugin.resolve_ddtree_config(_parse(BASE + GRAPH_OFF + ["--speculative-dflash-block-size", "16",
                                                                   "--speculative-num-draft-tokens", "128"]), env)
    assert (cfg.budget, cfg.num_draft_tokens, str(cfg.schedule)) == (127, 128, env[plugin.BUDGET_ENV])
    assert [cfg.budget_for(n) for n in (1, 3, 4, 15, 16, 63, 64, 500)] == [127, 127, 31, 31, 15, 15, "chain", "chain"]
    # a plain budget answers the same at every batch size; a one-entry schedule is that budget
    one = plugin.resolve_ddtree_config(_parse(BASE + GRAPH_OFF), {plugin.BUDGET_ENV: "1:31"})
    assert (one.schedule, one.budget, one.num_draft_tokens, one.budget_for(64)) == (None, 31, 32, 31)


BAD_SCHEDULES = [
    (["--speculative-dflash-block-size", "16", "--speculative-num-draft-tokens", "32"], "1:127,4:31", "disagree"),
    ([], "1:31,8:chain", "dflash-block-size"),
    (["--speculative-dflash-block-size", "16"], "1:15,4:31", "must not increase"),
    (["--speculative-dflash-block-size", "16"], "2:15", "starts at batch size 1"),
    (["--speculative-dflash-block-size", "16"], "1:15,4:x", "not a budget schedule"),
]


@pytest.mark.parametrize("extra,sched,message", BAD_SCHEDULES, ids=[b[2] for b in BAD_SCHEDULES])
def test_bad_budget_schedules_refused(loaded, monkeypatch, extra, sched, message):
    with pytest.raises(plugin.DDTreeConfigError, match=message):
        _resolve(loaded, BASE + GRAPH_OFF + extra, monkeypatch, {plugin.BUDGET_ENV: sched})


def test_budget_schedule_refused_in_shadow_linear(loaded, monkeypatch):
    with pytest.raises(plugin.DDTreeConfigError, match="only tree-verify serves"):
        _resolve(loaded, BASE + ["--speculative-num-draft-tokens", "16"], monkeypatch,
                 {plugin.MODE_ENV: "shadow-linear", plugin.BUDGET_ENV: "1:31,4:15"})


BAD = [
    (["--speculative-use-rejection-sampling"], {}, "rejection sampling"),
    (["--enable-linear-replayssm-spec"], {}, "ReplaySSM"),
    (["--enable-unified-memory"], {}, "unified-memory"),
    (["--page-size", "16"], {}, "page-size 1"),
    (["--speculative-eagle-topk", "1"], {}, "topk >= 2"),
    (["--speculative-accept-threshold-single", "0.5"], {}, "thresholds"),
    ([], {plugin.BUDGET_ENV: "10"}, "disagree"),
    ([], {plugin.MODE_ENV: "beam"}, "not a DDTREE mode"),
    (["--device", "cpu"], {}, "only on CUDA"),
    (["--speculative-adaptive"], {}, "adaptive"),
    (["--speculative-num-draft-tokens", "5", "--speculative-dflash-block-size", "16"], {}, "wider than 2"),
    (["--attention-backend", "fa3"], {}, "attention-backend triton"),
    (["--attention-backend", "triton", "--speculative-draft-attention-backend", "flashinfer"], {},
     "attention-backend triton"),
    (["--decode-attention-backend", "flashinfer"], {}, "attention-backend triton"),
]


@pytest.mark.parametrize("extra,env,message", BAD, ids=[b[2] + str(i) for i, b in enumerate(BAD)])
def test_bad_command_lines_refused(loaded, monkeypatch, extra, env, message):
    with pytest.raises(plugin.DDTreeConfigError, match=message):
        _resolve(loaded, BASE + GRAPH_OFF + ["--speculative-num-draft-tokens", "65"] + extra, monkeypatch, env)


def test_decode_cuda_graphs_in_tree_mode_follow_the_adapter(loaded, monkeypatch):
    """0.5.17's adapter captures the target's verify graph with the tree-mask buffer, so graphs stay on;
    0.5.23's cannot (not run on a GPU), so they are refused with the flag to pass."""
    caps = load_capabilities()["per_version"][SGLANG]
    assert load_adapter().TREE_VERIFY_CUDA_GRAPHS is caps["tree_verify_cuda_graphs"] is (SGLANG == "0.5.17")
    argv = BASE + ["--speculative-num-draft-tokens", "16"]
    if caps["tree_verify_cuda_graphs"]:
        sa = _resolve(loaded, argv, monkeypatch)
        assert _result(sa, "speculative_num_draft_tokens") == 16 and _result(sa, "speculative_eagle_topk") >= 2
    else:
        with pytest.raises(plugin.DDTreeConfigError, match="cuda-graph-backend-decode disabled"):
            _resolve(loaded, argv, monkeypatch)


def test_refuses_missing_budget_and_drafter(loaded, monkeypatch):
    with pytest.raises(plugin.DDTreeConfigError, match="node budget"):
        _resolve(loaded, BASE + GRAPH_OFF, monkeypatch)
    argv = [a for a in BASE if a not in ("--speculative-draft-model-path", "/models/dflash-drafter")]
    with pytest.raises(plugin.DDTreeConfigError, match="draft-model-path"):
        _resolve(loaded, argv + GRAPH_OFF + ["--speculative-num-draft-tokens", "9"], monkeypatch)


def test_refuses_other_sglang_versions():
    with pytest.raises(plugin.UnsupportedSGLangVersion, match=r"supports SGLang 0\.5\.17, 0\.5\.23 only.*found SGLang 0\.5\.22"):
        plugin.check_sglang_version("0.5.22")
    assert plugin.check_sglang_version() == SGLANG


def _tiny_dir(tmp_path, family):
    t, d = tmp_path / f"{family}-target", tmp_path / f"{family}-drafter"
    for p, cfg in ((t, tiny.target_config(family)), (d, tiny.drafter_config(family))):
        p.mkdir()
        (p / "config.json").write_text(json.dumps(cfg))
    return t, d


_PIPELINE_CODE = (
        "import sys, json, argparse\n"
        "from sglang.srt.plugins import load_plugins; load_plugins()\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "sa = prepare_server_args(sys.argv[1:])\n"
        "getattr(sa, 'resolve_once', lambda: None)()  # 0.5.23 resolves on demand; 0.5.17 in __post_init__\n"
        "keys = ('speculative_algorithm','speculative_eagle_topk','speculative_num_draft_tokens',"
        "'speculative_num_steps','disable_overlap_schedule','page_size','attention_backend',"
        "'speculative_draft_attention_backend')\n"
        "try:\n from sglang.srt.arg_groups.overrides import resolution_result as get\n"
        "except ImportError:\n get = getattr\n"
        "print('RESULT ' + json.dumps({k: get(sa, k) for k in keys}))\n"
)


def _tiny_argv(tmp_path, family, d=16):
    t, dr = _tiny_dir(tmp_path, family)
    argv = ["--model-path", str(t), "--speculative-algorithm", "DDTREE", "--speculative-draft-model-path", str(dr),
            "--device", "cuda", "--attention-backend", "triton", "--speculative-num-draft-tokens", str(d),
            "--cuda-graph-backend-decode", "disabled", "--skip-tokenizer-init", "--page-size", "1"]
    if family == "hybrid":
        argv.append("--disable-radix-cache")  # the mamba radix cache's extra buffer needs a GPU to resolve
    return argv


def _pipeline(argv, **extra_env):
    """ServerArgs resolved in a fresh process with the plugin loaded as SGLang loads it: (result, stderr)."""
    env = dict(os.environ, SGLANG_PLUGINS="ddtree", SGLANG_DDTREE_MODE="tree-verify", **extra_env)
    env.pop("SGLANG_DDTREE_BUDGET", None)
    if "SGLANG_DDTREE_OVERLAP" not in extra_env:
        env.pop("SGLANG_DDTREE_OVERLAP", None)
    out = subprocess.run([sys.executable, "-c", _PIPELINE_CODE, *argv], capture_output=True, text=True,
                         timeout=300, env=env)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return (json.loads(line[-1][7:]) if line else None), out


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_full_server_args_pipeline_on_tiny_configs(family, tmp_path):
    """SGLang's whole ServerArgs resolution (model config loading, attention-backend and
    speculative hooks, the plugin's validator and handle_server_args) on the tiny kit's
    real config.json files, in a fresh process with the plugin loaded as SGLang loads it."""
    argv = _tiny_argv(tmp_path, family)
    got, out = _pipeline(argv)
    assert got, out.stdout[-2000:] + out.stderr[-4000:]
    # the synchronous scheduler unless SGLANG_DDTREE_OVERLAP=1 (test_overlap_through_the_real_pipeline)
    assert got == {"speculative_algorithm": "DDTREE", "speculative_eagle_topk": 2,
                   "speculative_num_draft_tokens": 16, "speculative_num_steps": 1, "disable_overlap_schedule": True,
                   "page_size": 1, "attention_backend": "triton", "speculative_draft_attention_backend": "triton"}
    # and the same command line with SGLang's Hopper default backend is refused with the flag to pass
    bad = [a for a in argv]
    bad[bad.index("triton")] = "fa3"
    _, out = _pipeline(bad)
    assert out.returncode != 0 and "needs --attention-backend triton" in out.stderr, out.stderr[-3000:]


@pytest.mark.skipif(SGLANG != "0.5.17", reason="overlap scheduling is the 0.5.17 adapter's (capabilities.json)")
@pytest.mark.parametrize("case", ["asked", "block wider than D", "not asked", "asked but flag given"])
def test_overlap_through_the_real_pipeline(case, tmp_path):
    """SGLANG_DDTREE_OVERLAP=1 puts tree-verify on SGLang's overlap scheduler - where the drafter's real config.json
    (block 8) fits D: at D = 4 the validator reads the block and keeps the synchronous scheduler, saying why. Not
    asked, or with the user's own --disable-overlap-schedule, it stays synchronous."""
    argv = _tiny_argv(tmp_path, "dense", d=4 if case == "block wider than D" else 16)
    env = {} if case == "not asked" else {"SGLANG_DDTREE_OVERLAP": "1"}
    if case == "asked but flag given":
        argv.append("--disable-overlap-schedule")
    got, out = _pipeline(argv, **env)
    assert got and got["disable_overlap_schedule"] is (case != "asked"), out.stderr[-3000:]
    why = {"asked": "overlap scheduling on (drafter block 8 <= D = 16)",
           "block wider than D": "overlap scheduling off (the drafter block 8 is wider than D = 4",
           "not asked": "overlap scheduling off (opt-in with SGLANG_DDTREE_OVERLAP=1",
           "asked but flag given": "overlap scheduling off (--disable-overlap-schedule given"}[case]
    assert why in out.stderr, out.stderr[-3000:]


def _cfg(mode="tree-verify", d=16):
    return plugin.DDTreeConfig(mode, d - 1, d, 2 if mode == "tree-verify" else 1, None)


ON = {"SGLANG_DDTREE_OVERLAP": "1"}


@pytest.mark.parametrize("mode,d,blk,adapter,env,user,on", [
    ("tree-verify", 16, 16, True, ON, False, True),      # the H200's B=15 with a block-16 drafter
    ("tree-verify", 32, 16, True, ON, False, True),      # B=31
    ("tree-verify", 32, 16, True, {}, False, False),     # not asked: the synchronous scheduler (measured faster)
    ("tree-verify", 32, 16, True, {"SGLANG_DDTREE_OVERLAP": "0"}, False, False),
    ("tree-verify", 8, 16, True, ON, False, False),      # a step can start 8 past the lagging length, window 16
    ("tree-verify", 16, None, True, ON, False, False),   # unknown block: conservative
    ("tree-verify", 16, 8, False, ON, False, False),     # an adapter that has not run it
    ("tree-verify", 16, 8, True, ON, True, False),       # --disable-overlap-schedule
    ("shadow-linear", 16, 16, True, ON, False, False),   # the tree walk reads each chain step's result
])
def test_overlap_decision(mode, d, blk, adapter, env, user, on):
    got, why = plugin.overlap_decision(_cfg(mode, d), blk, adapter, env, user_disabled=user)
    assert got is on and why
    assert plugin.server_arg_writes(types.SimpleNamespace(max_running_requests=8), _cfg(mode, d),
                                    overlap=got)["disable_overlap_schedule"] is (not on)


def test_capabilities_readable_without_sglang(tmp_path):
    code = (
        "import sys, json; sys.modules['sglang'] = None; sys.modules['torch'] = None\n"
        "from sglang_ddtree.capabilities import load_capabilities; c = load_capabilities()\n"
        "print(json.dumps(c))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    caps = json.loads(out.stdout)
    assert caps["modes"] == ["tree-verify", "shadow-linear"]
    assert caps["tree_aware_recurrent_state"] is True


def test_wheel_builds_ships_capabilities_adapters_and_no_checks(tmp_path):
    import shutil

    # a clean copy, as fab deploy's builder does (a build/ left in the source tree must not leak in)
    src = tmp_path / "src"
    shutil.copytree(Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree", src,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (whl,) = tmp_path.glob("sglang_ddtree-*.whl")
    with zipfile.ZipFile(whl) as z:
        caps = json.loads(z.read("sglang_ddtree/capabilities.json"))
        names = z.namelist()
        ep = next(n for n in names if n.endswith("entry_points.txt"))
        assert "[sglang.srt.plugins]" in z.read(ep).decode()
    assert caps["sglang_versions"] == ["0.5.17", "0.5.23"]
    for m in ("adapters/v0_5_17.py", "adapters/v0_5_17_worker.py", "adapters/v0_5_23.py",
              "adapters/v0_5_23_worker.py", "adapters/worker.py", "config.py", "admission.py"):
        assert f"sglang_ddtree/{m}" in names, m
    assert not [n for n in names if "checks" in n], "the GPU checks must stay out of the serving wheel"
