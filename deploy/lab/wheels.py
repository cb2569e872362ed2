"""Small lab wheels of torch and triton, built with the standard wheel tooling (setuptools via pip).

They carry real dist-info metadata (METADATA, WHEEL with a manylinux_2_28 tag, RECORD with hashes)
and a `torch/version.py` laid out like PyTorch's, so facts, plans and overlays treat them exactly as
the real several-GB wheels. The torch package itself is a LAB STAND-IN: it answers only the two
questions the probe asks of an imported torch (the C++11 ABI flag and the CUDA arch flags).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

# Arch lists of PyTorch's official Linux builds (cu130 as captured on the H200; cu128 as published).
ARCHS = {"cu130": "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120", "cu128": "sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"}
CUDA = {"cu130": "13.0", "cu128": "12.8"}
TORCH_VERSION = "2.11.0"
TRITON_VERSION = "3.6.0"
PY_TAG = "cp311"  # Debian bookworm's python3
PLAT = "manylinux_2_28_x86_64"

TORCH_INIT = '''"""LAB STAND-IN for PyTorch {version}: metadata only, no tensors.

Built by ddtree-deploy's lab (deploy/lab/wheels.py) so lab hosts carry a torch distribution whose
version tag, CUDA version, C++11 ABI and arch list match their GPU persona.
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


def _build(src: Path, out: Path, name: str, version: str, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    pkg = name.replace("-", "_")
    (src / "pyproject.toml").write_text(
        f'[build-system]\nrequires = ["setuptools>=61", "wheel"]\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "{name}"\nversion = "{version}"\n'
        f'description = "ddtree-deploy lab stand-in of {name} {version} (metadata only)"\n'
        f'requires-python = ">=3.8"\n\n[tool.setuptools]\npackages = ["{pkg}"]\n')
    # A platform-tagged wheel, as PyTorch ships: the tag is what tells the C++ ABI and glibc floor.
    (src / "setup.cfg").write_text(f"[bdist_wheel]\npython_tag = {PY_TAG}\nplat_name = {PLAT}\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "-w", str(out), str(src)], check=True)
    found = sorted(out.glob(f"{pkg}-{version.replace('+', '*')}*.whl"))
    if not found:
        raise RuntimeError(f"pip wheel built no {name} {version} wheel in {out}")
    return found[-1]


def build_lab_wheels(out: Path) -> dict[str, Path]:
    """Build (once) torch 2.11.0+cu130, torch 2.11.0+cu128 and triton 3.6.0 lab wheels into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    wheels: dict[str, Path] = {}
    for tag in ("cu130", "cu128"):
        version = f"{TORCH_VERSION}+{tag}"
        have = sorted(out.glob(f"torch-{version}-*.whl"))
        if have:
            wheels[f"torch-{tag}"] = have[-1]
            continue
        with tempfile.TemporaryDirectory() as tmp:
            wheels[f"torch-{tag}"] = _build(Path(tmp), out, "torch", version, {
                "torch/__init__.py": TORCH_INIT.format(version=version, archs=ARCHS[tag]),
                "torch/version.py": VERSION_PY.format(version=version, cuda=CUDA[tag]),
            })
    have = sorted(out.glob(f"triton-{TRITON_VERSION}-*.whl"))
    if have:
        wheels["triton"] = have[-1]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            wheels["triton"] = _build(Path(tmp), out, "triton", TRITON_VERSION, {
                "triton/__init__.py": f'"""LAB STAND-IN for triton {TRITON_VERSION}: metadata only."""\n'
                                      f'__version__ = "{TRITON_VERSION}"\n'})
    return wheels
