"""deploy/remote/host/elfsyms.py: the ELF reader against binutils on real shared objects, the torch
symbol rule, and the resolution verdicts on the real captured symbols of sglang-kernel 0.4.5/0.4.10 and
torch 2.11.0/2.14.1 (tests/captures/sgl-kernel-torch-abi.json; CAPTURES.md says how it was made)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import torch
from deploy.lab import elfstandin
from deploy.remote.host import elfsyms as E

CAPTURES = Path(__file__).parent / "captures"
ABI = json.loads((CAPTURES / "sgl-kernel-torch-abi.json").read_text())
TORCH_LIB = Path(torch.__file__).parent / "lib"
KERNELS = ("0.4.5", "0.4.10")
TORCHES = ("2.11.0+cu130", "2.14.1+cu130")


def _binutils(*argv) -> str:
    assert shutil.which(argv[0]), f"{argv[0]} is needed (scripts/bootstrap installs binutils)"
    return subprocess.run(list(argv), capture_output=True, text=True, check=True).stdout


# ---------------------------------------------------------------- the reader vs binutils, real files

@pytest.mark.parametrize("lib", ["libc10.so", "libtorch_cpu.so", "libtorch_python.so", "libshm.so"])
def test_reader_matches_readelf_and_nm_on_real_torch(lib):
    path = str(TORCH_LIB / lib)
    info = E.read_elf(path)
    dyn = _binutils("readelf", "-dW", path)
    assert info["needed"] == re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn)
    assert info["soname"] == (re.findall(r"\(SONAME\)\s+Library soname: \[(.+?)\]", dyn) or [None])[0]
    quick = E.read_elf(path, symbols=False)                # what the extension scan reads
    assert quick["needed"] == info["needed"] and quick["undefined"] == quick["defined"] == []
    # nm -D prints NAME@VERSION for a versioned undefined symbol and NAME@@VERSION for a default definition
    undef = set()
    for line in _binutils("nm", "-D", "--undefined-only", path).splitlines():
        kind, name = line.split()[-2:]
        undef.add(name)
    mine = {n + (f"@{v}" if v else "") for n, v, weak in info["undefined"]}
    assert mine == undef
    # exports: global (upper-case letter) or unique ('u') bindings; a hidden non-default version (NAME@V) is none
    defined = set()
    for line in _binutils("nm", "-D", "--defined-only", path).splitlines():
        parts = line.split()
        if len(parts) == 3 and (parts[1].isupper() or parts[1] == "u"):
            name, sep, ver = parts[2].partition("@@")
            if "@" not in name:
                defined.add((name, ver or None))
    assert {(n, v) for n, v in info["defined"]} == defined and len(defined) > 20


def test_reader_reads_symbol_versions_of_a_system_library():
    """libstdc++ has GLIBCXX_* version definitions; an extension asks for them by version."""
    ext = next(TORCH_LIB.glob("libtorch_python.so"))
    info = E.read_elf(str(ext))
    versions = {v for _, v, _ in info["undefined"] if v}
    assert any(v.startswith("GLIBCXX_") for v in versions) and any(v.startswith("GLIBC_") for v in versions)


def test_not_elf_and_truncated(tmp_path):
    p = tmp_path / "x.so"
    p.write_bytes(b"#!/bin/sh\n" * 10)
    with pytest.raises(E.ElfError, match="not an ELF"):
        E.read_elf(str(p))
    real = (TORCH_LIB / "libc10.so").read_bytes()
    p.write_bytes(real[:4096])
    with pytest.raises(E.ElfError):
        E.read_elf(str(p))


# ---------------------------------------------------------------- which symbols are torch's

@pytest.mark.parametrize("sym,ns,torchs", [
    ("_ZN3c104cuda19CUDAErrorLogCaptureC1Ev", "c10", True),
    ("_ZNK2at10TensorBase8data_ptrIdEEPT_v", "at", True),
    ("_ZNR5torch7Library4_defEON3c1014FunctionSchemaEPNS1_12OperatorNameE", "torch", True),
    ("_ZTVN3c1011StorageImplE", "c10", True),                      # vtable
    ("_ZTIN5torch8autograd4NodeE", "torch", True),                 # typeinfo
    ("_ZThn8_N3c1015VariableVersion14VersionCounterD1Ev", "c10", True),  # thunk
    ("_ZN6caffe28TypeMeta21_typeMetaDataInstanceIfEEPKNS_6detail12TypeMetaDataEv", "caffe2", True),
    ("_ZN4c10d12ProcessGroupD2Ev", "c10d", True),
    ("_Z16THPVariable_WrapRKN2at10TensorBaseE", "", True),        # libtorch_python, global scope
    ("THPGeneratorClass", None, True),                             # libtorch_python's global object
    ("aoti_torch_cpu_addmv", None, True),                          # stable C ABI shim
    ("_ZNSt6vectorIN3c106IValueESaIS1_EED1Ev", "std", False),      # std template over a torch type
    ("_ZNKSt5ctypeIcE8do_widenEc@GLIBCXX_3.4", "std", False),
    ("_ZTVN10__cxxabiv117__class_type_infoE", "__cxxabiv1", False),
    ("_ZN6fbgemm4someEv", "fbgemm", False),                        # bundled third party, no torch API
    ("_Znwm", None, False), ("cudaMalloc", None, False), ("PyModule_Create2", None, False),
    ("_Z3foov", "", False),
])
def test_torch_symbol_rule(sym, ns, torchs):
    assert E.torch_namespace(sym) == ns
    assert E.is_torch_symbol(sym) is torchs


def test_torch_namespaces_are_those_real_torch_exports():
    """Every namespace of the rule is an outermost scope that real torch's own libraries export."""
    path = TORCH_LIB / "libtorch_cpu.so"
    scopes = {E.torch_namespace(n) for n, _ in E.read_elf(str(path))["defined"]}
    scopes |= {E.torch_namespace(n) for n, _ in E.read_elf(str(TORCH_LIB / "libc10.so"))["defined"]}
    assert E.TORCH_NAMESPACES <= scopes


