"""The GPU's service environment reaches the transient smoke and bench servers: the control side's plan carries
the inventory's `env` (less what the run sets itself), the host op checks it whole, and the tools hand it to each
server's systemd-run unit, where the contract's own variables still win."""
from __future__ import annotations

import json
import os
import textwrap

import pytest

from deploy import bench, smoke
from deploy.inventory import load_inventory
from deploy.remote.host import contract as hostcontract
from deploy.remote.host import smoke as hostsmoke
from deploy.remote.host.registry import Failure

PROBE = {"current": "20261202T010203Z-a1b2c3", "venv_trust": "ok", "manifest": {"plugin": {"version": "1"}},
         "configs": {"/models/T": {"config": {"architectures": ["X"]}}}}


def host(tmp_path, env):
    p = tmp_path / "inv.yaml"
    p.write_text(textwrap.dedent(f"""\
        fleet: t
        reference: h
        vars: {{venv: /opt/v, model: /models/T, draft_model: /models/D, mode: tree-verify, budget: 16,
                env: {json.dumps(env)}}}
        hosts:
          h: {{address: 10.0.0.1, gpus: 2, services: {{1: {{}}}}}}
        """))
    return load_inventory(str(p)).hosts["h"]


def test_the_plans_carry_the_services_env_less_what_the_run_sets(tmp_path):
    h = host(tmp_path, {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", hostcontract.OVERLAP_ENV: "1",
                        "NCCL_DEBUG": "WARN"})
    want = {"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "NCCL_DEBUG": "WARN"}
    for a in (smoke.plan_smoke(h, PROBE, gpu=1).agent_args(), bench.plan_bench(h, PROBE, gpu=1).agent_args()):
        assert a["env"] == want  # tree-verify's scheduler is bench's own --overlap, not the service's env
        assert hostsmoke.check_service_env(a["env"]) == want
    assert smoke.plan_smoke(host(tmp_path, {}), PROBE, gpu=1).agent_args()["env"] == {}


@pytest.mark.parametrize("env, why", [
    (["X=1"], "mapping"),
    ({f"V{i}": "1" for i in range(hostsmoke.ENV_MAX + 1)}, "mapping"),
    ({"1X": "1"}, "not a variable name"),
    ({"PATH": "/tmp/evil"}, "set by the run"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "set by the run"),
    ({hostcontract.MODE_ENV: "tree-verify"}, "set by the run"),
    ({"TRITON_CACHE_DIR": "/tmp/x"}, "set by the run"),
    ({"HF_TOKEN": "hf_abc"}, "looks like a secret"),
    ({"A": "x\nExecStart=/bin/sh"}, "not a plain string"),
    ({"A": "$(id)"}, "not a plain string"),
    ({"A": 1}, "not a plain string"),
])
def test_the_host_refuses_a_bad_service_env(env, why):
    with pytest.raises(Failure, match=why):
        hostsmoke.check_service_env(env)


def test_the_service_env_reaches_the_systemd_run_unit_and_the_contract_wins(tmp_path, monkeypatch):
    """A stand-in systemd-run on PATH records its argv (the real one needs systemd as PID 1)."""
    servers = pytest.importorskip("sglang_ddtree_tools.servers")
    f = tmp_path / "service-env.json"
    f.write_text(json.dumps({"SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1", "NCCL_DEBUG": "WARN",
                             "CUDA_VISIBLE_DEVICES": "7"}))
    service = servers.load_service_env(str(f))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    rec = tmp_path / "argv"
    (bindir / "systemd-run").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {rec}\n')
    (bindir / "systemd-run").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("SSH_AUTH_SOCK", "/tmp/agent")  # the caller's own environment stays out
    spec = servers.ServerSpec(mode="plain", target="/m/t")
    env = servers.server_env(spec, 1, service=service)
    servers.Server(["python3", "-m", "sglang.launch_server"], env, str(tmp_path / "log"), launcher="systemd-run",
                   unit="ddtree-smoke-0123456789ab-plain", keep=service).start()
    argv = rec.read_text().splitlines()
    argv = argv[:argv.index("--")]
    assert "--setenv=SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1" in argv and "--setenv=NCCL_DEBUG=WARN" in argv
    assert "--setenv=CUDA_VISIBLE_DEVICES=1" in argv and "--setenv=CUDA_VISIBLE_DEVICES=7" not in argv
    assert not any(a.startswith("--setenv=SSH_AUTH_SOCK") for a in argv)
    # without keep (no service env) the variable does not reach the unit
    servers.Server(["python3"], dict(env), str(tmp_path / "log"), launcher="systemd-run",
                   unit="ddtree-smoke-0123456789ab-x").start()
    assert "--setenv=NCCL_DEBUG=WARN" not in rec.read_text().splitlines()


def test_load_service_env_refuses_what_is_not_a_name_to_string_map(tmp_path):
    servers = pytest.importorskip("sglang_ddtree_tools.servers")
    assert servers.load_service_env(None) == {}
    f = tmp_path / "e.json"
    for bad in ([1], {"A B": "1"}, {"A": 1}):
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="variable names to strings"):
            servers.load_service_env(str(f))


def test_the_hosts_secret_rule_is_the_renderers():
    from deploy.release import render

    for name in ("HF_TOKEN", "hf_token", "DB_PASSWORD", "OPENAI_API_KEY", "NCCL_DEBUG", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK",
                 "TOKENIZERS_PARALLELISM"):
        assert hostcontract.secret_name(name) == bool(render.SECRET_KEY_RE.search(name)), name
    assert hostcontract.secret_name("hf_token") and not hostcontract.secret_name("NCCL_DEBUG")
