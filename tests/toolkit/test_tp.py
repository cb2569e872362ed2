"""Tensor-parallel services, pure: the inventory's groups and their file:line refusals, the contract's argv and
environment, the per-group rendezvous ports (never two on one port), the group's unit drop-in (its GPUs and no
other, NVSwitch, /dev/shm, the stop) under systemd-analyze verify and the exposure score, the GPUs' interconnect
parsed from `nvidia-smi topo -m` captures, the plan's P2P and attention-head refusals, and status/restart treating
a group as one service."""
from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy import contract, facts, tp
from deploy.inventory import InventoryError, load_inventory
from deploy.release import hostfit, render, rollout, status

ROOT = Path(__file__).resolve().parents[2]
CAPTURES = ROOT / "tests" / "captures"
NVSWITCH = (CAPTURES / "topo-8gpu-nvswitch.txt").read_text()
PCIE = (CAPTURES / "topo-8gpu-pcie.txt").read_text()
H200_1GPU = (ROOT / "lab" / "personas" / "h200-1gpu" / "topo.txt").read_text()

BASE = """\
fleet: t
reference: a
vars:
  model: /models/m
  draft_model: /models/d
hosts:
  a:
    address: 10.0.0.1
    gpus: 8
    services:
"""
GROUPS = BASE + """\
      0: {gpus: [0, 1, 2, 3], tp: 4}
      4:
        gpus: [4, 5]
      7: {mode: linear}
"""


