"""Plugin discovery, DDTREE registration and server-args validation against the
real SGLang 0.5.23 (CPU install, see requirements/sglang-cpu.txt)."""

import argparse
import json
import subprocess
import sys
import zipfile
from importlib.metadata import entry_points, version

import pytest
import sglang  # hard import: the suite must fail loudly without SGLang
from sglang.srt.arg_groups.arg_utils import record_fields
from sglang.srt.arg_groups.overrides import record_foreign_defaults, resolution_result
from sglang.srt.server_args import ServerArgs

import sglang_ddtree.plugin as plugin
from sglang_ddtree.capabilities import load_capabilities

BASE = [
    "--model-path", "/models/target",
    "--speculative-algorithm", "DDTREE",
    "--speculative-draft-model-path", "/models/dflash-drafter",
    "--device", "cuda",
]
GRAPH_OFF = ["--cuda-graph-backend-decode", "disabled"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    import os

    os.environ["SGLANG_PLUGINS"] = "ddtree"
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SpeculativeAlgorithm


def _parse(argv):
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    sa = ServerArgs.from_cli_args(parser.parse_args(argv))
    # what run_resolution_pipeline records before any handler runs
    sa._raw_input = {f.name: getattr(sa, f.name) for f in record_fields(type(sa))}
    sa._resolved_overrides = []
    return sa


def _resolve(SpeculativeAlgorithm, argv, monkeypatch, env=None):
    monkeypatch.delenv(plugin.MODE_ENV, raising=False)
    monkeypatch.delenv(plugin.BUDGET_ENV, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    sa = _parse(argv)
    algo = SpeculativeAlgorithm.from_string(resolution_result(sa, "speculative_algorithm"))
    # exactly how sglang's handle_speculative_decoding runs a plugin validator
    record_foreign_defaults(sa, "handle_speculative_decoding.custom_validate", algo.validate_server_args)
    return sa


def test_sglang_version_pinned():
    assert version("sglang") == "0.5.23"
    assert load_capabilities()["sglang_versions"] == ["0.5.23"]


def test_entry_point_discovered():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "ddtree"]
    assert len(eps) == 1 and eps[0].value == "sglang_ddtree.plugin:register"
    assert eps[0].dist.name == "sglang-ddtree"


def test_ddtree_resolves(loaded):
    algo = loaded.from_string("ddtree")
    assert algo.name == "DDTREE"
    assert algo.is_speculative() and algo.is_dflash_family()
    assert algo.validate_server_args is plugin.validate_server_args
    assert algo.supports_overlap is False


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
    got = {k: resolution_result(sa, k) for k in (
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
    assert resolution_result(sa, "speculative_num_draft_tokens") == 17
    assert resolution_result(sa, "speculative_eagle_topk") == 4
    assert resolution_result(sa, "max_running_requests") == 8


def test_shadow_linear(loaded, monkeypatch):
    sa = _resolve(loaded, BASE + ["--speculative-num-draft-tokens", "16"], monkeypatch,
                  {plugin.MODE_ENV: "shadow-linear", plugin.BUDGET_ENV: "64"})
    assert resolution_result(sa, "speculative_num_draft_tokens") == 16
    assert resolution_result(sa, "speculative_eagle_topk") == 1
    cfg = plugin.resolve_ddtree_config(_parse(BASE + ["--speculative-num-draft-tokens", "16"]),
                                       {plugin.MODE_ENV: "shadow-linear", plugin.BUDGET_ENV: "64"})
    assert (cfg.mode, cfg.budget, cfg.num_draft_tokens) == ("shadow-linear", 64, 16)


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
]


@pytest.mark.parametrize("extra,env,message", BAD, ids=[b[2] for b in BAD])
def test_bad_command_lines_refused(loaded, monkeypatch, extra, env, message):
    with pytest.raises(plugin.DDTreeConfigError, match=message):
        _resolve(loaded, BASE + GRAPH_OFF + ["--speculative-num-draft-tokens", "65"] + extra, monkeypatch, env)


def test_refuses_decode_cuda_graph_in_tree_mode(loaded, monkeypatch):
    with pytest.raises(plugin.DDTreeConfigError, match="cuda-graph-backend-decode disabled"):
        _resolve(loaded, BASE + ["--speculative-num-draft-tokens", "65"], monkeypatch)


def test_refuses_missing_budget_and_drafter(loaded, monkeypatch):
    with pytest.raises(plugin.DDTreeConfigError, match="node budget"):
        _resolve(loaded, BASE + GRAPH_OFF, monkeypatch)
    argv = [a for a in BASE if a not in ("--speculative-draft-model-path", "/models/dflash-drafter")]
    with pytest.raises(plugin.DDTreeConfigError, match="draft-model-path"):
        _resolve(loaded, argv + GRAPH_OFF + ["--speculative-num-draft-tokens", "9"], monkeypatch)


def test_refuses_other_sglang_versions():
    with pytest.raises(plugin.UnsupportedSGLangVersion, match="0.5.23 only.*found SGLang 0.5.22"):
        plugin.check_sglang_version("0.5.22")
    assert plugin.check_sglang_version() == "0.5.23"


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


def test_wheel_builds_and_ships_capabilities(tmp_path):
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree"
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
    assert caps["sglang_versions"] == ["0.5.23"]
    assert "sglang_ddtree/worker.py" in names


def test_worker_overrides_exist_in_sglang_source():
    """The worker (unrun, does not import on CPU) overrides these DFlashWorkerV2
    methods; make sure they exist with the keyword names it uses."""
    import ast
    from pathlib import Path

    src = Path(sglang.__file__).parent / "srt" / "speculative" / "dflash_worker_v2.py"
    mod = ast.parse(src.read_text())
    cls = next(n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == "DFlashWorkerV2")
    meths = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    upd = meths["_update_target_mamba_state_after_verify"]
    assert [a.arg for a in upd.args.kwonlyargs] == ["batch", "seq_lens_pre_verify", "seq_lens_post_verify", "commit_lens"]
    fwd = meths["forward_batch_generation"]
    assert [a.arg for a in fwd.args.args] == ["self", "batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"]
    compile(Path(plugin.__file__).with_name("worker.py").read_text(), "worker.py", "exec")
