"""Plan classification and every blocker, on crafted facts (pure: no hosts)."""
from __future__ import annotations

import copy

import pytest

from deploy.provision import drivers
from deploy.provision.plan import classify, classify_one, make_plan, managed, required_glibc

PATTERNS = ["torch", "triton", "sglang", "sglang-kernel", "flashinfer*", "nvidia-*", "cuda-*", "sglang-ddtree"]
TAG = "cp311-cp311-manylinux_2_28_x86_64"


def facts(host, dists, *, tags=None, abi="cp311", python="3.11.2", glibc="2.36", machine="x86_64",
          driver="580.159.04", sms=("sm_120",), torch_cuda="13.0", arch_list=("sm_75", "sm_80", "sm_90", "sm_120"),
          free=500 << 30):
    tags = tags or {n: [TAG] for n in dists}
    t = None
    if "torch" in dists:
        v = dists["torch"]
        t = {"version": v, "public": v.split("+")[0], "local": v.split("+")[1] if "+" in v else None,
             "cuda": torch_cuda, "cxx11_abi": True, "arch_list": list(arch_list) if arch_list is not None else None}
    return {"host": host, "venv": {"path": "/opt/sglang/venv", "exists": True, "python": python, "abi": abi,
                                   "distributions": dict(dists), "wheel_tags": tags},
            "os": {"glibc": glibc, "machine": machine},
            "nvidia": {"driver": driver, "cuda": "13.0", "gpus": [{"sm": s} for s in sms], "error": None}
            if driver else None,
            "torch": t, "disk": {"venv": {"free": free}}}


REF = {"torch": "2.11.0+cu130", "triton": "3.5.0", "nvidia-cublas": "13.1.1.3", "numpy": "2.4.1",
       "flashinfer-python": "0.5.0", "sglang": "0.5.4"}


def test_managed_patterns_use_canonical_names():
    d = {"Flashinfer_Python": "1", "nvidia_cublas": "1", "numpy": "1", "torch": "2", "torchvision": "0.2"}
    assert set(managed(d, PATTERNS)) == {"flashinfer-python", "nvidia-cublas", "torch"}


@pytest.mark.parametrize("ref,tgt,status", [
    ("2.11.0+cu130", "2.11.0+cu130", "sync"),
    ("2.11.0+cu130", None, "missing"),
    (None, "1.0", "extra"),
    ("2.11.0+cu130", "2.11.0+cu128", "local-tag-mismatch"),
    ("2.11.0+cu130", "2.11.0", "local-tag-mismatch"),
    ("2.11.0", "2.10.0", "other-version"),
    ("2.11.0+cu130", "2.10.0+cu130", "other-version"),
    ("1.0", "1.0.0", "sync"),               # PEP 440 equality, not string equality
    ("1.0.post1", "1.0", "other-version"),
])
def test_classify_one(ref, tgt, status):
    assert classify_one(ref, tgt) == status


def test_classify_every_status_and_unmanaged_ignored():
    tgt = {"torch": "2.11.0+cu128", "triton": "3.4.0", "nvidia-cublas": "13.1.1.3", "numpy": "1.26.0",
           "nvidia-cublas-cu12": "12.8.4.1", "sglang": "0.5.4"}
    items = {i.name: i for i in classify(REF, tgt, PATTERNS)}
    assert "numpy" not in items
    assert items["torch"].status == "local-tag-mismatch" and "ABI mismatch" in items["torch"].detail
    assert "+cu128" in items["torch"].detail and "+cu130" in items["torch"].detail
    assert items["triton"].status == "other-version" and items["triton"].action == "install"
    assert items["nvidia-cublas"].status == "sync" and items["nvidia-cublas"].action is None
    assert items["flashinfer-python"].status == "missing"
    assert items["nvidia-cublas-cu12"].status == "extra" and items["nvidia-cublas-cu12"].action == "remove"
    assert items["sglang"].status == "sync"


def test_plan_in_sync_is_empty_and_has_no_blockers():
    p = make_plan(facts("ct129", REF), facts("ct200", REF), PATTERNS)
    assert p.empty and not p.blocked and p.transfer_bytes() == 0


def test_plan_json_roundtrip_fields():
    t = dict(REF, torch="2.11.0+cu128")
    p = make_plan(facts("ct129", REF), facts("ct200", t), PATTERNS)
    j = p.to_json()
    assert j["host"] == "ct200" and j["reference"] == "ct129" and not j["empty"]
    assert [i["name"] for i in j["items"] if i["action"]] == ["torch"]


def _blockers(ref, tgt, scan=None):
    p = make_plan(ref, tgt, PATTERNS, scan)
    return {b.code: b.message for b in p.blockers}, {w.code: w.message for w in p.warnings}


TGT = dict(REF, torch="2.11.0+cu128")