def inv(tmp_path, text=GROUPS, name="inv.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return load_inventory(str(p)), str(p)


def problems(tmp_path, text) -> list[str]:
    with pytest.raises(InventoryError) as e:
        inv(tmp_path, text)
    return e.value.problems


# ---------------------------------------------------------------- inventory

def test_groups_beside_one_gpu_services(tmp_path):
    i, path = inv(tmp_path)
    svcs = {s.instance: s for s in i.hosts["a"].services}
    assert {k: (s.gpus, s.tp) for k, s in svcs.items()} == {
        "gpu0": ((0, 1, 2, 3), 4), "gpu4": ((4, 5), 2), "gpu6": ((6,), 1), "gpu7": ((7,), 1)}
    assert svcs["gpu0"].port == 30000 and svcs["gpu4"].port == 30004
    assert svcs["gpu0"].tp_port == (31000, 31001) and svcs["gpu4"].tp_port == (31008, 31009)
    assert svcs["gpu6"].tp_port is None and svcs["gpu7"].mode == "linear"
    assert svcs["gpu0"].where["gpus"] == f"{path}:11: hosts.a.services.0.gpus"
    assert svcs["gpu4"].where["gpus"] == f"{path}:13: hosts.a.services.4.gpus"


@pytest.mark.parametrize("entries, want", [
    ("      0: {gpus: [0, 1, 2, 3], tp: 2}\n", r":11: hosts\.a\.services\.0\.tp: tp 2 must equal the number of its gpus \(4"),
    ("      0: {tp: 2}\n", r":11: hosts\.a\.services\.0\.tp: tp 2 needs gpus: .*gpus: \[0, 1\]"),
    ("      2: {gpus: [2, 1]}\n", r":11: hosts\.a\.services\.2\.gpus: a TP service is keyed by its lowest GPU: write it "
                                 r"under services\.1"),
    ("      0:\n        gpus:\n          - 0\n          - 9\n", r":14: hosts\.a\.services\.0\.gpus: GPU 9 is not one of "
                                                              r"this host's GPUs"),
    ("      0: {gpus: [0, 1]}\n      1: {budget: 8}\n", r":12: hosts\.a\.services\.1: GPU 1 is already in service 0's gpus"),
    ("      0: {gpus: [0, 1, 2]}\n      2: {gpus: [2, 3]}\n", r":12: hosts\.a\.services\.2: GPU 2 is already in service 0"),
    ("      0: {gpus: [0, 0]}\n", r":11: hosts\.a\.services\.0\.gpus: GPU index 0 is listed twice"),
    ("      0: {gpus: []}\n", r":11: hosts\.a\.services\.0\.gpus: must be a non-empty list of GPU indices"),
    ("      3: {accept_no_p2p: true}\n", r":11: hosts\.a\.services\.3\.accept_no_p2p: only a TP service"),
    ("      0: {gpus: [0, 1], accept_no_p2p: 1}\n", r":11: hosts\.a\.services\.0\.accept_no_p2p: must be true or false"),
])
def test_bad_groups_are_refused_at_their_lines(tmp_path, entries, want):
    got = problems(tmp_path, BASE + entries)
    assert any(re.search(want, p) for p in got), got


def test_a_group_port_on_another_listener_is_refused(tmp_path):
    # base_port 31000: gpu1's HTTP port is 31001, gpu0's group's NCCL port
    got = problems(tmp_path, BASE.replace("  draft_model: /models/d\n", "  draft_model: /models/d\n  base_port: 31000\n")
                   + "      0: {gpus: [0, 2]}\n")
    assert any(re.search(r":12: hosts\.a\.services\.0: its TP group's port 31001 .* is also GPU 1's port", p)
               for p in got), got
    got = problems(tmp_path, BASE.replace("  draft_model: /models/d\n",
                                          "  draft_model: /models/d\n  tp_port_base: 65530\n")
                   + "      4: {gpus: [4, 5]}\n")
    assert any("are not TCP ports" in p and ":12: hosts.a.services.4.gpus" in p for p in got), got


def test_heads_a_local_config_can_tell_are_checked(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_attention_heads": 12, "num_key_value_heads": 4}))
    text = GROUPS.replace("/models/m", str(model))
    got = problems(tmp_path, text.replace("[0, 1, 2, 3], tp: 4", "[0, 1, 2, 3, 4, 5, 6, 7], tp: 8").replace(
        "      4:\n        gpus: [4, 5]\n      7: {mode: linear}\n", ""))
    assert any(re.search(r":11: hosts\.a\.services\.0\.tp: model .*num_attention_heads 12 is not a multiple of tp 8", p)
               for p in got), got
    inv(tmp_path, text)  # tp 4 and 2 divide 12 heads (4 KV heads: 4 % 4, 4 % 2)


def test_heads_rule():
    assert tp.heads_problem({"num_attention_heads": 32, "num_key_value_heads": 8}, 4) is None
    assert tp.heads_problem({"num_attention_heads": 32, "num_key_value_heads": 2}, 8) is None  # KV replicated
    assert "num_key_value_heads 3" in tp.heads_problem({"num_attention_heads": 24, "num_key_value_heads": 3}, 4)
    assert "not a multiple" in tp.heads_problem({"num_attention_heads": 20}, 8)
    assert tp.heads_problem({"text_config": {"num_attention_heads": 64, "num_key_value_heads": 8}}, 8) is None
    assert tp.heads_problem({"architectures": ["X"]}, 2).startswith("not checked")
    assert tp.heads_problem({}, 1) is None


# ---------------------------------------------------------------- ports

def test_tp_ports_never_meet_across_groups_of_a_host():
    for base in (1024, 31000, 60000):
        seen = {}
        for g in range(64):
            if base + 2 * g + 1 > 65535:
                with pytest.raises(ValueError):
                    contract.tp_ports(base, g)
                continue
            for p in contract.tp_ports(base, g):
                assert p not in seen, (base, g, seen.get(p))
                seen[p] = g
    with pytest.raises(ValueError):
        contract.tp_ports(31000, -1)


def test_two_groups_on_one_host_render_disjoint_ports(tmp_path):
    i, _ = inv(tmp_path)
    ports = []
    for s in i.hosts["a"].services:
        args = render.server_args(s)
        ports.append(s.port)
        if s.tp > 1:
            host, dist = args[args.index("--dist-init-addr") + 1].split(":")
            ports += [int(dist), int(args[args.index("--nccl-port") + 1])]
            assert host == "127.0.0.1" and args[args.index("--tp-size") + 1] == str(s.tp)
        else:
            assert not set(contract.TP_FLAGS) & set(args)
    assert len(ports) == len(set(ports)) == 4 + 4


# ---------------------------------------------------------------- contract and rendering

def test_contract_argv_and_env_for_a_group():
    a = contract.sglang_args("tree-verify", "/m", "/d", budget=8, block=16, host="127.0.0.1", port=30000,
                             decode_graphs=True, tp=4, tp_port=(31000, 31001))
    assert a[-6:] == ["--tp-size", "4", "--dist-init-addr", "127.0.0.1:31000", "--nccl-port", "31001"]
    one = contract.sglang_args("tree-verify", "/m", "/d", budget=8, block=16, host="127.0.0.1", port=30000,
                               decode_graphs=True)
    assert a[:len(one)] == one  # a group's server is the one-GPU server plus its group
    assert contract.sglang_env("linear", None, [4, 5]) == [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
                                                           ("CUDA_VISIBLE_DEVICES", "4,5"), ("NCCL_SOCKET_IFNAME", "lo")]
    assert contract.sglang_env("linear", None, 3) == [("CUDA_DEVICE_ORDER", "PCI_BUS_ID"), ("CUDA_VISIBLE_DEVICES", "3")]
    for bad in ([1, 1], [], [-1]):
        with pytest.raises(ValueError):
            contract.sglang_env("linear", None, bad)
    with pytest.raises(ValueError):
        contract.sglang_args("linear", "/m", "/d", budget=None, block=16, host="h", port=1, decode_graphs=True, tp=0)


def test_a_group_serves_a_budget_schedule(tmp_path):
    """A TP group in tree-verify with a budget schedule: the group's argv (--tp-size, its ports) with the schedule's
    largest width as D, and the group's environment with its GPUs, NCCL's interface and the schedule's text."""
    i, _ = inv(tmp_path, GROUPS.replace("      0: {gpus: [0, 1, 2, 3], tp: 4}\n",
                                        "      0: {gpus: [0, 1, 2, 3], tp: 4, mode: tree-verify,\n"
                                        "          budget: {1: 31, 8: 7, 32: chain}}\n"))
    g0 = i.hosts["a"].services[0]
    assert isinstance(g0.budget, contract.BudgetSchedule) and g0.tp == 4
    args = render.server_args(g0)
    assert args[args.index("--tp-size") + 1] == "4" and args[args.index("--nccl-port") + 1] == "31001"
    assert args[args.index("--speculative-num-draft-tokens") + 1] == "32"  # 31 nodes + the root
    env = dict(render.service_env(g0))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env[contract.BUDGET_ENV] == "1:31,8:7,32:chain"
    got = problems(tmp_path, GROUPS.replace("      0: {gpus: [0, 1, 2, 3], tp: 4}\n",
                                            "      0: {gpus: [0, 1, 2, 3], tp: 4, mode: shadow-linear,\n"
                                            "          budget: {1: 31, 8: 7}}\n"))
    assert any(re.search(r":11: hosts\.a\.services\.0: budget .* is a schedule", p) for p in got), got


def test_the_group_argv_parses_with_sglangs_real_parser(tmp_path):
    sa = pytest.importorskip("sglang.srt.server_args", reason="sglang not installed (requirements)")
    p = argparse.ArgumentParser(exit_on_error=False)
    sa.ServerArgs.add_cli_args(p)
    i, _ = inv(tmp_path)
    s = i.hosts["a"].services[0]
    ns = p.parse_args(render.server_args(s))
    assert (ns.tp_size, ns.dist_init_addr, ns.nccl_port) == (4, "127.0.0.1:31000", 31001)


@pytest.mark.parametrize("flag", ["--tp-size", "--tensor-parallel-size", "--dist-init-addr", "--nccl-port", "--tp"])
def test_extra_args_cannot_set_the_group(tmp_path, flag):
    got = problems(tmp_path, GROUPS.replace("  draft_model: /models/d\n",
                                            f"  draft_model: /models/d\n  extra_args: [\"{flag}\", \"2\"]\n"))
    assert any("the deploy tool sets" in p for p in got), got


def test_env_and_dropin_of_a_group_name_its_gpus_and_no_other(tmp_path):
    i, _ = inv(tmp_path)
    g0, g4, g6, _g7 = i.hosts["a"].services
    env = dict(render.service_env(g0))
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and env["NCCL_SOCKET_IFNAME"] == "lo"
    assert "--tp-size 4" in env["SGLANG_ARGS"] and "--nccl-port 31001" in env["SGLANG_ARGS"]
    d = render.render_dropin(g0, drain_timeout=40)
    lines = [ln for ln in d.splitlines() if not ln.startswith("#")]
    assert lines == ["[Service]"] + [f"DeviceAllow=/dev/nvidia{g} rw" for g in range(4)] + [
        "DeviceAllow=char-nvidia-nvswitch rw", "ReadWritePaths=/dev/shm", "KillMode=mixed", f"TimeoutStopSec={60 + 4 * render.TP_TEARDOWN_S}"]
    assert render.stop_timeout(g4, 300) == 300 + 2 * render.TP_TEARDOWN_S > 300  # past the drain
    assert render.stop_timeout(g6, 300) == render.STOP_TIMEOUT
    assert [ln for ln in render.render_dropin(g6, 300).splitlines() if not ln.startswith("#")] == [
        "[Service]", "DeviceAllow=/dev/nvidia6 rw"]  # a one-GPU drop-in is what it always was
    with pytest.raises(render.RenderError, match="without its ports"):
        render.server_args(__import__("dataclasses").replace(g0, tp_port=None))


def _units(tmp: Path, unit: str, dropins: dict) -> Path:
    d = tmp / "units"
    (d).mkdir(exist_ok=True)
    for inst, text in dropins.items():
        (d / f"sglang-ddtree@{inst}.service").write_text(unit)
        (d / f"sglang-ddtree@{inst}.service.d").mkdir(exist_ok=True)
        (d / f"sglang-ddtree@{inst}.service.d" / render.GPU_DROPIN).write_text(text)
    return d


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_group_units_verify_and_score_at_most_3(tmp_path):
    import dataclasses
    import os
    import sys
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    i, _ = inv(tmp_path)
    h = i.hosts["a"]
    h = dataclasses.replace(h, vars=dict(h.vars, venv=str(venv)))
    d = _units(tmp_path, render.render_unit(h), {s.instance: render.render_dropin(s, 300) for s in h.services})
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *map(str, sorted(d.glob("*.service")))],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr.strip() == "", r.stderr
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        str(d / "sglang-ddtree@gpu0.service")], capture_output=True, text=True)
    m = re.search(r"Overall exposure level for \S+: ([0-9.]+) ", r.stdout)
    assert m and float(m.group(1)) <= 3.0, r.stdout + r.stderr
    assert all(f"/dev/nvidia{g}:rw" in r.stdout for g in range(4)) and "/dev/nvidia4:rw" not in r.stdout


