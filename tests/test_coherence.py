"""deploy/coherence.py: pip-check semantics compared with real `pip check` on real venvs, and the deploy
and native verdicts on the real captured metadata and symbols."""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.tags import sys_tags

from deploy import coherence as C
from coherence_fixtures import CLOSURE, ENV, closure_with, native_report
from deploy.lab.wheels import write_dist_info
from deploy.remote.host import dists as D

ROOT = Path(__file__).resolve().parents[1]
CAPS = C.load_capabilities()
DISTS_SOURCE = Path(D.__file__).read_text()


def collect(python: str, cwd: str = "/") -> dict:
    """Run the host-side collector with an environment's own interpreter, as the probe will."""
    out = subprocess.run([python, "-c", DISTS_SOURCE], capture_output=True, text=True, check=True, cwd=cwd)
    return json.loads(out.stdout)


def real_pip_check(python: str, cwd: str = "/") -> tuple[list[str], str]:
    p = subprocess.run([python, "-m", "pip", "check"], capture_output=True, text=True, cwd=cwd,
                       env={"PATH": "/usr/bin:/bin", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    return p.stdout.splitlines(), p.stderr


def _tags(r: dict):
    return C.supported_tags(r["python"], r["environment"]["platform_machine"], platform.libc_ver()[1])


def _use_project_pip(venv: Path) -> None:
    """Replace the venv's own pip (ensurepip's) by this project's, copied as installed (pip is pure Python)."""
    site = next(venv.glob("lib/python3*/site-packages"))
    for old in list(site.glob("pip")) + list(site.glob("pip-*.dist-info")):
        shutil.rmtree(old)
    ours = Path(__import__("pip").__file__).parent
    shutil.copytree(ours, site / "pip")
    shutil.copytree(next(ours.parent.glob("pip-*.dist-info")), site / next(ours.parent.glob("pip-*.dist-info")).name)


# ---------------------------------------------------------------- pip check, for real

def test_supported_tags_are_this_interpreters():
    mine = C.supported_tags(platform.python_version(), platform.machine(), platform.libc_ver()[1])
    assert set(mine) == set(sys_tags()) and len(mine) == len(set(mine))


def test_same_lines_as_pip_check_on_the_project_venv():
    """This venv holds SGLang 0.5.23 without its GPU stack (scripts/bootstrap): dozens of real findings."""
    py = sys.executable
    r = collect(py)
    want, _ = real_pip_check(py)
    got = C.pip_check_lines(r["distributions"], r["environment"], _tags(r), prefix=sys.prefix)
    assert got == want
    assert len(want) > 10


def _meta(name, version, requires=(), wheel=None):
    return {"name": name, "version": version, "requires_dist": list(requires), "requires_python": None,
            "wheel": wheel or f"{name.replace('-', '_')}-{version}-py3-none-any.whl"}


@pytest.fixture(scope="module", params=["ensurepip", "project-pip"])
def conflicted_venv(request, tmp_path_factory):
    """A fresh venv (real pip: the interpreter's bundled one, and this project's, which is >= 24.2 and
    so follows the newer rules) with metadata-only distributions that exercise every pip-check rule."""
    root = tmp_path_factory.mktemp("conflicted")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if request.param == "project-pip":
        _use_project_pip(venv)
    site = next(venv.glob("lib/python3*/site-packages"))
    for m in [
        _meta("torch", "2.11.0+cu130", wheel="torch-2.11.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl"),
        _meta("flashinfer-python", "0.6.15.post1", ["torch", "apache-tvm-ffi>=0.1.6,<0.2"]),
        _meta("Kappa", "1.1rc1"),
        _meta("eta-pkg", "1.0"),
        _meta("sglang-kernel", "0.4.10", ["torch==2.14.1"]),
        _meta("needs-things", "1.0", [
            "torch==2.11.0",                                  # local build +cu130 satisfies (PEP 440)
            "torch==2.11.0+cu128",                            # another local build does not
            'torch>=2.12; python_version >= "3"',              # conflict, marker true
            "flashinfer_python[cu13]==0.6.15.post1",          # extras are not checked; names normalise
            'missing-pkg>=1; sys_platform == "linux"',         # missing, marker true
            'never-pkg; sys_platform == "win32"',              # marker false: not a requirement here
            'only-with-extra>=1; extra == "test"',             # extras are not installed
            "kappa>=1.0",                                     # prereleases count as installed
            "Eta.Pkg>=2",                                     # conflict, printed canonical
            "odd>=2"]),
        _meta("sglang", "0.5.17", ["sglang-kernel==0.4.5", "torch==2.11.0", "flashinfer_python[cu13]==0.6.15.post1",
                                   "transformers==5.12.1"]),
        _meta("old-platform", "1.0", wheel="old_platform-1.0-cp27-cp27mu-linux_x86_64.whl"),
    ]:
        write_dist_info(site, m)
    # pip takes the version from the directory name, not METADATA
    odd = write_dist_info(site, _meta("odd", "2.0"))
    odd.rename(site / "odd-1.0.dist-info")
    # metadata pip cannot parse: reported, and left out of the set
    bad = write_dist_info(site, _meta("broken-reqs", "1.0", ["ok-pkg", "this is not a requirement !!"]))
    assert bad.is_dir()
    # an old setuptools develop install: egg-info with requires.txt sections
    egg = site / "legacy.egg-info"
    egg.mkdir()
    (egg / "PKG-INFO").write_text("Metadata-Version: 1.1\nName: legacy\nVersion: 0.9\n")
    (egg / "requires.txt").write_text("eta-pkg>=0.5\n\n[gpu]\nnot-here\n\n[:sys_platform == \"linux\"]\nalso-missing\n")
    return venv


def test_same_lines_as_pip_check_on_a_conflicted_venv(conflicted_venv):
    py = str(conflicted_venv / "bin" / "python")
    r = collect(py)
    want, err = real_pip_check(py)
    got = C.pip_check_lines(r["distributions"], r["environment"], _tags(r), prefix=str(conflicted_venv))
    assert got == want
    modern = C.modern_pip(r["distributions"])
    assert ("old-platform 1.0 is not supported on this platform" in want) is modern
    unmet, problems = C.pip_check(r["distributions"], r["environment"])
    by = {(u.package, u.dependency): u for u in unmet}
    assert ("needs-things", "missing-pkg") in by and by[("needs-things", "missing-pkg")].missing
    assert by[("needs-things", "eta-pkg")].installed == "1.0"
    assert (by[("needs-things", "odd")].installed == "1.0") if modern else ("needs-things", "odd") not in by
    assert {u.requirement for u in unmet if u.dependency == "torch" and u.package == "needs-things"} == {
        "torch==2.11.0+cu128", 'torch>=2.12; python_version >= "3"'}
    assert not {("needs-things", n) for n in ("never-pkg", "only-with-extra", "kappa", "flashinfer-python")} & set(by)
    assert ("legacy", "also-missing") in by and ("legacy", "not-here") not in by
    assert problems and "broken-reqs" in problems[0] and "broken-reqs" in err


def test_markers_are_the_hosts_not_ours():
    dists = [{"name": "a", "version": "1", "requires_dist": ['b; platform_machine == "aarch64"']}]
    x86 = dict(ENV, platform_machine="x86_64")
    arm = dict(ENV, platform_machine="aarch64")
    assert C.pip_check(dists, x86)[0] == []
    assert [u.pip_line() for u in C.pip_check(dists, arm)[0]] == ["a 1 requires b, which is not installed."]


def test_the_captured_closure_is_coherent_and_knows_its_pins():
    unmet, problems = C.pip_check(CLOSURE["distributions"], ENV)
    assert unmet == [] and problems == []
    v = C.coherence_verdict(CLOSURE["distributions"], ENV)
    assert v.ok and v.summary() == "pip-check: ok" and v.details["distributions"] == 211


# ---------------------------------------------------------------- deploy verdict on real metadata

def test_caps_lists_and_per_version_forms():
    assert "0.5.23" in C.supported_sglang_versions(CAPS)
    assert C.supported_sglang_versions({"sglang_versions": {"0.5.17": {}, "0.5.23": {}}}) == ("0.5.17", "0.5.23")
    assert C.supported_sglang_versions({"sglang_versions": [{"version": "0.5.17"}]}) == ("0.5.17",)
    with pytest.raises(C.CoherenceError, match="no SGLang versions"):
        C.supported_sglang_versions({"modes": []})


def test_capabilities_from_the_plugin_wheel(tmp_path):
    whl = tmp_path / "sglang_ddtree-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("sglang_ddtree/capabilities.json", json.dumps({"sglang_versions": ["0.5.17", "0.5.23"]}))
    assert C.supported_sglang_versions(C.load_capabilities(whl)) == ("0.5.17", "0.5.23")
    assert C.load_capabilities(ROOT / "overlays/sglang-ddtree") == CAPS
    with pytest.raises(C.CoherenceError, match="capabilities.json"):
        C.load_capabilities(tmp_path / "nope.json")


CAPS_BOTH = {"sglang_versions": ["0.5.17", "0.5.23"]}


def test_deploy_verdict_ok_on_the_fleets_line():
    v = C.deploy_verdict(CLOSURE["distributions"], ENV, CAPS_BOTH)
    assert v.ok and v.reasons == () and v.details["core"] == {
        "sglang": "0.5.17", "sglang-kernel": "0.4.5", "torch": "2.11.0", "flashinfer-python": "0.6.15.post1"}


def test_deploy_verdict_reads_the_capabilities_list():
    """With today's capabilities.json (0.5.23 only, until the adapter work lands) 0.5.17 is refused."""
    v = C.deploy_verdict(CLOSURE["distributions"], ENV, {"sglang_versions": ["0.5.23"]})
    assert not v.ok and v.reasons == ("SGLang 0.5.17 is not supported by the plugin (supported: 0.5.23)",)


def test_deploy_refuses_sglang_kernel_0410_by_its_pins():
    v = C.deploy_verdict(closure_with(("sglang-kernel", "0.4.10")), ENV, CAPS_BOTH)
    assert not v.ok
    assert v.reasons == ("sglang 0.5.17 requires sglang-kernel==0.4.5, found sglang-kernel 0.4.10",
                         "sglang-kernel 0.4.10 requires torch==2.14.1, found torch 2.11.0")


def test_deploy_refuses_an_unsupported_sglang():
    v = C.deploy_verdict(closure_with(("sglang", "0.5.16")), ENV, CAPS_BOTH)
    assert not v.ok
    assert v.reasons[0] == "SGLang 0.5.16 is not supported by the plugin (supported: 0.5.17, 0.5.23)"
    assert "sglang 0.5.16 requires flashinfer_python[cu13]==0.6.14, found flashinfer-python 0.6.15.post1" in v.reasons
    assert v.warnings and "helion" in " ".join(v.warnings)       # other unmet pins: shown, not refusing


def test_deploy_refuses_a_supported_sglang_whose_pins_are_unmet():
    """SGLang 0.5.23 (supported) on the fleet's torch 2.11: the case of issue 8."""
    v = C.deploy_verdict(closure_with(("sglang", "0.5.23")), ENV, CAPS_BOTH)
    assert not v.ok
    assert "sglang 0.5.23 requires torch==2.14.1, found torch 2.11.0" in v.reasons
    assert any(r.startswith("sglang 0.5.23 requires sglang-kernel==0.4.10") for r in v.reasons)
    assert not any("not supported" in r for r in v.reasons)


def test_deploy_refuses_without_sglang_or_its_kernel():
    assert C.deploy_verdict(closure_with(("sglang", None)), ENV, CAPS_BOTH).reasons == ("SGLang is not installed",)
    v = C.deploy_verdict(closure_with(("sglang-kernel", None)), ENV, CAPS_BOTH)
    assert v.reasons == ("sglang 0.5.17 requires sglang-kernel==0.4.5, which is not installed",)


def test_local_build_satisfies_the_pin_as_pep440_says():
    dists = [dict(d, version="2.11.0+cu128") if d["name"] == "torch" else d for d in CLOSURE["distributions"]]
    assert C.deploy_verdict(dists, ENV, CAPS_BOTH).ok


# ---------------------------------------------------------------- native verdict

def test_native_verdict_045_on_torch_211():
    v = C.native_verdict(native_report("0.4.5", "2.11.0+cu130", "sm_120"))
    assert v.ok and v.details["checked"] == ["sgl_kernel/sm100/common_ops.abi3.so"]


def test_native_verdict_refuses_0410_on_torch_211_and_names_the_symbol():
    v = C.native_verdict(native_report("0.4.10", "2.11.0+cu130", "sm_90"))
    assert not v.ok and len(v.reasons) == 1
    assert v.reasons[0].startswith("sgl_kernel.common_ops (sm90) (sgl_kernel/sm90/common_ops.abi3.so): 5 of its 99 torch")
    assert "_ZN3c104cuda19CUDAErrorLogCaptureC1Ev (c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture)" in v.reasons[0]


def test_native_verdict_0410_on_torch_2141():
    assert C.native_verdict(native_report("0.4.10", "2.14.1+cu130", "sm_90")).ok


def test_native_verdict_lazy_extensions_warn_and_errors_refuse():
    rep = native_report("0.4.5", "2.11.0+cu130", "sm_90")
    bad = native_report("0.4.10", "2.11.0+cu130", "sm_90")["startup"][0]
    rep["other"] = [dict(bad, path="sgl_kernel/flashmla_ops.abi3.so", role=None, variant=None)]
    v = C.native_verdict(rep)
    assert v.ok and len(v.warnings) == 1 and v.warnings[0].startswith("sgl_kernel/flashmla_ops.abi3.so")
    rep["errors"] = ["sgl_kernel: no common_ops for sm90"]
    assert C.native_verdict(rep).reasons == ("sgl_kernel: no common_ops for sm90",)
    assert C.native_verdict({"torch_lib": False}).ok


def test_host_verdicts_from_collector_documents():
    collected = {"distributions": closure_with(("sglang-kernel", "0.4.10")), "environment": ENV,
                 "paths": ["/opt/sglang/venv/lib/python3.11/site-packages"]}
    pip, deploy, native = C.host_verdicts(collected, native_report("0.4.10", "2.11.0+cu130", "sm_90"), CAPS_BOTH)
    assert (pip.check, deploy.check, native.check) == ("pip-check", "deploy", "native")
    assert not pip.ok and pip.reasons[0] == "sglang 0.5.17 has requirement sglang-kernel==0.4.5, but you have sglang-kernel 0.4.10."
    assert not deploy.ok and not native.ok
    assert [v.ok for v in C.host_verdicts(dict(collected, distributions=CLOSURE["distributions"]), None, CAPS_BOTH)] == [True, True]


def test_accept_unmet_turns_only_the_named_dependencies_into_warnings():
    """provision blocks on every pip-check reason of the reference but those whose dependency the inventory's
    accept_unmet names (fnmatch on canonical names): a version conflict and a missing one alike."""
    from dataclasses import asdict

    from deploy.coherence import Unmet
    from deploy.provision.plan import reference_findings
    unmet = [Unmet("sglang", "0.5.17", "datasets", "datasets", None),
             Unmet("sglang", "0.5.17", "numba==0.65.1", "numba", "0.68.0"),
             Unmet("flashinfer-python", "0.6.15", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl", None)]
    c = {"ok": False, "pip_check": {"details": {"unmet": [asdict(u) for u in unmet]}},
         "reasons": [f"pip check: {u.pip_line()}" for u in unmet] + ["native: x.so: undefined symbol y"]}
    blockers, warnings = reference_findings(dict(host="ref", coherence=c), ["Datasets", "nvidia_cutlass*"])
    assert [b.message for b in blockers] == [f"ref: pip check: {unmet[1].pip_line()}",
                                             "ref: native: x.so: undefined symbol y"]
    assert [w.code for w in warnings] == ["accepted-unmet", "accepted-unmet"]
    assert "datasets" in warnings[0].message and "nvidia-cutlass-dsl" in warnings[1].message
    none_accepted, _ = reference_findings(dict(host="ref", coherence=c))
    assert len(none_accepted) == 4