def test_blocker_python_abi():
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, abi="cp312", python="3.12.3"))
    assert "python-abi" in b and "cp311" in b["python-abi"] and "cp312" in b["python-abi"]


def test_pure_python_wheels_do_not_block_on_abi():
    ref = {"sglang": "0.5.5"}
    b, _ = _blockers(facts("r", ref, tags={"sglang": ["py3-none-any"]}),
                     facts("t", {"sglang": "0.5.4"}, abi="cp312", python="3.12.3"))
    assert "python-abi" not in b


def test_blocker_glibc():
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, glibc="2.27"))
    assert "glibc" in b and ">= 2.28" in b["glibc"] and "2.27" in b["glibc"]


def test_glibc_takes_the_lowest_platform_tag():
    assert required_glibc(["cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64"]) == "2.27"
    assert required_glibc(["py3-none-manylinux2014_x86_64"]) == "2.17"
    assert required_glibc(["py3-none-manylinux1_x86_64.manylinux_2_5_x86_64"]) == "2.5"
    assert required_glibc(["py3-none-any"]) is None


def test_blocker_machine():
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, machine="aarch64"))
    assert "machine" in b


def test_blocker_driver_too_old_for_cuda13():
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, driver="570.86.15"))
    assert "driver" in b and "580.65.06" in b["driver"] and "CUDA 13" in b["driver"]


def test_driver_warning_under_minor_compat_only():
    ref = dict(REF, torch="2.11.0+cu128")
    b, w = _blockers(facts("r", ref, torch_cuda="12.8"), facts("t", dict(REF, torch="2.11.0+cu126"),
                                                                 driver="560.35.03"))
    assert "driver" not in b and "minor version compatibility" in w["driver"]


def test_blocker_no_driver():
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, driver=None))
    assert "driver" in b and "no NVIDIA driver" in b["driver"]


def test_blocker_gpu_arch():
    ref = facts("ct129", REF, arch_list=("sm_75", "sm_80", "sm_86", "sm_90"))
    b, _ = _blockers(ref, facts("ct200", TGT, sms=("sm_120",)))
    assert "gpu-arch" in b and "sm_120" in b["gpu-arch"]
    b, _ = _blockers(ref, facts("ct200", TGT, sms=("sm_89",)))  # sm_86 cubins run on sm_89
    assert "gpu-arch" not in b


def test_unknown_arch_list_is_a_warning():
    b, w = _blockers(facts("ct129", REF, arch_list=None), facts("ct200", TGT))
    assert "gpu-arch" not in b and "gpu-arch" in w


def test_blocker_disk():
    scan = {"torch": {"installed_bytes": 4 << 30, "drift": [],
                      "source": {"kind": "original", "sha256": "a" * 64, "size": 1 << 30, "filename": "torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl"}}}
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, free=2 << 30), scan)
    assert "disk" in b and "free" in b["disk"]
    b, _ = _blockers(facts("ct129", REF), facts("ct200", TGT, free=200 << 30), scan)
    assert "disk" not in b


def test_blocker_missing_venv():
    t = facts("ct200", TGT)
    t["venv"] = {"path": "/opt/sglang/venv", "exists": False}
    b, _ = _blockers(facts("ct129", REF), t)
    assert "venv" in b


def test_drift_on_reference_is_in_the_plan():
    scan = {"torch": {"installed_bytes": 10, "drift": [{"path": "torch/version.py", "problem": "modified"}],
                      "source": None}}
    p = make_plan(facts("ct129", REF), facts("ct200", TGT), PATTERNS, scan)
    assert not p.blocked
    assert any(w.code == "drift" and "torch/version.py" in w.message for w in p.warnings)
    assert p.sources["torch"]["kind"] == "rebuild" and p.sources["torch"]["drift"] == 1


def test_staged_wheel_is_not_transferred_again():
    sha = "b" * 64
    scan = {"torch": {"installed_bytes": 10, "drift": [],
                      "source": {"kind": "original", "sha256": sha, "size": 1000, "filename": "torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl"}}}
    p = make_plan(facts("ct129", REF), facts("ct200", TGT), PATTERNS, scan, {"staged": {}})
    assert p.transfer_bytes() == 1000
    p = make_plan(facts("ct129", REF), facts("ct200", TGT), PATTERNS, scan, {"staged": {sha: {}}})
    assert p.transfer_bytes() == 0 and p.sources["torch"]["staged"]


def test_render_plan_table():
    from rich.console import Console
    from deploy.provision.plan import render
    c = Console(record=True, width=200)
    render(make_plan(facts("ct129", REF), facts("ct200", TGT, driver="500.1"), PATTERNS), c)
    out = c.export_text()
    assert "local-tag-mismatch" in out and "2.11.0+cu128" in out and "BLOCKER" in out