# ---------------------------------------------------------------- facts: the interconnect

def test_topo_parser_on_the_captures():
    nv = facts.parse_topo_matrix(NVSWITCH)
    assert sorted(nv["links"]) == [f"GPU{i}" for i in range(8)]
    assert {v for row in nv["links"].values() for v in row.values()} == {"NV18"}
    assert "NIC0" not in nv["links"]["GPU0"] and nv["numa"]["GPU5"] == "1"
    assert nv["cpu_affinity"]["GPU0"] == "0-47,96-143"
    pc = facts.parse_topo_matrix(PCIE)["links"]
    assert (pc["GPU0"]["GPU1"], pc["GPU0"]["GPU2"], pc["GPU0"]["GPU4"]) == ("PIX", "PHB", "SYS")
    assert all(pc[f"GPU{a}"][f"GPU{b}"] == pc[f"GPU{b}"][f"GPU{a}"] for a, b in itertools.permutations(range(8), 2))
    one = facts.parse_topo_matrix(H200_1GPU)  # the real capture: ANSI-underlined header, one GPU
    assert one["links"] == {"GPU0": {}} and one["numa"] == {"GPU0": "0"}
    assert facts.parse_topo_matrix("") == {"links": {}, "cpu_affinity": {}, "numa": {}}
    assert facts.build_facts("a", {"nvidia_smi_query": {"rc": 0, "out": ""},
                                   "nvidia_smi_topo": {"rc": 0, "out": NVSWITCH}})["nvidia"]["topology"]["links"]


