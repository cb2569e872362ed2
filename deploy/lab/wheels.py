"""The lab's managed venv content: small lab wheels, and the real metadata of the SGLang line the fleet runs.

Lab wheels (torch 2.11.0+cu130/+cu128, triton 3.6.0, sglang-kernel 0.4.5 and 0.4.10) are built with the
standard wheel tooling (setuptools via pip). They carry real dist-info metadata (METADATA, WHEEL with the
real wheels' tags, RECORD with hashes) and a `torch/version.py` laid out like PyTorch's, so facts, plans
and overlays treat them exactly as the real several-GB wheels. Their packages are LAB STAND-INS:
- torch answers only the two questions the probe asks of an imported torch (C++11 ABI flag, CUDA arch
  flags), and its torch/lib holds ELF stand-ins (deploy/lab/elfstandin.py) exporting the captured
  symbols of real torch 2.11.0's libraries;
- sgl_kernel holds sm90/ and sm100/ common_ops ELF stand-ins importing the captured torch symbols of the
  real sglang-kernel's common_ops; its METADATA is the real one (0.4.10's requires torch==2.14.1).

Every other distribution of the real SGLang 0.5.17 closure (tests/captures/sglang-0.5.17-closure.json.gz,
made with `pip install --dry-run --report`) is installed metadata-only (`write_dist_info`): its real
METADATA fields (name, version, Requires-Dist, Requires-Python, Provides-Extra), a WHEEL with the real
wheel's tags, INSTALLER and a valid RECORD, and no code. So `pip check` and the coherence checks run on
the real pins of the line the fleet runs.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from . import elfstandin

# Arch lists of PyTorch's official Linux builds (cu130 as captured on the H200; cu128 as published).
ARCHS = {"cu130": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "cu128": "sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"}
CUDA = {"cu130": "13.0", "cu128": "12.8"}
TORCH_VERSION = "2.11.0"
TRITON_VERSION = "3.6.0"
PY_TAG = "cp311"  # Debian bookworm's python3
PLAT = "manylinux_2_28_x86_64"
ROOT = Path(__file__).resolve().parents[2]
CLOSURE_CAPTURE = ROOT / "tests" / "captures" / "sglang-0.5.17-closure.json.gz"
# The torch capture whose exports the lab's torch/lib stand-ins define (cu128 builds: DERIVED, the same
# exports assumed; PyTorch's cu128 wheels are not on the package registry this lab may use).
TORCH_ABI = "2.11.0+cu130"
KERNEL_VERSIONS = ("0.4.5", "0.4.10")
# Built as lab wheels, not written metadata-only.
LAB_BUILT = frozenset({"torch", "triton", "sglang-kernel"})

TORCH_INIT = '''"""LAB STAND-IN for PyTorch {version}: metadata and torch/lib ELF stand-ins, no tensors.

Built by ddtree-deploy's lab (deploy/lab/wheels.py) so lab hosts carry a torch distribution whose
version tag, CUDA version, C++11 ABI and arch list match their GPU persona. torch/lib's shared objects
export only the captured symbols of real torch 2.11.0's libraries that sgl_kernel needs (elfstandin.py).
"""
from .version import __version__, cuda as _cuda_version


class _C:
    _GLIBCXX_USE_CXX11_ABI = True

    @staticmethod
    def _cuda_getArchFlags():
        return {archs!r}


class version:
    from .version import __version__, cuda, git_version


class cuda:
    @staticmethod
    def is_available():
        return False

    @staticmethod
    def get_arch_list():
        return []
'''

VERSION_PY = '''from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '{version}'
debug = False
cuda: Optional[str] = '{cuda}'
git_version = '70d99e998b4955e0049d13a98d77ae1b14db1f45'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
'''


def _build(src: Path, out: Path, name: str, version: str, files: dict[str, str], *, pkg: str | None = None,
           requires: list[str] = (), requires_python: str = ">=3.8", data: dict[str, Path] | None = None,
           limited_api: str | None = None, plat: str = PLAT) -> Path:
    for rel, text in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for rel, path in (data or {}).items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, p)
    pkg = pkg or name.replace("-", "_")
    globs = sorted({str(Path(rel).relative_to(pkg).parent / "*.so") for rel in (data or {})})
    (src / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools>=61", "wheel"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n'
        f'description = "ddtree-deploy lab stand-in of {name} {version} (no real code)"\n'
        f'requires-python = "{requires_python}"\ndependencies = {json.dumps(list(requires))}\n\n'
        f'[tool.setuptools]\npackages = ["{pkg}"]\n'
        + (f'\n[tool.setuptools.package-data]\n{pkg} = {json.dumps(globs)}\n' if globs else ""))
    # A platform-tagged wheel, as PyTorch ships: the tag is what tells the C++ ABI and glibc floor.
    tag = f"py_limited_api = {limited_api}\n" if limited_api else f"python_tag = {PY_TAG}\n"
    (src / "setup.cfg").write_text(f"[bdist_wheel]\n{tag}plat_name = {plat}\n")
    if limited_api:
        # bdist_wheel gives a pure wheel abi 'none'; a binary distribution gets the real cpXY-abi3 tag.
        (src / "setup.py").write_text(
            "from setuptools import setup\nfrom setuptools.dist import Distribution\n\n\n"
            "class BinaryDistribution(Distribution):\n    def has_ext_modules(self):\n        return True\n\n\n"
            "setup(distclass=BinaryDistribution)\n")
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", "-w", str(out), str(src)], capture_output=True, text=True)
    if p.returncode != 0:  # setuptools' warnings about data folders are noise; a failure is not
        raise RuntimeError(f"pip wheel {name} {version} failed: {(p.stdout + p.stderr)[-1500:]}")
    stem = canonicalize_name(name).replace("-", "_")
    found = sorted(out.glob(f"{stem}-{version.replace('+', '*')}-*.whl"))
    if not found:
        raise RuntimeError(f"pip wheel built no {name} {version} wheel in {out}")
    return found[-1]


SGL_KERNEL_INIT = '''"""LAB STAND-IN for sglang-kernel {version}: the real wheel's metadata, ELF stand-ins of its common_ops.

