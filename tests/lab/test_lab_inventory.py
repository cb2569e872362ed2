"""`fab inventory` against the real lab hosts (systemd-nspawn, real sshd, verified host keys)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from deploy.lab import fleet

# the lab as lab.up built it (ct200 +cu128, no drift), whatever ran on it before: tests/labstate.py
pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("lab_as_built")]


def test_inventory_shows_ct200_cu128_drift_against_ct129(lab, fab):
    r = fab("inventory", "--json", "--refresh")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    hosts = doc["hosts"]
    assert set(hosts) == {"ct129", "ct200", "h200"} and doc["reference"] == "ct129"
    assert hosts["ct129"]["torch"]["version"] == "2.11.0+cu130"
    assert hosts["ct200"]["torch"]["version"] == "2.11.0+cu128"
    assert hosts["ct200"]["torch"]["cuda"] == "12.8" and hosts["ct200"]["torch"]["cxx11_abi"] is True
    assert hosts["h200"]["nvidia"]["gpus"][0]["name"] == "NVIDIA H200"
    assert hosts["h200"]["nvidia"]["gpus"][0]["sm"] == "sm_90"
    assert [g["sm"] for g in hosts["ct129"]["nvidia"]["gpus"]] == ["sm_120"] * 8
    assert hosts["ct129"]["nvidia"]["driver"] == "580.159.04" and hosts["ct129"]["nvidia"]["cuda"] == "13.0"
    assert hosts["ct129"]["os"]["id"] == "debian" and hosts["ct129"]["venv"]["abi"] == "cp311"
    assert hosts["ct129"]["venv"]["distributions"]["triton"] == "3.6.0"
    assert hosts["ct129"]["hostname"] == "ct129"  # really that host, not the control machine
    # cached per host with the time gathered
    cached = json.loads((Path(lab.path).parent / "facts" / "ct200.json").read_text())
    assert cached["torch"]["version"] == "2.11.0+cu128" and cached["gathered_at"]


def test_table_highlights_build_tag_mismatch(lab, fab):
    """The ct200 row shows its torch build; the drift under the table says in words that it is the reference's
    release with another build tag (ABI); h200, on the reference's build, has no drift line."""
    r = fab("inventory", "--refresh")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "2.11.0+cu128" in next(ln for ln in lines if ln.startswith("ct200 "))
    said = next(ln for ln in lines if ln.startswith("ct200: differs from ct129"))
    assert "torch 2.11.0+cu128, reference 2.11.0+cu130" in said and "ABI≠ref" in r.stdout
    assert not any(ln.startswith("h200:") for ln in lines)
    wide = fab("inventory", "--wide").stdout.splitlines()     # the wide view: the mark in the row itself
    line = next(ln for ln in wide if "ct200" in ln)
    assert "2.11.0+cu128" in line and "ABI≠ref" in line
    assert "ABI≠ref" not in next(ln for ln in wide if "h200" in ln)


