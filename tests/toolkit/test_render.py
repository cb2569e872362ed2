"""Pure rendering: argv per mode, env files, refusals; units pass systemd-analyze verify; argv passes
SGLang 0.5.23's real CLI parser."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.inventory import load_inventory
from deploy.release import render

from helpers import KEY

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
    assert "--cuda-graph-backend-decode" not in tv  # graphs on: the 0.5.17 adapter captures the tree mask
    off = render.server_args(svc(seed, mode="tree-verify", budget=32, cuda_graphs=False))
    assert off[off.index("--cuda-graph-backend-decode") + 1] == "disabled"
    lin_off = render.server_args(svc(seed, mode="linear", cuda_graphs=False))
    assert lin_off[lin_off.index("--cuda-graph-backend-decode") + 1] == "disabled"
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


HARDENING = ("NoNewPrivileges=yes", "CapabilityBoundingSet=\n", "AmbientCapabilities=\n", "ProtectSystem=strict",
             "ProtectHome=yes", "PrivateTmp=yes", "PrivateMounts=yes", "ProtectKernelTunables=yes",
             "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes", "ProtectClock=yes",
             "ProtectHostname=yes", "ProtectProc=invisible", "RestrictSUIDSGID=yes", "RestrictRealtime=yes",
             "RestrictNamespaces=yes", "LockPersonality=yes", "RemoveIPC=yes", "UMask=0077",
             "SystemCallArchitectures=native", "SystemCallFilter=@system-service\n", "SystemCallFilter=~@privileged",
             "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK\n", "DevicePolicy=closed",
             "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=/dev/nvidia-uvm rw", "DeviceAllow=/dev/nvidia-uvm-tools rw")


def test_unit_has_hardening_and_no_secrets(seed):
    unit = render.render_unit(seed.hosts["ct129"])
    for d in ("User=sglang", "Restart=on-failure", "StartLimitBurst=3", "TimeoutStartSec=1800",
              "EnvironmentFile=/opt/ddtree/releases/current/env/%i.env", "EnvironmentFile=-/etc/ddtree/secrets.env",
              "ExecStart=/opt/sglang/.venv/bin/python -m sglang.launch_server $SGLANG_ARGS\n",
              "ExecStartPre=/usr/bin/python3 -I /opt/ddtree/releases/current/bin/server_secrets.py --check "
              "/etc/ddtree/secrets.env\n",
              "--host ${SGLANG_HOST} --port ${SGLANG_PORT}",
              "IPAddressDeny=any\nIPAddressAllow=localhost\n") + HARDENING:
        assert d in unit, d
    assert "PrivateDevices=" not in unit  # GPUs are devices
    assert "MemoryDenyWriteExecute=" not in unit  # JIT (Triton, torch.compile, the CUDA driver)
    assert "ExecStartPre=+" not in unit and "ExecStartPre=!" not in unit  # nothing in the unit runs as root
    assert "TOKEN=" not in unit and "SGLANG_ARGS=" not in unit and "LoadCredential" not in unit


def keyed(host, listen="10.0.0.5", key="/etc/ddtree/api-key.yaml"):
    host = dataclasses.replace(host, vars=dict(host.vars, listen_address=listen, api_key_file=key))
    return dataclasses.replace(host, services=tuple(dataclasses.replace(s, listen=listen) for s in host.services))


def test_api_key_reaches_sglang_only_through_a_credential(seed):
    host = keyed(seed.hosts["ct129"])
    unit = render.render_unit(host)
    assert "LoadCredential=sglang-server.yaml:/etc/ddtree/api-key.yaml\n" in unit
    assert "ExecStart=/opt/sglang/.venv/bin/python -m sglang.launch_server $SGLANG_ARGS --config " \
           "%d/sglang-server.yaml\n" in unit
    assert "--api-key-file /etc/ddtree/api-key.yaml --credential %d/sglang-server.yaml" in unit
    assert "Environment=PYTHONPATH=/opt/ddtree/releases/current/site\n" in unit  # the log redactor
    assert "IPAddressDeny" not in unit  # clients come from other machines; the key guards it
    env = render.render_env(host.services[3], CAPS)
    assert "--host 10.0.0.5 --port 30003" in env and "SGLANG_HOST=10.0.0.5" in env and "api" not in env.lower()
    argv = render.service_argv(host, host.services[3])
    assert argv[-2:] == ["--config", "/run/credentials/sglang-ddtree@gpu3.service/sglang-server.yaml"]


def test_gpu_dropin_allows_only_its_own_gpu(seed):
    s = seed.hosts["ct200"].services[3]
    text = render.render_dropin(s)
    assert [ln for ln in text.splitlines() if not ln.startswith("#")] == ["[Service]", "DeviceAllow=/dev/nvidia3 rw"]
    assert render.dropin_path("gpu3") == "sglang-ddtree@gpu3.service.d/50-ddtree-gpu.conf"
    env = dict(render.service_env(s, CAPS))
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def _verify(unit_text: str, tmp: Path, dropins: dict | None = None) -> subprocess.CompletedProcess:
    d = tmp / "units"
    d.mkdir(exist_ok=True)
    for inst in ("gpu0", "gpu7"):
        (d / f"sglang-ddtree@{inst}.service").write_text(unit_text)
    for inst, text in (dropins or {}).items():
        (d / f"sglang-ddtree@{inst}.service.d").mkdir(exist_ok=True)
        (d / f"sglang-ddtree@{inst}.service.d" / render.GPU_DROPIN).write_text(text)
    return subprocess.run(["systemd-analyze", "verify", "--man=no",
                           *map(str, sorted(d.glob("*.service")))], capture_output=True, text=True)


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("server", ["sglang", "labserver"])
@pytest.mark.parametrize("key", [False, True])
def test_units_pass_systemd_analyze_verify(seed, tmp_path, server, key):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")  # ExecStart must name an executable for verify
    host = seed.hosts["ct129"]
    host = dataclasses.replace(host, vars=dict(host.vars, venv=str(venv), server=server, start_timeout=600))
    if key:
        host = keyed(host, "0.0.0.0")
    r = _verify(render.render_unit(host), tmp_path, {s.instance: render.render_dropin(s) for s in host.services})
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr


def exposure(unit_text: str, dropin: str, tmp: Path) -> tuple[float, str]:
    """`systemd-analyze security --offline=yes` of an instance (with its drop-in): the overall exposure."""
    d = tmp / "sec"
    (d / "sglang-ddtree@gpu0.service.d").mkdir(parents=True, exist_ok=True)
    (d / "sglang-ddtree@gpu0.service").write_text(unit_text)
    (d / "sglang-ddtree@gpu0.service.d" / render.GPU_DROPIN).write_text(dropin)
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        str(d / "sglang-ddtree@gpu0.service")], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+) ", r.stdout)
    assert m, r.stdout + r.stderr
    return float(m.group(1)), r.stdout


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
@pytest.mark.parametrize("listen", ["127.0.0.1", "0.0.0.0"])
def test_exposure_score_offline_is_at_most_3(seed, tmp_path, listen):
    """The score the lab test measures on a deployed unit (tests/lab/test_lab_unit.py), here offline on the
    rendered files; the unit of the previous releases scored 6.4 MEDIUM offline (6.2 deployed)."""
    host = seed.hosts["ct129"] if listen == "127.0.0.1" else keyed(seed.hosts["ct129"], listen)
    score, out = exposure(render.render_unit(host), render.render_dropin(host.services[0]), tmp_path)
    assert score <= 3.0, out
    for line in ("DevicePolicy", "ProtectKernelLogs=", "ProtectProc=", "CapabilityBoundingSet=~CAP_SYS_ADMIN",
                 "SystemCallFilter=~@privileged", "UMask=", "RestrictAddressFamilies=~AF_PACKET"):
        hits = [ln for ln in out.splitlines() if line in ln]
        assert all(not ln.lstrip().startswith("✗") for ln in hits), hits
    assert "/dev/nvidia0:rw" in out  # the drop-in's own GPU is part of the device ACL


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
    # graphs on: what the 0.5.17 adapter resolves (it captures the tree mask); an adapter that cannot refuses
    cfg = plugin.resolve_ddtree_config(ns, env, tree_verify_cuda_graphs=True)
    assert cfg.mode == mode and cfg.budget == budget
    if mode == "tree-verify":
        with pytest.raises(plugin.DDTreeConfigError, match="cuda-graph-backend-decode disabled"):
            plugin.resolve_ddtree_config(ns, env, tree_verify_cuda_graphs=False)
        off = sglang_parser.parse_args(render.service_argv(h, dataclasses.replace(s, cuda_graphs=False))[3:])
        assert plugin.resolve_ddtree_config(off, env, tree_verify_cuda_graphs=False).budget == budget
    if mode == "tree-verify":
        assert ns.speculative_num_draft_tokens == budget + 1
    # and a mistake the plugin refuses: budget env disagreeing with D
    bad = dict(env, SGLANG_DDTREE_BUDGET=str(budget + 5))
    if mode == "tree-verify":
        with pytest.raises(plugin.DDTreeConfigError):
            plugin.resolve_ddtree_config(ns, bad, tree_verify_cuda_graphs=True)


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


def test_api_key_argv_through_sglangs_real_config_merger(seed, sglang_parser, tmp_path):
    """With an API key the ExecStart argv ends in `--config <credential>`; SGLang 0.5.23's own
    ConfigArgumentMerger turns the credential (the host's key file, as server_secrets.py accepts it) into
    --api-key, and the command line keeps the last word on --host/--port (config args go first)."""
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
    from deploy.remote.host import server_secrets
    host = keyed(seed.hosts["ct200"], "10.0.0.5")
    s = dataclasses.replace(host.services[1], mode="tree-verify")
    argv = render.service_argv(host, s)
    assert "--api-key" not in " ".join(argv)
    ns = sglang_parser.parse_args(argv[3:])  # the plain parser knows --config too
    assert ns.config == render.credential_path("gpu1") and ns.api_key is None
    key = KEY
    for text in (f"api-key: {key}\n", f"# ours\napi-key: '{key}'\nadmin-api-key: \"Adm1n-{key}\"\n"):
        cred = tmp_path / render.CREDENTIAL
        cred.write_text(text)
        assert server_secrets.parse_key_file(text, "k")["api-key"] == key
        merged = ConfigArgumentMerger(sglang_parser).merge_config_with_args(
            [str(cred) if a == render.credential_path("gpu1") else a for a in argv[3:]])
        ns = sglang_parser.parse_args(merged)
        assert ns.api_key == key and ns.host == "10.0.0.5" and ns.port == s.port
    cred.write_text(f"api-key: {key}\nhost: 0.0.0.0\n")  # a key file that tries more is refused on the host,
    with pytest.raises(server_secrets.SecretsError, match="only api-key and admin-api-key"):
        server_secrets.parse_key_file(cred.read_text(), "k")
    merged = ConfigArgumentMerger(sglang_parser).merge_config_with_args(  # and even so the command line wins
        [str(cred) if a == render.credential_path("gpu1") else a for a in argv[3:]])
    assert sglang_parser.parse_args(merged).host == "10.0.0.5"


def test_jit_caches_per_payload_under_the_cache_directory(seed):
    s = seed.hosts["ct200"].services[2]
    env = dict(render.service_env(s, CAPS, "ab" * 32))
    base = "/var/cache/sglang-ddtree/gpu2/abababababababab"
    assert env["TRITON_CACHE_DIR"] == base + "/triton" and env["FLASHINFER_WORKSPACE_BASE"] == base + "/flashinfer"
    assert env["SGLANG_CACHE_DIR"] == base + "/sglang" and env["SGLANG_DG_CACHE_DIR"] == base + "/deep_gemm"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == base + "/inductor"
    # the same payload renders the same file (no restart); the inventory cannot override them
    assert render.render_env(s, CAPS, "ab" * 32) == render.render_env(s, CAPS, "ab" * 32)
    import dataclasses
    with pytest.raises(render.RenderError, match="TRITON_CACHE_DIR is set by the deploy tool"):
        render.service_env(dataclasses.replace(s, env=(("TRITON_CACHE_DIR", "/tmp/x"),)), CAPS)