sm90/ and sm100/common_ops.abi3.so import exactly the torch symbols the real wheel's common_ops imports
(tests/captures/sgl-kernel-torch-abi.json) and contain no kernels. Importing this package loads nothing.
"""
from .version import __version__
'''


def load_closure(path: Path = CLOSURE_CAPTURE) -> dict:
    """The captured SGLang 0.5.17 closure: {"distributions": [...], "alternates": [...], "environment": ...}."""
    return json.loads(gzip.decompress(Path(path).read_bytes()))


def find_meta(closure: dict, name: str, version: str | None = None) -> dict:
    """One captured distribution (from the closure or its alternates) by name and optional version."""
    key = canonicalize_name(name)
    for d in closure["distributions"] + closure["alternates"]:
        if canonicalize_name(d["name"]) == key and (version is None or d["version"] == version):
            return d
    raise KeyError(f"{name} {version or ''} is not in the capture")


def _content_key() -> str:
    h = hashlib.sha256()
    for p in (Path(__file__), Path(elfstandin.__file__), CLOSURE_CAPTURE, elfstandin.ABI_CAPTURE):
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def dist_info_dirname(name: str, version: str) -> str:
    """The .dist-info directory an installer writes for name/version (wheel spec escaping)."""
    return f"{canonicalize_name(name).replace('-', '_')}-{version}.dist-info"


def dist_info_files(meta: dict, installer: str = "ddtree-lab") -> dict[str, bytes]:
    """A metadata-only distribution: relative path -> bytes of METADATA, WHEEL, INSTALLER and RECORD.

    METADATA holds the captured fields only (LAB STAND-IN in its Summary); WHEEL the tags of the real
    wheel file the metadata came from; RECORD the sha256 and size of each file (itself unhashed)."""
    name, version = meta["name"], meta["version"]
    if not re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", name) or not re.match(r"^[A-Za-z0-9.+!_-]+$", version):
        raise ValueError(f"unsafe distribution name/version: {name!r} {version!r}")
    di = dist_info_dirname(name, version)
    lines = [f"Metadata-Version: {meta.get('metadata_version') or '2.1'}", f"Name: {name}", f"Version: {version}",
             f"Summary: LAB STAND-IN: the real metadata of {name} {version}, no code (ddtree-deploy lab)"]
    if meta.get("requires_python"):
        lines.append(f"Requires-Python: {meta['requires_python']}")
    lines += [f"Provides-Extra: {e}" for e in meta.get("provides_extra") or []]
    lines += [f"Requires-Dist: {r}" for r in meta.get("requires_dist") or []]
    files = {f"{di}/METADATA": ("\n".join(lines) + "\n\n").encode()}
    _, _, _, tags = parse_wheel_filename(meta["wheel"])
    purelib = all(t.abi == "none" and t.platform == "any" for t in tags)
    files[f"{di}/WHEEL"] = ("Wheel-Version: 1.0\nGenerator: ddtree-lab\n"
                            f"Root-Is-Purelib: {'true' if purelib else 'false'}\n"
                            + "".join(f"Tag: {t}\n" for t in sorted(str(t) for t in tags))).encode()
    files[f"{di}/INSTALLER"] = f"{installer}\n".encode()
    record = "".join(f"{rel},{_record_hash(data)},{len(data)}\n" for rel, data in files.items())
    files[f"{di}/RECORD"] = (record + f"{di}/RECORD,,\n").encode()
    return files


def write_dist_info(site: Path, meta: dict, installer: str = "ddtree-lab") -> Path:
    """Install one metadata-only distribution into `site` (a site-packages); returns its .dist-info."""
    site = Path(site)
    for rel, data in dist_info_files(meta, installer).items():
        p = site / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return site / dist_info_dirname(meta["name"], meta["version"])


def metadata_only(closure: dict, present: set[str]) -> list[dict]:
    """The closure's distributions the lab installs metadata-only: all but the lab-built ones and those
    the venv already has (pip, setuptools: their real code stays)."""
    return [d for d in closure["distributions"]
            if canonicalize_name(d["name"]) not in LAB_BUILT and canonicalize_name(d["name"]) not in present]


def _sglang_kernel(out: Path, version: str, closure: dict, abi: dict, torch_lib: Path) -> Path:
    meta = find_meta(closure, "sglang-kernel", version)
    _, _, _, tags = parse_wheel_filename(meta["wheel"])
    tag = sorted(tags, key=str)[0]  # cp310-abi3-manylinux2014_x86_64
    with tempfile.TemporaryDirectory() as tmp:
        so = {}
        for variant, entry in abi["sglang_kernel"][version].items():
            path = Path(tmp) / "so" / variant / "common_ops.abi3.so"
            elfstandin.build_common_ops(path, entry, torch_lib, version, variant)
            so[f"sgl_kernel/{variant}/common_ops.abi3.so"] = path
        return _build(Path(tmp) / "src", out, "sglang-kernel", version, {
            "sgl_kernel/__init__.py": SGL_KERNEL_INIT.format(version=version),
            "sgl_kernel/version.py": f'__version__ = "{version}"\n'}, pkg="sgl_kernel",
            requires=meta["requires_dist"], requires_python=meta["requires_python"] or ">=3.8", data=so,
            limited_api=tag.interpreter, plat=tag.platform)


def build_lab_wheels(out: Path) -> dict[str, Path]:
    """Build (once per content: the lab code and the captures) the lab wheels into out/<key>:
    torch-cu130, torch-cu128, triton, sglang-kernel-0.4.5, sglang-kernel-0.4.10; and "closure", a folder
    of the closure's metadata-only .dist-info directories (all but the lab-built ones) to copy into venvs."""
    out = Path(out) / _content_key()
    done = out / ".complete"
    names = ["torch-cu130", "torch-cu128", "triton"] + [f"sglang-kernel-{v}" for v in KERNEL_VERSIONS]
    if done.exists():
        built = json.loads(done.read_text())
        if all((out / built.get(n, "-")).exists() for n in names + ["closure"]):
            return {n: out / built[n] for n in names + ["closure"]}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    abi = elfstandin.load_abi_capture()
    closure = load_closure()
    wheels: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch_lib = Path(tmp) / "torch-lib"
        libs = elfstandin.build_torch_lib(torch_lib, abi["torch"][TORCH_ABI], TORCH_ABI)
        for tag in ("cu130", "cu128"):
            version = f"{TORCH_VERSION}+{tag}"
            with tempfile.TemporaryDirectory() as src:
                wheels[f"torch-{tag}"] = _build(Path(src), out, "torch", version, {
                    "torch/__init__.py": TORCH_INIT.format(version=version, archs=ARCHS[tag]),
                    "torch/version.py": VERSION_PY.format(version=version, cuda=CUDA[tag]),
                }, data={f"torch/lib/{n}": p for n, p in libs.items()})
        with tempfile.TemporaryDirectory() as src:
            wheels["triton"] = _build(Path(src), out, "triton", TRITON_VERSION, {
                "triton/__init__.py": f'"""LAB STAND-IN for triton {TRITON_VERSION}: metadata only."""\n'
                                      f'__version__ = "{TRITON_VERSION}"\n'})
        for v in KERNEL_VERSIONS:
            wheels[f"sglang-kernel-{v}"] = _sglang_kernel(out, v, closure, abi, torch_lib)
    for meta in metadata_only(closure, set()):
        write_dist_info(out / "closure", meta)
    wheels["closure"] = out / "closure"
    done.write_text(json.dumps({n: p.name for n, p in wheels.items()}))
    return wheels
