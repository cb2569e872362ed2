"""`fab smoke` on the lab: the plan and its refusals on real hosts, and a CPU lab host saying it cannot run a GPU
smoke test - clearly, with a non-zero exit, leaving no transient unit and the deployed service untouched."""
from __future__ import annotations

import json

import pytest

from deploy.inventory import load_inventory
from deploy.smoke import SmokeRefused, plan_smoke

from helpers import CLEAN, lab_inventory, ssh

pytestmark = pytest.mark.lab
HOST = "h200"


@pytest.fixture(scope="module")
def deployed(lab, tmp_path_factory, fab):
    tmp = tmp_path_factory.mktemp("labsmoke")
    ssh(lab, HOST, CLEAN)
    inv = lab_inventory(tmp, keep=[HOST])
    none = fab("smoke", HOST, inventory=inv)
    r = fab("deploy", "--yes", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"inv": inv, "before_deploy": none}
    ssh(lab, HOST, CLEAN + f"; {lab.hosts[HOST].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
        check=False)


def test_refused_before_any_release(deployed):
    r = deployed["before_deploy"]
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{HOST} has no active release: run `fab deploy` first" in r.stderr


def test_lab_host_has_no_gpu_and_says_so(lab, deployed, fab):
    before = ssh(lab, HOST, "systemctl show -p InvocationID --value sglang-ddtree@gpu0").stdout.strip()
    r = fab("smoke", HOST, inventory=deployed["inv"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "cannot run: no GPU device /dev/nvidiactl or /dev/nvidia0 on this host" in r.stderr
    # the plan was shown: the configured service's family and mode, the release it runs
    assert f"[{HOST}] smoke on GPU 0 (gpu0): mode tree-verify, dense tiny model" in r.stdout
    left = ssh(lab, HOST, "systemctl list-units --all --no-legend 'ddtree-smoke-*'").stdout.strip()
    assert left == ""
    assert ssh(lab, HOST, "systemctl show -p InvocationID --value sglang-ddtree@gpu0").stdout.strip() == before
    assert ssh(lab, HOST, "ls /tmp | grep -c ddtree-smoke || true").stdout.strip() == "0"


def test_json_report_and_a_gpu_the_host_lacks(deployed, fab):
    r = fab("smoke", HOST, "--json", "--mode", "shadow-linear", inventory=deployed["inv"])
    out = json.loads(r.stdout)
    assert r.returncode == 2 and out["exit"] == 2 and out["plan"]["mode"] == "shadow-linear"
    assert out["result"]["report"]["cannot_run"].startswith("no GPU device")
    r = fab("smoke", HOST, "--gpu", "5", inventory=deployed["inv"])
    assert r.returncode == 2 and f"{HOST} has no GPU 5 (its GPUs: 0)" in r.stderr


def test_plan_family_follows_the_configured_model(deployed):
    inv = load_inventory(str(deployed["inv"]))
    host = inv.hosts[HOST]
    probe = {"current": "r1", "venv_trust": "ok", "configs": {host.services[0].model: {"config": {
        "architectures": ["Qwen3NextForCausalLM"], "layer_types": ["linear_attention", "full_attention"]}}}}
    p = plan_smoke(host, probe)
    assert (p.family, p.mode, p.gpu, p.user) == ("hybrid", "tree-verify", 0, host.vars["service_user"])
    assert "recurrent layers" in p.family_reason and p.budget <= 63 and p.prefix.startswith("ddtree-smoke-")
    with pytest.raises(SmokeRefused, match="root will not run it"):
        plan_smoke(host, dict(probe, venv_trust="site-packages is writable by group"))
    with pytest.raises(SmokeRefused, match="no readable config.json"):
        plan_smoke(host, dict(probe, configs={}))
    with pytest.raises(SmokeRefused, match="choose one of"):
        plan_smoke(host, probe, mode="beam")