def test_qualified_names():
    assert E.qualified_name("_ZN3c104cuda19CUDAErrorLogCaptureC1Ev") == "c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture"
    assert E.qualified_name("_ZTVN3c1011StorageImplE") == "vtable for c10::StorageImpl"
    assert E.qualified_name("_ZN3c1010TensorImplD2Ev") == "c10::TensorImpl::~TensorImpl"
    assert E.qualified_name("THPGeneratorClass") == "THPGeneratorClass"


# ---------------------------------------------------------------- verdicts on the real captures

def _libs(torch_version: str) -> dict:
    libs = ABI["torch"][torch_version]["libraries"]
    return {n: {"soname": l["soname"], "needed": l["needed"], "defined": [[s, None] for s in l["exports"]]}
            for n, l in libs.items()}


def _ext(kernel: str, variant: str) -> dict:
    v = ABI["sglang_kernel"][kernel][variant]
    return {"needed": v["needed"], "undefined": [[s, None, False] for s in v["torch_undefined"]]}


@pytest.mark.parametrize("variant", ["sm90", "sm100"])
def test_sglang_kernel_045_resolves_on_torch_211(variant):
    r = E.unresolved(_ext("0.4.5", variant), _libs("2.11.0+cu130"), ("libtorch_global_deps.so",))
    assert r["unresolved"] == [] and r["missing_libraries"] == [] and r["torch_undefined"] > 100
    assert r["scope"][:3] == ["libtorch_global_deps.so", "libtorch.so", "libc10.so"]


@pytest.mark.parametrize("variant", ["sm90", "sm100"])
def test_sglang_kernel_0410_does_not_resolve_on_torch_211(variant):
    r = E.unresolved(_ext("0.4.10", variant), _libs("2.11.0+cu130"), ("libtorch_global_deps.so",))
    by_symbol = {u["symbol"]: u["name"] for u in r["unresolved"]}
    assert by_symbol["_ZN3c104cuda19CUDAErrorLogCaptureC1Ev"] == "c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture"
    assert "c10::cuda::c10_cuda_check_implementation" in by_symbol.values()
    assert len(by_symbol) == 5