def test_p2p_judgement():
    nv, pc = facts.parse_topo_matrix(NVSWITCH)["links"], facts.parse_topo_matrix(PCIE)["links"]
    assert tp.p2p_problem(nv, range(8)) is None
    assert tp.p2p_problem(pc, [0, 1, 2, 3]) is None  # PIX and PHB under one socket
    why = tp.p2p_problem(pc, [2, 3, 4, 5])
    assert "GPU2-GPU4 SYS" in why and "GPU2-GPU3" not in why
    assert "GPU0-GPU1 not in the matrix" in tp.p2p_problem({}, [0, 1])
    assert [tp.link_p2p(x) for x in ("NV4", "PXB", "NODE", "SOC", "??")] == [True, True, False, False, None]


def _state(topo_out=None, rc=0, configs=None):
    smi = "index, uuid, name, driver_version, memory.total [MiB], compute_cap, pci.bus_id, serial\n" + "".join(
        f"{g}, GPU-{g}, NVIDIA H200, 580.159.04, 143771 MiB, 9.0, 00000000:{g:02X}:00.0, 1\n" for g in range(8))
    f = {"nvidia_smi_query": {"rc": 0, "out": smi, "err": ""}}
    if topo_out is not None:
        f["nvidia_smi_topo"] = {"rc": rc, "out": topo_out, "err": "" if rc == 0 else "topo failed"}
    return {"facts": f} | ({"configs": configs} if configs is not None else {})


