"""Tensor-parallel services on the lab's TP host (ct208: eight H200 on NVSwitch, persona h200-8gpu;
inventory/lab-tp.yaml): one server over GPUs 0-3, one over 4-5, one-GPU servers on 6 and 7. Deploy, restart and
rollback under load through the host's router with no failed request; each TP group is one unit, one drop-in
allowing exactly its GPUs, one router worker and one `fab status` row; its rendezvous ports are held (the
stand-in binds them as SGLang's group does) and never meet another group's.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from deploy.lab import fleet, loadgen

from helpers import CLEAN, ssh, strip_ansi

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "inventory" / "lab-tp.yaml"
HOST = "ct208"
KEY = "Kq8tensorParallelLab0123456789ab"
KEY_FILE = "/etc/ddtree/api-key.yaml"
GROUPS = {"gpu0": [0, 1, 2, 3], "gpu4": [4, 5], "gpu6": [6], "gpu7": [7]}


def tp_inventory(tmp: Path, name: str = "tp.yaml", budget: int | None = None) -> Path:
    """inventory/lab-tp.yaml for this lab (its id's addresses and key paths), optionally with another budget."""
    text = INVENTORY.read_text().replace("/var/lib/ddtree-lab/", f"{fleet.LAB_DIR}/").replace(
        "10.231.77.", f"{fleet.SUBNET}.")
    if budget is not None:
        text = text.replace("  budget: 16\n", f"  budget: {budget}\n")
    p = tmp / name
    p.write_text(text)
    return p


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory, fab):
    fleet.up(tp=True, log=lambda *_: None)  # the lab's hosts and ct208 (idempotent)
    from deploy.inventory import load_inventory
    tmp = tmp_path_factory.mktemp("labtp")
    inv_path = tp_inventory(tmp)
    inv = load_inventory(str(inv_path))
    ssh(inv, HOST, CLEAN + f"; install -d -m 0755 /etc/ddtree && (umask 077; printf 'api-key: {KEY}\\n' > {KEY_FILE})")
    yield {"inv": inv, "path": inv_path, "tmp": tmp, "router": f"http://{inv.hosts[HOST].address}:8000"}
    ssh(inv, HOST, CLEAN + f"; rm -f {KEY_FILE}; {inv.hosts[HOST].vars['venv']}/bin/python -m pip uninstall -y -q "
                          "sglang-ddtree", check=False)


def load(env):
    return loadgen.Load([(env["router"], KEY)], clients=6, total=100000, time_cap=240, max_new_tokens=24).start()


def under_load(env, fab, *args, inventory=None):
    lg = load(env)
    time.sleep(1.5)
    r = fab(*args, inventory=inventory or env["path"], timeout=600)
    time.sleep(1.0)
    lg.stop()
    s = loadgen.summary(lg.results)
    return r, strip_ansi(r.stdout), s


def rows(fab, env, inventory=None) -> list[dict]:
    r = fab("status", "--json", "--hosts", HOST, inventory=inventory or env["path"])
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_deploy_under_load_runs_each_tp_group_as_one_service_over_its_gpus(env, fab):
    r = fab("deploy", "--yes", inventory=env["path"], timeout=600)  # a first release for the load to reach
    assert r.returncode == 0, r.stdout + r.stderr
    r, out, s = under_load(env, fab, "deploy", "--yes", "--mode", "shadow-linear")
    print(f"\ndeploy (shadow-linear) on {HOST} under 6 streaming clients: {s}")
    assert r.returncode == 0, out + r.stderr
    assert s["failed"] == 0 and s["completed"] > 10, s
    got = {row["instance"]: row for row in rows(fab, env)}
    assert {i: row["gpus"] for i, row in got.items()} == GROUPS
    assert all(row["health"] == "ok" and row["router"] == "in/healthy" for row in got.values()), got
    table = strip_ansi(fab("status", "--hosts", HOST, inventory=env["path"]).stdout)
    assert re.search(r"ct208\s+0-3\s", table) and re.search(r"ct208\s+4-5\s", table), table
    # the group's unit: its GPUs in its drop-in and environment, its rendezvous ports held, no other GPU's node
    dropin = ssh(env["inv"], HOST, "cat /etc/systemd/system/sglang-ddtree@gpu0.service.d/50-ddtree-gpu.conf").stdout
    assert [ln for ln in dropin.splitlines() if ln.startswith("DeviceAllow=/dev/nvidia")] == [
        f"DeviceAllow=/dev/nvidia{g} rw" for g in range(4)]
    assert "KillMode=mixed" in dropin and "ReadWritePaths=/dev/shm" in dropin
    allowed = ssh(env["inv"], HOST, "systemctl show -p DeviceAllow sglang-ddtree@gpu4.service").stdout
    assert "/dev/nvidia4 rw" in allowed and "/dev/nvidia5 rw" in allowed and "/dev/nvidia0 " not in allowed
    envfile = ssh(env["inv"], HOST, "cat /opt/ddtree/releases/current/env/gpu0.env").stdout
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3\n" in envfile and "--tp-size 4" in envfile
    listening = ssh(env["inv"], HOST, "ss -ltnH").stdout
    for port in (31000, 31001, 31008, 31009):
        assert f"127.0.0.1:{port} " in listening, listening
    score = ssh(env["inv"], HOST, "systemd-analyze security --no-pager sglang-ddtree@gpu0.service").stdout
    m = re.search(r"Overall exposure level for sglang-ddtree@gpu0\.service: ([0-9.]+)", score)
    assert m and float(m.group(1)) <= 3.0, score


def test_restart_of_one_gpu_of_a_group_restarts_the_group_once_under_load(env, fab):
    before = {row["instance"]: row for row in rows(fab, env)}
    r, out, s = under_load(env, fab, "restart", "--yes", "--hosts", HOST, "--gpus", "2")
    print(f"\nrestart --gpus 2 on {HOST} under load: {s}")
    assert r.returncode == 0, out + r.stderr
    assert s["failed"] == 0 and s["completed"] > 10, s
    after = {row["instance"]: row for row in rows(fab, env)}
    assert "gpu0" in out and not re.search(r"\bgpu(4|6|7)\b.*restart", out), out
    assert after["gpu0"]["health"] == "ok" and after["gpu4"]["restarts"] == before["gpu4"]["restarts"]


def test_a_change_and_its_rollback_under_load_lose_no_request(env, fab):
    changed = tp_inventory(env["tmp"], "budget8.yaml", budget=8)
    r, out, s = under_load(env, fab, "deploy", "--yes", inventory=changed)
    print(f"\ndeploy budget 8 on {HOST} under load: {s}")
    assert r.returncode == 0, out + r.stderr
    assert s["failed"] == 0, s
    r, out, s = under_load(env, fab, "rollback", "--yes", "--hosts", HOST, inventory=changed)
    print(f"\nrollback on {HOST} under load: {s}")
    assert r.returncode == 0, out + r.stderr
    assert s["failed"] == 0 and s["completed"] > 10, s
    got = {row["instance"]: row for row in rows(fab, env, changed)}
    assert {i: row["gpus"] for i, row in got.items()} == GROUPS
    assert all(row["health"] == "ok" for row in got.values()), got
