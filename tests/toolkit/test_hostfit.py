"""The deploy plan's checks of an inventory against its host (deploy/release/hostfit.py, pure) and what the host
side reads for them (deploy/remote/host/fit.py), here on this machine's own /proc and files; and the host side's
errors naming the path they failed on (fsutil.naming)."""
from __future__ import annotations

import dataclasses
import json
import os
import socket

from deploy.inventory import load_inventory
from deploy.release import hostfit
from deploy.remote.host import fit

INV = """\
fleet: t
reference: a
vars:
  model: /models/m
  draft_model: /models/d
  server: labserver
hosts:
  a:
    address: 10.0.0.1
    gpus: [0, 5]
    services:
      5:
        port: 22
        model: /etc
"""
H200_SMI = ("index, uuid, name, driver_version, memory.total [MiB], compute_cap, pci.bus_id, serial\n"
            "0, GPU-aeace5b3-1958-aad9-f0c5-96fb66d00e4c, NVIDIA H200, 580.159.04, 143771 MiB, 9.0, "
            "00000000:00:06.0, 1653724050586\n")
SSHD = {"pid": 88, "comm": "sshd", "unit": "ssh.service", "address": "0.0.0.0"}


def host(tmp_path, text=INV):
    p = tmp_path / "inv.yaml"
    p.write_text(text)
    return load_inventory(str(p)).hosts["a"], str(p)


def state(**kw):
    return {"facts": {"nvidia_smi_query": {"rc": 0, "out": H200_SMI, "err": ""}}, "listeners": {},
            "model_dirs": {"/models/m": "ok", "/models/d": "ok"}} | kw


def test_inventory_keeps_where_each_checked_value_was_set(tmp_path):
    h, path = host(tmp_path)
    gpu0, gpu5 = h.services
    assert gpu5.where == {"gpu": f"{path}:10: hosts.a.gpus", "port": f"{path}:13: hosts.a.services.5.port",
                          "model": f"{path}:14: hosts.a.services.5.model", "draft_model": f"{path}:5: vars.draft_model"}
    assert gpu0.where["port"] == f"{path}:10: hosts.a.gpus (port: the default base_port + 0)"
    assert gpu0.where["model"] == f"{path}:4: vars.model"
    assert h.where == {"router.port": f"{path}:8: hosts.a (default router.port)",
                       "router.metrics_port": f"{path}:8: hosts.a (default router.metrics_port)"}


def test_a_gpu_the_host_lacks_a_port_sshd_holds_and_a_path_that_is_no_model_are_refused_at_their_lines(tmp_path):
    h, path = host(tmp_path)
    refused, warnings = hostfit.refusals(h, state(listeners={"22": [SSHD]}, model_dirs={
        "/models/m": "ok", "/models/d": "ok", "/etc": "/etc: not a model directory (no config.json)"}))
    assert refused == [
        f"{path}:10: hosts.a.gpus: gpu5: a has no GPU 5 (nvidia-smi lists GPU 0)",
        f"{path}:13: hosts.a.services.5.port: port 22 (gpu5, on 127.0.0.1) is in use on a by sshd, the host SSH "
        "server (pid 88, ssh.service, on 0.0.0.0)",
        f"{path}:14: hosts.a.services.5.model: /etc: not a model directory (no config.json) (gpu5)"]
    assert warnings == []
    assert hostfit.probe_args(h) == {"listeners": [22, 8000, 29000, 30000],
                                     "model_dirs": ["/etc", "/models/d", "/models/m"]}


def test_ports_held_by_the_toolkits_own_units_or_on_another_address_are_not_refused(tmp_path):
    h, _ = host(tmp_path, INV.replace("port: 22", "port: 30005").replace("model: /etc", "model: /models/m")
                .replace("[0, 5]", "[0]").replace("      5:\n", "      0:\n"))
    own = {"30005": [], "30000": [{"pid": 9, "comm": "python3", "unit": "sglang-ddtree@gpu0.service",
                                   "address": "127.0.0.1"}],
           "8000": [{"pid": 7, "comm": "sglang-router", "unit": "sglang-router.service", "address": "127.0.0.1"},
                    {"pid": 5, "comm": "nginx", "unit": "nginx.service", "address": "10.0.0.1"}]}
    assert hostfit.refusals(h, state(listeners=own)) == ([], [])
    other = dict(own, **{"29000": [{"pid": 5, "comm": "nginx", "unit": "nginx.service", "address": "::"}]})
    (msg,), _ = hostfit.refusals(h, state(listeners=other))
    assert msg.endswith("(default router.metrics_port): port 29000 (the router's metrics, on 127.0.0.1) is in use on "
                        "a by nginx (pid 5, nginx.service, on ::)")