@pytest.mark.parametrize("variant", ["sm90", "sm100"])
def test_sglang_kernel_0410_resolves_on_torch_2141_and_045_does_not(variant):
    assert E.unresolved(_ext("0.4.10", variant), _libs("2.14.1+cu130"))["unresolved"] == []
    bad = E.unresolved(_ext("0.4.5", variant), _libs("2.14.1+cu130"))["unresolved"]
    assert "at::cuda::getCurrentCUDABlasHandle" in {u["name"] for u in bad}


def test_a_missing_torch_library_is_reported():
    libs = _libs("2.11.0+cu130")
    del libs["libtorch_cuda.so"]                      # a CPU build of torch has no libtorch_cuda
    r = E.unresolved(_ext("0.4.5", "sm90"), libs)
    assert "libtorch_cuda.so" in r["missing_libraries"]
    assert r["unresolved"]                             # and what only libtorch_cuda exports is unresolved


def test_versioned_requirement_needs_that_version():
    libs = {"liba.so": {"needed": [], "defined": [["_ZN3c103fooEv", "V2"]]}}
    ext = {"needed": ["liba.so"], "undefined": [["_ZN3c103fooEv", "V1", False], ["_ZN3c103barEv", None, True]]}
    r = E.unresolved(ext, libs)
    assert [u["symbol"] for u in r["unresolved"]] == ["_ZN3c103fooEv"]   # weak bar is never an error
    ext["undefined"][0][1] = "V2"
    assert E.unresolved(ext, libs)["unresolved"] == []


# ---------------------------------------------------------------- the real dynamic linker agrees

@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """ELF stand-ins built from the captures (what the lab ships): torch/lib per torch, common_ops per kernel."""
    root = tmp_path_factory.mktemp("standins")
    for tv in TORCHES:
        elfstandin.build_torch_lib(root / tv / "torch" / "lib", ABI["torch"][tv], tv)
    for kv in KERNELS:
        for variant in ("sm90", "sm100"):
            elfstandin.build_common_ops(root / kv / "sgl_kernel" / variant / "common_ops.abi3.so",
                                        ABI["sglang_kernel"][kv][variant], root / TORCHES[0] / "torch" / "lib", kv, variant)
    return root


def test_standins_carry_exactly_the_captured_symbols(standins):
    for tv in TORCHES:
        for name, lib in ABI["torch"][tv]["libraries"].items():
            info = E.read_elf(str(standins / tv / "torch" / "lib" / name))
            assert sorted(n for n, _ in info["defined"]) == lib["exports"] and info["soname"] == lib["soname"]
            assert info["needed"] == lib["needed"]
    for kv in KERNELS:
        info = E.read_elf(str(standins / kv / "sgl_kernel" / "sm90" / "common_ops.abi3.so"))
        assert sorted(n for n, _, _ in info["undefined"]) == ABI["sglang_kernel"][kv]["sm90"]["torch_undefined"]


LOAD = elfstandin.DLOPEN_CHECK


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("torch_version", TORCHES)
def test_dynamic_linker_agrees_with_the_check(standins, kernel, torch_version):
    lib = standins / torch_version / "torch" / "lib"
    ext = standins / kernel / "sgl_kernel" / "sm90" / "common_ops.abi3.so"
    verdict = E.check_extension(str(ext), str(lib))
    out = subprocess.run([sys.executable, "-c", LOAD, str(lib), str(ext)], capture_output=True, text=True,
                         check=True).stdout.strip()
    if verdict["ok"]:
        assert out == "LOADED"
    else:
        m = re.search(r"undefined symbol: (\S+)", out)
        assert m and m.group(1) in {u["symbol"] for u in verdict["unresolved"]}, out
    assert verdict["ok"] == ((kernel, torch_version) in {("0.4.5", "2.11.0+cu130"), ("0.4.10", "2.14.1+cu130")})


# ---------------------------------------------------------------- host-side collection

