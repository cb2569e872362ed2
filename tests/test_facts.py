"""Fact parsers on the real H200 captures (lab/personas/h200-1gpu = shared/fixtures/gpu-hosts/h200-1gpu)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy import facts as F
from deploy.lab import persona

CAP = Path(__file__).resolve().parents[1] / "lab" / "personas" / "h200-1gpu"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "gpu-hosts" / "h200-1gpu"


def cap(name):
    return (CAP / name).read_text()


def section(name):
    """One `## name` section of host.txt."""
    text = cap("host.txt")
    return text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]


@pytest.mark.skipif(not SHARED.exists(), reason="shared/ not beside this checkout")
def test_copied_captures_match_shared():
    for f in SHARED.iterdir():
        assert (CAP / f.name).read_bytes() == f.read_bytes(), f.name


def test_query_gpu_csv():
    (g,) = F.parse_query_gpu_csv(cap("query-gpu.csv"))
    assert g == {"index": 0, "uuid": "GPU-aeace5b3-1958-aad9-f0c5-96fb66d00e4c", "name": "NVIDIA H200",
                 "driver": "580.159.04", "compute_cap": "9.0", "sm": "sm_90", "memory_mib": 143771,
                 "pci_bus_id": "00000000:00:06.0"}


def test_nvidia_smi_banner_driver_and_cuda():
    assert F.parse_nvidia_smi_header(cap("nvidia-smi.txt")) == {"driver": "580.159.04", "cuda": "13.0"}
    assert F.parse_nvidia_smi_header("NVIDIA-SMI has failed") == {}


def test_proc_driver_nvcc_glibc_os():
    assert F.parse_proc_driver_version(section("/proc/driver/nvidia/version")) == "580.159.04"
    assert F.parse_nvcc_version(section("nvcc")) == "13.0"
    assert F.parse_glibc(section("ldd")) == "2.39"
    assert F.parse_glibc("glibc 2.36") == "2.36"
    osr = F.parse_os_release(section("os-release"))
    assert (osr["ID"], osr["VERSION_ID"], osr["PRETTY_NAME"]) == ("ubuntu", "24.04", "Ubuntu 24.04.3 LTS")


def test_torch_facts_from_capture():
    t = json.loads(cap("torch.json"))
    assert F.split_local(t["torch"]) == ("2.11.0", "cu130")
    assert F.parse_arch_flags(" ".join(t["archs"])) == ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert F.parse_arch_flags("sm_90 sm_100a compute_120") == ["sm_90", "sm_100"]
    assert F.python_abi_tag(t["python"].split()[0]) == "cp312"
    dists = F.parse_pip_list_json(cap("pip-list.json"))
    # The real capture: the distribution's metadata says plain 2.11.0 (PyPI's cu130 build) while
    # torch/version.py says 2.11.0+cu130. The build tag must come from version.py, not metadata.
    assert dists["torch"] == "2.11.0" and dists["triton"] == "3.6.0"


def test_torch_version_py_and_wheel_abi():
    vp = F.parse_torch_version_py("from typing import Optional\n__version__ = '2.11.0+cu128'\n"
                                  "cuda: Optional[str] = '12.8'\ngit_version = 'abc'\n")
    assert vp == {"__version__": "2.11.0+cu128", "cuda": "12.8", "git_version": "abc"}
    assert F.cxx11_abi_from_tags(["cp312-cp312-manylinux_2_28_x86_64"]) is True
    assert F.cxx11_abi_from_tags(["cp310-cp310-manylinux1_x86_64"]) is False
    assert F.cxx11_abi_from_tags(["py3-none-any"]) is None


def raw_from_capture() -> dict:
    """The probe's raw document as the real H200 would produce it, assembled from the captures."""
    t = json.loads(cap("torch.json"))
    version_py = f"__version__ = '{t['torch']}'\ncuda = '{t['cuda']}'\ngit_version = '{t['git']}'\n"
    dists = [{"name": d["name"], "version": d["version"],
              "wheel": "Tag: cp312-cp312-manylinux_2_28_x86_64\n" if d["name"] == "torch" else None}
             for d in json.loads(cap("pip-list.json"))]
    return {"kernel": "6.18.44-fc-v657-gpu", "machine": "x86_64", "os_release": section("os-release"),
            "ldd": [section("ldd").strip()], "glibc": "glibc 2.39", "system_python": "3.12.3",
            "nvidia_smi_query": {"rc": 0, "out": cap("query-gpu.csv"), "err": ""},
            "nvidia_smi": {"rc": 0, "out": cap("nvidia-smi.txt"), "err": ""},
            "proc_driver": section("/proc/driver/nvidia/version"), "nvcc": {"rc": 0, "out": section("nvcc")},
            "venv": {"path": "/opt/torch/.venv", "exists": True, "version": "3.12.3", "abiflags": "",
                     "purelib": t["purelib"], "distributions": dists,
                     "torch": {"version_py": version_py, "imported": {"cxx11_abi": t["cxx11abi"],
                                                                      "arch_flags": " ".join(t["archs"])}}}}


