"""Pure rendering: argv per mode, env files, refusals; units pass systemd-analyze verify; argv passes
SGLang 0.5.23's real CLI parser."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.inventory import load_inventory
from deploy.release import render

ROOT = Path(__file__).resolve().parents[2]
CAPS = json.loads((ROOT / "overlays/sglang-ddtree/src/sglang_ddtree/capabilities.json").read_text()) \
    if (ROOT / "overlays/sglang-ddtree/src/sglang_ddtree/capabilities.json").exists() else {}


@pytest.fixture(scope="module")
def seed():
    return load_inventory(str(ROOT / "inventory" / "hosts.yaml"))


def svc(seed, host="ct200", gpu=1, **kw):
    return dataclasses.replace(seed.hosts[host].services[gpu], **kw)


def test_argv_per_mode(seed):
    lin = render.server_args(svc(seed, mode="linear"))
    assert lin[lin.index("--speculative-algorithm") + 1] == "DFLASH"
    assert "--speculative-num-draft-tokens" not in lin
    for mode in ("shadow-linear", "tree-verify"):
        a = render.server_args(svc(seed, mode=mode, budget=32))
        assert a[a.index("--speculative-algorithm") + 1] == "DDTREE"
        assert a[a.index("--port") + 1] == "30001"
        assert a[a.index("--speculative-dflash-block-size") + 1] == "16"
    tv = render.server_args(svc(seed, mode="tree-verify", budget=32))
    assert tv[tv.index("--speculative-num-draft-tokens") + 1] == "33"  # D = B + 1
    assert tv[tv.index("--cuda-graph-backend-decode") + 1] == "disabled"
    assert "--speculative-num-draft-tokens" not in render.server_args(svc(seed, mode="shadow-linear"))


def test_env_file_carries_mode_plugin_and_gpu(seed):
    env = dict(render.service_env(svc(seed, mode="tree-verify", budget=48), CAPS))
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["SGLANG_PORT"] == "30001"
    assert env["SGLANG_PLUGINS"] == "ddtree" and env["SGLANG_DDTREE_MODE"] == "tree-verify"
    if CAPS.get("budget_env"):
        assert env[CAPS["budget_env"]] == "48"
    assert env["SGLANG_ENABLE_TORCH_COMPILE"] == "0"  # the group's env from the inventory
    lin = dict(render.service_env(svc(seed, mode="linear")))
    assert "SGLANG_PLUGINS" not in lin and "SGLANG_DDTREE_MODE" not in lin
    text = render.render_env(svc(seed), CAPS)
    assert "SGLANG_ARGS=--model-path /models/Qwen3.5-27B " in text


@pytest.mark.parametrize("kw, match", [
    ({"env": (("HF_TOKEN", "hf_x"),)}, "looks like a secret"),
    ({"env": (("CUDA_VISIBLE_DEVICES", "3"),)}, "set by the deploy tool"),
    ({"env": (("BAD-NAME", "1"),)}, "not a valid variable name"),
    ({"env": (("X", "a\nb"),)}, "newline"),
    ({"extra_args": ("--chat-template", "a b")}, "whitespace"),
    ({"model": "/models/x y"}, "whitespace"),
    ({"draft_model": None}, "needs a draft model"),
])
def test_refusals(seed, kw, match):
    with pytest.raises(render.RenderError, match=match):
        render.render_env(svc(seed, **kw))


def test_unit_has_hardening_and_no_secrets(seed):
    unit = render.render_unit(seed.hosts["ct129"])
    for d in ("User=sglang", "NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
              "Restart=on-failure", "StartLimitBurst=3", "TimeoutStartSec=1800",
              "EnvironmentFile=/opt/ddtree/releases/current/env/%i.env", "EnvironmentFile=-/etc/ddtree/secrets.env",
              "ExecStart=/opt/sglang/.venv/bin/python -m sglang.launch_server $SGLANG_ARGS"):
        assert d in unit, d
    assert "PrivateDevices=yes" not in unit  # GPUs are devices
    assert "TOKEN=" not in unit and "SGLANG_ARGS=" not in unit


def _verify(unit_text: str, tmp: Path) -> subprocess.CompletedProcess:
    d = tmp / "units"
    d.mkdir(exist_ok=True)
    for inst in ("gpu0", "gpu7"):
        (d / f"sglang-ddtree@{inst}.service").write_text(unit_text)
    return subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, sorted(d.iterdir()))],
                          capture_output=True, text=True)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("server", ["sglang", "labserver"])
def test_units_pass_systemd_analyze_verify(seed, tmp_path, server):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")  # ExecStart must name an executable for verify
    host = seed.hosts["ct129"]
    host = dataclasses.replace(host, vars=dict(host.vars, venv=str(venv), server=server, start_timeout=600))
    r = _verify(render.render_unit(host), tmp_path)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_verify_catches_a_broken_unit(seed, tmp_path):
    bad = render.render_unit(seed.hosts["ct129"]).replace("Restart=on-failure", "Restart=sometimes")
    r = _verify(bad, tmp_path)
    assert "Failed to parse" in r.stderr


# ---------------------------------------------------------------- SGLang 0.5.23's real parser

@pytest.fixture(scope="module")
def sglang_parser():
    sa = pytest.importorskip("sglang.srt.server_args", reason="sglang 0.5.23 not installed (requirements)")
    import sglang
    assert sglang.__version__ == "0.5.23"
    p = argparse.ArgumentParser(prog="sglang serve", exit_on_error=False)
    sa.ServerArgs.add_cli_args(p)
    return p


@pytest.mark.parametrize("host, mode", [("ct129", "linear"), ("ct129", "shadow-linear"), ("ct200", "tree-verify")])
def test_execstart_argv_parses_with_sglang(seed, sglang_parser, host, mode):
    h = seed.hosts[host]
    s = dataclasses.replace(h.services[1], mode=mode, extra_args=("--mem-fraction-static", "0.85",
                                                                  "--context-length", "32768"))
    argv = render.service_argv(h, s)
    assert argv[:3] == [f"{h.venv}/bin/python", "-m", "sglang.launch_server"]
    ns = sglang_parser.parse_args(argv[3:])
    assert ns.model_path == s.model and ns.port == s.port
    assert ns.speculative_draft_model_path == s.draft_model
    assert ns.speculative_algorithm == render.ALGORITHM[mode]
    assert ns.speculative_dflash_block_size == s.block_size
    assert ns.speculative_num_draft_tokens == (s.budget + 1 if mode == "tree-verify" else None)
    assert ns.mem_fraction_static == 0.85


@pytest.mark.parametrize("mode, budget", [("tree-verify", 64), ("tree-verify", 7), ("shadow-linear", 64)])
def test_execstart_and_env_pass_the_plugins_own_resolver(seed, sglang_parser, mode, budget):
    """What systemd runs (argv + EnvironmentFile) goes through SGLang's parser, then the DDTree plugin's
    resolver: the same validation the plugin runs inside SGLang (mode, D = B + 1, graphs, topk)."""
    plugin = pytest.importorskip("sglang_ddtree.plugin", reason="the DDTree plugin is not installed")
    h = seed.hosts["ct129"]
    s = dataclasses.replace(h.services[2], mode=mode, budget=budget)
    ns = sglang_parser.parse_args(render.service_argv(h, s)[3:])
    env = dict(render.service_env(s, CAPS))
    cfg = plugin.resolve_ddtree_config(ns, env)
    assert cfg.mode == mode and cfg.budget == budget
    if mode == "tree-verify":
        assert ns.speculative_num_draft_tokens == budget + 1
    # and a mistake the plugin refuses: budget env disagreeing with D
    bad = dict(env, SGLANG_DDTREE_BUDGET=str(budget + 5))
    if mode == "tree-verify":
        with pytest.raises(plugin.DDTreeConfigError):
            plugin.resolve_ddtree_config(ns, bad)


def test_sglang_parser_catches_a_flag_typo(seed, sglang_parser):
    h = seed.hosts["ct129"]
    s = dataclasses.replace(h.services[0], extra_args=("--speculative-num-draft-tokenz", "5"))
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        sglang_parser.parse_args(render.service_argv(h, s)[3:])
    s = dataclasses.replace(h.services[0], extra_args=("--context-length", "lots"))
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        sglang_parser.parse_args(render.service_argv(h, s)[3:])


def test_labserver_accepts_the_same_command_line(seed):
    """The stand-in parses the very argv SGLang gets (its stdlib subset, as on the lab hosts)."""
    h = seed.hosts["ct200"]
    argv = render.server_args(h.services[1])
    code = ("import sys; sys.path.insert(0, 'deploy/labserver'); import server; "
            "a, unknown = server.parse_args(sys.argv[1:]); print(a['port'], a['speculative_algorithm'], unknown)")
    r = subprocess.run(["/usr/bin/python3", "-I", "-c", code.replace("import sys;", "import sys; sys.modules['sglang'] = None;"), *argv],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:2] == ["30001", "DDTREE"]