def test_common_ops_variant_follows_sgl_kernel_load_utils(tmp_path):
    pkg = tmp_path / "sgl_kernel"
    for v in ("sm90", "sm100"):
        (pkg / v).mkdir(parents=True)
        (pkg / v / "common_ops.abi3.so").write_bytes(b"")
    assert E.sgl_kernel_common_ops(str(pkg), "sm_90") == ("sm90", str(pkg / "sm90" / "common_ops.abi3.so"))
    assert E.sgl_kernel_common_ops(str(pkg), "sm_120")[0] == "sm100"       # Blackwell RTX PRO 6000
    assert E.sgl_kernel_common_ops(str(pkg), "sm_100")[0] == "sm100"
    assert E.sgl_kernel_common_ops(str(pkg), None)[0] == "sm100"           # no GPU: precise-math build
    shutil.rmtree(pkg / "sm100")
    (pkg / "common_ops.abi3.so").write_bytes(b"")                          # older single-variant layout
    assert E.sgl_kernel_common_ops(str(pkg), "sm_120") == ("sm100", str(pkg / "common_ops.abi3.so"))
    os.remove(pkg / "common_ops.abi3.so")
    assert E.sgl_kernel_common_ops(str(pkg), "sm_120") == ("sm100", None)


def _site(standins, root: Path, kernel: str, torch_version: str) -> Path:
    site = root / f"site-{kernel}-{torch_version}"
    shutil.copytree(standins / torch_version / "torch", site / "torch")
    shutil.copytree(standins / kernel / "sgl_kernel", site / "sgl_kernel")
    (site / "other").mkdir()
    shutil.copyfile(standins / "0.4.10" / "sgl_kernel" / "sm100" / "common_ops.abi3.so", site / "other" / "_ext.so")
    (site / "other" / "plain.so").write_bytes(b"not elf at all")
    return site


def test_check_site_startup_and_other_extensions(standins, tmp_path):
    site = _site(standins, tmp_path, "0.4.5", "2.11.0+cu130")
    rep = json.loads(subprocess.run([sys.executable, "-c", Path(E.__file__).read_text(), str(site), "sm_90"],
                                    capture_output=True, text=True, check=True).stdout)
    (start,) = rep["startup"]
    assert start["role"] == "sgl_kernel.common_ops" and start["variant"] == "sm90" and start["ok"]
    assert start["path"] == "sgl_kernel/sm90/common_ops.abi3.so"
    other = {r["path"]: r for r in rep["other"]}
    assert set(other) == {"other/_ext.so", "sgl_kernel/sm100/common_ops.abi3.so"}
    assert not other["other/_ext.so"]["ok"] and other["sgl_kernel/sm100/common_ops.abi3.so"]["ok"]
    assert "libtorch_cpu.so" in rep["torch_libraries"] and rep["errors"] == []


def test_check_site_without_torch_or_common_ops(standins, tmp_path):
    assert E.check_site(str(tmp_path))["torch_lib"] is False
    site = _site(standins, tmp_path, "0.4.10", "2.11.0+cu130")
    shutil.rmtree(site / "sgl_kernel" / "sm90")
    rep = E.check_site(str(site), "sm_90", all_linked=False)
    assert rep["startup"] == [] and rep["errors"] == ["sgl_kernel: no common_ops for sm90"]


def test_per_torch_addons_only_for_the_installed_torch(standins, tmp_path):
    """torch_c_dlpack_ext ships one add-on per torch release; tvm_ffi loads the running torch's only."""
    site = _site(standins, tmp_path, "0.4.5", "2.11.0+cu130")
    (site / "torch" / "version.py").write_text("__version__ = '2.11.0+cu130'\n")
    addons = site / "torch_c_dlpack_ext"
    addons.mkdir()
    for v in ("211", "25"):
        shutil.copyfile(site / "other" / "_ext.so", addons / f"libtorch_c_dlpack_addon_torch{v}-cuda.so")
    paths = {r["path"] for r in E.check_site(str(site), "sm_90")["other"]}
    assert "torch_c_dlpack_ext/libtorch_c_dlpack_addon_torch211-cuda.so" in paths
    assert "torch_c_dlpack_ext/libtorch_c_dlpack_addon_torch25-cuda.so" not in paths