def test_what_the_probe_did_not_read_is_not_judged_and_an_unanswered_nvidia_smi_is_a_warning(tmp_path):
    h, _ = host(tmp_path)
    assert hostfit.refusals(h, {}) == ([], [])     # a restart's or a rollback's probe asks for none of it
    refused, warnings = hostfit.refusals(h, state(facts={"nvidia_smi_query": None}, model_dirs={}))
    assert refused == [] and warnings == ["WARNING GPU indices not checked (no nvidia-smi on the host)"]
    disabled = dataclasses.replace(h, services=tuple(dataclasses.replace(s, enabled=s.gpu != 5) for s in h.services))
    assert hostfit.refusals(disabled, state(listeners={"22": [SSHD]})) == ([], [])


def test_host_side_finds_this_process_listening_and_ignores_a_connected_socket():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    try:
        got = fit.listeners([port, 1])
        assert list(got) == [str(port)]
        (me,) = [o for o in got[str(port)] if o["pid"] == os.getpid()]
        assert me["address"] == "127.0.0.1" and me["comm"]
    finally:
        cli.close()
        srv.close()
    assert fit.listeners([port]) == {}


def test_host_side_reads_ipv6_and_mapped_addresses_from_proc_tables(tmp_path):
    little = os.sys.byteorder == "little"
    v4 = "0100007F" if little else "7F000001"
    v6_any = "0" * 32
    mapped = ("0000000000000000FFFF00000100007F" if little else "00000000000000000000FFFF7F000001")
    (tmp_path / "tcp").write_text("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid "
                                  "timeout inode\n"
                                  f"   0: {v4}:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000 0 0 111 1\n"
                                  f"   1: {v4}:7531 0100007F:D431 01 00000000:00000000 00:00000000 00000000 0 0 112 1\n")
    (tmp_path / "tcp6").write_text("header\n"
                                   f"   0: {v6_any}:0016 {v6_any}:0000 0A 0:0 0:0 0 0 0 221 1\n"
                                   f"   1: {mapped}:7530 {v6_any}:0000 0A 0:0 0:0 0 0 0 222 1\n")
    got = fit.listening([22, 30000, 30001], ((str(tmp_path / "tcp"), socket.AF_INET),
                                            (str(tmp_path / "tcp6"), socket.AF_INET6)))
    assert got == {30000: [{"address": "127.0.0.1", "inode": 111}, {"address": "127.0.0.1", "inode": 222}],
                   22: [{"address": "::", "inode": 221}]}


def test_host_side_model_directory_check(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    assert fit.model_dir(str(m)) == f"{m}: not a model directory (no config.json)"
    (m / "config.json").write_text("[1]")
    assert fit.model_dir(str(m)) == f"{m}/config.json: not a JSON object"
    (m / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert fit.model_dir(str(m)) == "ok"
    assert fit.model_dir(str(m / "config.json")) == f"{m}/config.json: not a directory"
    assert fit.model_dir(str(tmp_path / "nope")) == f"{tmp_path}/nope: no such directory"


def test_an_error_without_a_file_name_gets_the_path_it_failed_on():
    """A write's ENOSPC names no file; inside fsutil.naming it names the path, and describe() adds the free space."""
    import errno

    import pytest

    from deploy.remote.host.fsutil import describe, naming
    with pytest.raises(OSError) as err:
        with naming("/dev/full"), open("/dev/full", "wb") as fh:
            fh.write(b"x")
    assert err.value.errno == errno.ENOSPC and err.value.filename == "/dev/full"
    assert describe(err.value).startswith("OSError: [Errno 28] No space left on device: '/dev/full' (")
    assert describe(err.value).endswith(" free on the file system of /dev)")
    with pytest.raises(FileNotFoundError) as err:  # an error that names its file keeps it
        with naming("/elsewhere"):
            open("/nonexistent/x")
    assert err.value.filename == "/nonexistent/x" and describe(err.value).endswith("'/nonexistent/x'")