def test_build_facts_on_h200_capture():
    f = F.build_facts("h200", raw_from_capture())
    assert f["nvidia"]["driver"] == "580.159.04" and f["nvidia"]["cuda"] == "13.0"
    assert [(g["name"], g["sm"], g["memory_mib"]) for g in f["nvidia"]["gpus"]] == [("NVIDIA H200", "sm_90", 143771)]
    assert f["nvcc"] == "13.0" and f["os"]["glibc"] == "2.39" and f["os"]["id"] == "ubuntu"
    assert f["venv"]["abi"] == "cp312" and len(f["venv"]["distributions"]) == 197
    t = f["torch"]
    assert (t["version"], t["local"], t["cuda"], t["cxx11_abi"]) == ("2.11.0+cu130", "cu130", "13.0", True)
    assert "sm_90" in t["arch_list"]
    assert f["packages"]["triton"] == "3.6.0"


def test_build_facts_abi_from_wheel_tag_when_torch_not_imported():
    raw = raw_from_capture()
    raw["venv"]["torch"].pop("imported")
    t = F.build_facts("h200", raw)["torch"]
    assert t["cxx11_abi"] is True and t["cxx11_abi_source"] == "wheel-tag" and t["arch_list"] is None


def test_failed_nvidia_smi_is_reported_not_crashed():
    raw = raw_from_capture()
    raw["nvidia_smi_query"] = {"rc": 9, "out": "", "err": "NVIDIA-SMI has failed because it couldn't communicate"}
    f = F.build_facts("h200", raw)
    assert f["nvidia"]["gpus"] == [] and "couldn't communicate" in f["nvidia"]["error"]
    assert f["nvidia"]["driver"] == "580.159.04"  # still known from /proc


def test_derived_blackwell_persona_parses_like_a_capture():
    files = persona.persona_files("rtxpro6000-8gpu", "x")
    gpus = F.parse_query_gpu_csv(files["query-gpu.csv"])
    assert [g["index"] for g in gpus] == list(range(8))
    assert {g["sm"] for g in gpus} == {"sm_120"} and len({g["uuid"] for g in gpus}) == 8
    assert F.parse_nvidia_smi_header(files["nvidia-smi.txt"]) == {"driver": "580.159.04", "cuda": "13.0"}
    widths = {len(line) for line in files["nvidia-smi.txt"].splitlines() if line.startswith(("|", "+"))}
    assert widths == {len(cap("nvidia-smi.txt").splitlines()[1])}
    assert "DERIVED" in files["DERIVED.txt"]
    topo = F.parse_topo_matrix(files["topo.txt"])  # laid out as a capture's: every pair of the eight, PCIe-bridged
    assert sorted(topo["links"]) == [f"GPU{i}" for i in range(8)]
    assert {v for row in topo["links"].values() for v in row.values()} == {"NODE"}