def test_table_fits_a_100_column_terminal_one_line_a_host(lab, fab):
    """COLUMNS=100 (a terminal that wide, or the width asked of a pipe): no line over 100 characters and one line
    per host, the key facts of each host on it; the wide view keeps every column (OS, glibc, endpoint)."""
    r = fab("inventory", env={"COLUMNS": "100"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 100, "\n".join(ln for ln in lines if len(ln) > 100)
    for host in ("ct129", "ct200", "h200"):
        rows = [ln for ln in lines if ln.split(" ", 1)[0] == host]
        assert len(rows) == 1, (host, r.stdout)
        assert "580.159.04" in rows[0] and "0.5.17" in rows[0] and " ok " in rows[0] + " ", rows[0]
    assert "1x sm_90" in next(ln for ln in lines if ln.startswith("h200 "))
    wide = fab("inventory", "--wide", env={"COLUMNS": "100"}).stdout
    assert "glibc" in wide and "endpoint" in wide and "router 127.0.0.1" in wide
    doc = json.loads(fab("inventory", "--json", env={"COLUMNS": "100"}).stdout)
    assert doc["hosts"]["h200"]["os"]["glibc"] and doc["endpoints"]["h200"]["router"]


def _inventory_copy(tmp_path, lab, extra_hosts: str = "", known_hosts: str | None = None) -> Path:
    text = Path(lab.path).read_text()
    if known_hosts:
        text = text.replace(str(fleet.known_hosts()), known_hosts)
    p = tmp_path / "inv.yaml"
    p.write_text(text + extra_hosts)
    return p


def test_unreachable_host_reported_others_gathered(lab, fab, tmp_path):
    inv = _inventory_copy(tmp_path, lab, f"  ghost:\n    address: {fleet.SUBNET}.250\n"
                            "    gpus: 1\n")
    r = fab("inventory", "--json", "--refresh", inventory=inv)
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert set(doc["hosts"]) == {"ct129", "ct200", "h200"}
    assert doc["errors"]["ghost"]["kind"] == "unreachable"
    assert "ghost (unreachable" in r.stderr


def test_host_key_mismatch_and_unknown_key_refused(lab, fab, tmp_path):
    lines = fleet.known_hosts().read_text().splitlines()
    by_addr = {ln.split()[0]: ln for ln in lines}
    ct129_key = by_addr[lab.hosts["ct129"].address].split(None, 1)[1]
    forged = [f"{lab.hosts['ct200'].address} {ct129_key}" if ln.startswith(lab.hosts["ct200"].address + " ") else ln
              for ln in lines if not ln.startswith(lab.hosts["h200"].address + " ")]
    kh = tmp_path / "known_hosts"
    kh.write_text("\n".join(forged) + "\n")
    before = kh.read_text()
    r = fab("inventory", "--json", "--refresh", inventory=_inventory_copy(tmp_path, lab, known_hosts=str(kh)))
    assert r.returncode == 1
    doc = json.loads(r.stdout)
    assert set(doc["hosts"]) == {"ct129"}
    assert doc["errors"]["ct200"]["kind"] == "host-key-mismatch"
    assert doc["errors"]["h200"]["kind"] == "host-key-unknown"
    assert kh.read_text() == before  # nothing auto-accepted or written


def test_lab_connections_use_the_quick_ack_socket_and_verify_keys(lab):
    """open_checked's transport runs on QuickAckSocket (no Nagle, quick ACKs) with RejectPolicy still in place."""
    import socket

    import paramiko

    from deploy.ssh import QuickAckSocket, open_checked
    conn = open_checked(lab, lab.hosts["ct129"])
    try:
        sock = conn.client.get_transport().sock
        assert isinstance(sock, QuickAckSocket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert isinstance(conn.client._policy, paramiko.RejectPolicy)
        assert conn.run("hostname", hide=True, in_stream=False).stdout.strip() == "ct129"
    finally:
        conn.close()


def test_cached_facts_used_until_refresh(lab, fab):
    fab("inventory", "--json", "--refresh")
    first = json.loads(fab("inventory", "--json", "--hosts", "ct200").stdout)["hosts"]["ct200"]["gathered_at"]
    again = json.loads(fab("inventory", "--json", "--hosts", "ct200").stdout)["hosts"]["ct200"]["gathered_at"]
    assert first == again
    import time
    time.sleep(1.1)
    fresh = json.loads(fab("inventory", "--json", "--hosts", "ct200", "--refresh").stdout)["hosts"]
    assert set(fresh) == {"ct200"} and fresh["ct200"]["gathered_at"] > first


def test_lab_status_and_idempotent_up(lab, fab):
    report = fleet.up()
    assert set(report["hosts"].values()) == {"running"}  # nothing booted twice
    rows = {r["host"]: r for r in fleet.status()}
    assert all(rows[h]["state"] == "running" and rows[h]["sshd"] for h in ("ct129", "ct200", "h200"))
    r = fab("--list")
    assert "inventory" in r.stdout and "lab.up" in r.stdout


def test_lab_hosts_carry_model_configs_for_the_deploy_gate(lab):
    """inventory/lab.yaml's model and draft model exist on every lab host (config.json, no weights)."""
    import subprocess
    for h in lab.hosts.values():
        (svc,) = h.services[:1]
        out = subprocess.run(["ssh", "-o", f"UserKnownHostsFile={fleet.known_hosts()}", "-o", "StrictHostKeyChecking=yes",
                              "-o", "BatchMode=yes", "-i", str(fleet.LAB_DIR / "id_ed25519"), f"root@{h.address}",
                              f"cat {svc.model}/config.json {svc.draft_model}/config.json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert '"Qwen3ForCausalLM"' in out.stdout and '"DFlashDraftModel"' in out.stdout


def test_hung_nvidia_smi_is_reported_once_fast_and_fails_the_exit_code(lab, fab, tmp_path):
    """Issue 9: with an nvidia-smi that never returns on h200, `fab inventory --hosts h200` took 61 s (two 30 s
    timeouts) and exited 0 with "timed out" in the GPU column. Now: one deadline for the whole probe, the hung
    command and its children killed, the other hosts' facts complete, and exit 1 naming what is incomplete."""
    import time

    from deploy.facts import PROBE_BUDGET
    from deploy.remote.client import AgentError, Remote
    from deploy.ssh import open_checked
    h = lab.hosts["h200"]
    n = 4000 + os.getpid() % 5000

    def on_h200(cmd):
        conn = open_checked(lab, h)
        try:
            return conn.run(cmd, hide=True, warn=True, in_stream=False).stdout
        finally:
            conn.close()
    on_h200(f"cp -a /usr/bin/nvidia-smi /root/nvidia-smi.keep && printf '#!/bin/sh\\nsleep {n} &\\nexec sleep {n}\\n'"
            " > /usr/bin/nvidia-smi")
    try:
        t = time.monotonic()
        r = fab("inventory", "--json", "--refresh")
        took = time.monotonic() - t
        assert r.returncode == 1, r.stderr
        assert took < PROBE_BUDGET + 8, took
        doc = json.loads(r.stdout)
        assert set(doc["hosts"]) == {"ct129", "ct200", "h200"} and not doc["errors"]
        assert set(doc["incomplete"]) == {"h200"} and "nvidia_smi_query: timed out" in doc["incomplete"]["h200"]
        assert "1 host(s) with incomplete facts: h200 (nvidia_smi_query: timed out" in r.stderr, r.stderr
        assert doc["hosts"]["ct129"]["nvidia"]["gpus"] and doc["hosts"]["h200"]["torch"]["version"]
        time.sleep(0.5)
        assert on_h200(f"pgrep -fx 'sleep {n}' || true").strip() == ""      # killed with its children
        # the agent keeps within its caller's deadline (the probe budget shrinks to fit) ...
        conn = open_checked(lab, h)
        try:
            t = time.monotonic()
            raw = Remote(conn, "h200").call("facts.probe", {"venv": h.venv, "budget": 60}, deadline=5, root=False)
            assert time.monotonic() - t < 5 and raw["incomplete"]
            # ... and the client's executor enforces it on whatever runs: a silent command is cut at the deadline,
            # a long call whose host goes quiet is declared a lost link after `silence` seconds
            r_ = Remote(conn, "h200")
            for kw, kind in (({"deadline": 3, "silence": None}, "timeout"), ({"deadline": 60, "silence": 2},
                                                                            "link-lost")):
                t = time.monotonic()
                with pytest.raises(AgentError) as err:
                    r_._exec("sleep 9", b"", kw["deadline"], None, kw["silence"])
                assert err.value.kind == kind and time.monotonic() - t < 5, (kind, err.value)
        finally:
            conn.close()
    finally:
        on_h200(f"cp -a /root/nvidia-smi.keep /usr/bin/nvidia-smi; pkill -x -f 'sleep {n}'; true")
    r = fab("inventory", "--json", "--refresh", "--hosts", "h200")
    assert r.returncode == 0 and not json.loads(r.stdout)["incomplete"]