def test_plan_refuses_a_group_without_p2p_unless_accepted(tmp_path):
    text = BASE + "      2: {gpus: [2, 3, 4, 5]}\n"
    i, path = inv(tmp_path, text)
    h = i.hosts["a"]
    refused, _ = hostfit.refusals(h, _state(PCIE))
    assert any(r.startswith(f"{path}:11: hosts.a.services.2.gpus: gpu2 (GPUs 2, 3, 4, 5): no peer-to-peer between ")
               and "GPU3-GPU5 SYS" in r and "accept_no_p2p: true" in r for r in refused), refused
    assert not [r for r in hostfit.refusals(h, _state(NVSWITCH))[0] if "peer-to-peer" in r]
    refused, _ = hostfit.refusals(h, _state(None))  # no matrix: refused, never assumed fine
    assert any("interconnect is unknown" in r for r in refused), refused
    i2, _ = inv(tmp_path, BASE + "      2: {gpus: [2, 3, 4, 5], accept_no_p2p: true}\n", "accepted.yaml")
    refused, warnings = hostfit.refusals(i2.hosts["a"], _state(PCIE))
    assert not [r for r in refused if "peer-to-peer" in r]
    assert any("deployed anyway (accept_no_p2p)" in w for w in warnings), warnings


def test_plan_checks_heads_from_the_host_and_says_when_it_could_not(tmp_path):
    i, path = inv(tmp_path)
    h = i.hosts["a"]
    bad = {"/models/m": {"config": {"num_attention_heads": 6, "num_key_value_heads": 6}},
           "/models/d": {"error": "no config.json"}}
    refused, warnings = hostfit.refusals(h, _state(NVSWITCH, configs=bad))
    assert any(r.startswith(f"{path}:4: vars.model: gpu0: model /models/m: num_attention_heads 6 is not a multiple "
                            "of tp 4") for r in refused), refused
    assert any("gpu0: tp 4 not checked against draft_model /models/d" in w for w in warnings), warnings
    refused, warnings = hostfit.refusals(h, _state(NVSWITCH))
    assert not [r for r in refused if "heads" in r] and any("not checked" in w for w in warnings)


def test_plan_refuses_a_group_gpu_the_host_lacks_and_listens_on_its_ports(tmp_path):
    i, path = inv(tmp_path, BASE.replace("gpus: 8", "gpus: 10") + "      8: {gpus: [8, 9]}\n")
    refused, _ = hostfit.refusals(i.hosts["a"], _state(NVSWITCH))
    assert f"{path}:11: hosts.a.services.8.gpus: gpu8: a has no GPU 9 (nvidia-smi lists GPU 0" in "\n".join(refused)
    ports = {p: what for p, _a, what, _w in hostfit.wanted_ports(i.hosts["a"])}
    assert ports[31016].startswith("gpu8's TP group (--dist-init-addr)") and "--nccl-port" in ports[31017]


# ---------------------------------------------------------------- one service over its GPUs

def test_status_and_restart_treat_a_group_as_one_service():
    assert status.gpu_cell({"gpu": 0, "gpus": [0, 1, 2, 3]}) == "0-3"
    assert status.gpu_cell({"gpu": 0, "gpus": [0, 2]}) == "0,2"
    assert status.gpu_cell({"gpu": 6, "gpus": [6]}) == "6" and status.gpu_cell({"gpu": 5}) == "5"



def test_restart_of_any_gpu_of_a_group_picks_the_group(tmp_path):
    i, _ = inv(tmp_path)
    host = i.hosts["a"]
    man = {"release": "r1", "router": {"enabled": False}, "services": {
        "gpu0": {"gpu": 0, "gpus": [0, 1, 2, 3], "port": 30000, "enabled": True, "digest": "a"},
        "gpu4": {"gpu": 4, "gpus": [4, 5], "port": 30004, "enabled": True, "digest": "b"},
        "gpu7": {"gpu": 7, "port": 30007, "enabled": True, "digest": "c"}}}  # gpu7: a manifest of before TP
    for s in man["services"].values():
        s.update(model="/models/m", algorithm="DDTREE")
    running = {i: {"ActiveState": "active"} for i in man["services"]}  # nothing to restart for its own sake

    def picked(gpus):
        p = rollout.restart_payload(host, {"manifest": man, "current": "r1", "units": running}, gpus)
        return {i for b in p["batches"] for i in json.dumps(b).split('"') if i in man["services"]}

    assert picked([2]) == picked([0]) == picked([1, 3]) == {"gpu0"}
    assert picked([5]) == {"gpu4"} and picked([7]) == {"gpu7"} and picked([6]) == set()
    assert picked(None) == {"gpu0", "gpu4", "gpu7"}