def test_derived_h200_nvswitch_persona_parses_like_the_nvswitch_capture():
    """The lab's TP host: its topo matrix reads as the real NVSwitch capture's GPU links (NV18 between every pair)."""
    topo = F.parse_topo_matrix(persona.persona_files("h200-8gpu", "x")["topo.txt"])
    nvswitch = F.parse_topo_matrix((Path(__file__).resolve().parent / "captures" / "topo-8gpu-nvswitch.txt")
                                   .read_text())
    assert topo["links"] == nvswitch["links"] and len(topo["links"]) == 8
    assert topo["numa"] == {f"GPU{i}": str(i // 4) for i in range(8)}


def test_probe_runs_locally_and_builds_facts(tmp_path):
    """The real probe op, run here through the loader and zipapp as it runs on a host (request on stdin)."""
    import sys
    from agenthelpers import result
    venv = str(Path(sys.executable).parents[1])
    raw = result("facts.probe", {"venv": venv, "budget": 20, "import_torch": False}, tmp_path / "state",
                 env={"PATH": "/usr/bin:/bin"})
    f = F.build_facts("local", raw)
    assert f["venv"]["exists"] and "fabric" in f["venv"]["distributions"]
    assert f["venv"]["python"] == sys.version.split()[0] and f["venv"]["abi"] == "cp311"
    assert f["os"]["glibc"] and f["incomplete"] == []


def test_pyvenv_cfg_gives_the_venv_python():
    assert F.parse_pyvenv_cfg("home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11.2\n",
                              "python3.11") == {"version": "3.11.2", "abiflags": ""}
    assert F.parse_pyvenv_cfg("home = /x\nversion_info = 3.12.3.final.0\n", "python3.12") == \
        {"version": "3.12.3", "abiflags": ""}
    assert F.parse_pyvenv_cfg(None, "python3.13t") == {"version": "3.13", "abiflags": "t"}
    f = F.build_facts("x", {"venv": {"path": "/v", "exists": True, "pyvenv_cfg": "version = 3.12.1\n",
                                     "lib_dir": "python3.12", "distributions": []}})
    assert f["venv"]["python"] == "3.12.1" and f["venv"]["abi"] == "cp312"


def test_incomplete_facts_are_carried_and_summarised():
    raw = {"nvidia_smi_query": {"rc": -1, "out": "", "err": "timed out after 10s (process group killed)"},
           "incomplete": [{"what": "nvidia_smi_query", "error": "timed out after 10s (process group killed)"}]}
    f = F.build_facts("h200", raw)
    assert f["incomplete"] and F.incomplete_summary(f) == "nvidia_smi_query: timed out after 10s (process group killed)"
    assert F.incomplete_summary(F.build_facts("ok", {})) is None


def test_real_probe_output_from_the_h200():
    """tests/captures/h200-probe-raw.json: deploy/probe_remote.py's own output on the lent H200
    (second run, torch facts from the probe's on-host cache)."""
    raw = json.loads((Path(__file__).parent / "captures" / "h200-probe-raw.json").read_text())
    f = F.build_facts("h200", raw)
    assert (f["nvidia"]["driver"], f["nvidia"]["cuda"]) == ("580.159.04", "13.0")
    assert [(g["name"], g["sm"]) for g in f["nvidia"]["gpus"]] == [("NVIDIA H200", "sm_90")]
    t = f["torch"]
    assert (t["version"], t["local"], t["cuda"], t["cxx11_abi"]) == ("2.11.0+cu130", "cu130", "13.0", True)
    assert t["arch_list"] == ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    assert f["venv"]["abi"] == "cp312" and f["os"]["glibc"] == "2.39" and f["nvcc"] == "13.0"
    assert f["venv"]["distributions"]["torch"] == "2.11.0"  # metadata lacks the tag; version.py has it


def test_cached_facts_dated_in_the_future_or_undated_are_stale():
    """Issue 26: facts dated two days ahead were shown as fresh (age < 0 <= ttl). Only 0 <= age <= ttl is fresh."""
    from datetime import datetime, timezone

    from deploy.facts import is_fresh
    now = 1_800_000_000.0

    def at(seconds):
        return {"gathered_at": datetime.fromtimestamp(now + seconds, timezone.utc).isoformat(timespec="seconds")}
    assert is_fresh(at(-10), 600, now) and is_fresh(at(0), 600, now)
    assert not is_fresh(at(-601), 600, now)
    assert not is_fresh(at(2 * 86400), 600, now) and not is_fresh(at(1), 600, now)
    assert not is_fresh({}, 600, now) and not is_fresh({"gathered_at": "yesterday"}, 600, now)
    assert not is_fresh({"gathered_at": "2027-01-15T12:00:00"}, 10 ** 9, now)  # no zone: not what gather writes