def test_driver_table_and_cuda_tags():
    assert drivers.cuda_from_local("cu130") == "13.0" and drivers.cuda_from_local("cu128") == "12.8"
    assert drivers.cuda_from_local("cpu") is None
    assert drivers.driver_check("13.0", "580.159.04") is None
    assert drivers.driver_check("13.0", "575.57.08")[0] == "blocker"
    assert drivers.driver_check("12.8", "525.60.13")[0] == "warning"
    assert drivers.driver_check("12.8", "570.124.06") is None
    assert drivers.driver_check("14.0", "999.0")[0] == "blocker"   # unknown CUDA: refuse, do not guess
    assert drivers.arch_supported("sm_90", ["sm_90"]) and not drivers.arch_supported("sm_90", ["sm_80", "sm_86"])


def test_build_tag_from_version_py_when_metadata_lacks_it():
    """The real H200: METADATA says torch 2.11.0, torch/version.py says 2.11.0+cu130. A +cu128 target is an
    ABI mismatch against the build the reference really runs, and the item keeps pip's versions."""
    ref = facts("ct129", dict(REF, torch="2.11.0"))
    ref["torch"].update(version="2.11.0+cu130", local="cu130")
    tgt = facts("ct200", dict(REF, torch="2.11.0+cu128"))
    plan = make_plan(ref, tgt, PATTERNS)
    (item,) = [i for i in plan.items if i.name == "torch"]
    assert item.status == "local-tag-mismatch" and "+cu128 where the reference runs +cu130" in item.detail
    assert (item.reference, item.target) == ("2.11.0", "2.11.0+cu128")
    same = facts("h200", dict(REF, torch="2.11.0"))
    same["torch"].update(version="2.11.0+cu130", local="cu130")
    assert make_plan(ref, same, PATTERNS).empty


def test_a_wheel_name_that_is_not_one_blocks_the_host():
    """Issue 9: a wheel file name from the reference host (`../../../../etc/cron.d/x`) became a path on the control
    machine and, as root, on the targets. The plan refuses it before anything is fetched."""
    for bad in ("../../../../etc/cron.d/x", "../../../../etc/cron.d/x-1.0-py3-none-any.whl", "t.whl"):
        scan = {"torch": {"installed_bytes": 10, "drift": [],
                          "source": {"kind": "rebuilt", "sha256": "c" * 64, "size": 1000, "filename": bad}}}
        p = make_plan(facts("ct129", REF), facts("ct200", TGT), PATTERNS, scan, {"staged": {}})
        assert p.blocked and p.blockers[-1].code == "wheel-name" and repr(bad) in p.blockers[-1].message
        assert p.sources["torch"]["kind"] == "refused" and "filename" not in p.sources["torch"]


def test_an_untrusted_target_venv_blocks_the_host():
    tgt = facts("ct200", TGT)
    tgt["venv"]["trust"] = "/opt/sglang/venv/lib/python3.11/site-packages is writable by group"
    p = make_plan(facts("ct129", REF), tgt, PATTERNS)
    assert p.blocked and any(b.code == "venv-trust" and "writable by group" in b.message for b in p.blockers)


def test_the_confirmation_shows_each_command_and_a_ctrl_c_is_a_no():
    """The commands a target will run are argv built here, shown before the question; Ctrl-C or EOF at the
    question changes nothing (no lock was taken: provision locks only once it goes ahead)."""
    from rich.console import Console

    from deploy.inventory import Host
    from deploy.provision import overlay
    scan = {"torch": {"installed_bytes": 10, "drift": [], "pth": [],
                      "source": {"kind": "original", "sha256": "d" * 64, "size": 1000,
                                 "filename": "torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl"}}}
    p = make_plan(facts("ct129", REF), facts("ct200", TGT), PATTERNS, scan, {"staged": {}})
    host = Host("ct200", "10.0.0.2", "root", 22, (0,), vars={"venv": "/opt/sglang/venv"})
    cmds = overlay.planned_commands(host, p, "/var/lib/ddtree")
    assert cmds[0][:5] == ["/opt/sglang/venv/bin/python", "-m", "pip", "install", "--isolated"]
    assert f"/var/lib/ddtree/provision/incoming/{'d' * 64}/torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl" in cmds[0]
    pay = overlay.apply_payload(host, p, "id1")
    assert pay["commands"]["pip_install"] == cmds[0][:len(pay["commands"]["pip_install"])]
    assert pay["install"][0]["sha256"] == "d" * 64 and pay["allow_pth"] == {"torch": []}
    for exc in (KeyboardInterrupt, EOFError):
        def ask(_q, exc=exc):
            raise exc
        con = Console(record=True, width=200)
        assert overlay._confirmed(overlay.Options(confirm=ask, console=con), con, [host], {"ct200": p}) is False
        text = con.export_text()
        assert "pip install --isolated" in text and "nothing changed, no host locked" in text
