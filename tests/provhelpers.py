"""Helpers for provision tests: real wheels built with setuptools, real venvs, real pip."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def make_project(root: Path, name: str, version: str, *, module: str | None = None, body: str = "VALUE = 1\n",
                 entry_point: str | None = None, script: bool = True, data: bool = True) -> Path:
    """A setuptools project with a package, a console script, a plain script and a data file."""
    module = module or name.replace("-", "_")
    src = root / f"src-{name}-{version}"
    (src / module).mkdir(parents=True, exist_ok=True)
    (src / module / "__init__.py").write_text(f"__version__ = {version!r}\n" + body)
    (src / module / "blob.bin").write_bytes(os.urandom(2048))
    ep = entry_point or f"{module}:main"
    (src / module / "__init__.py").write_text((src / module / "__init__.py").read_text() + "def main():\n    return 0\n")
    scripts = ""
    if script:
        (src / "bin").mkdir(exist_ok=True)
        (src / "bin" / f"{module}-tool").write_text("#!/usr/bin/env python\nprint('tool')\n")
        scripts = f"scripts=['bin/{module}-tool'],"
    datafiles = ""
    if data:
        (src / "share").mkdir(exist_ok=True)
        (src / "share" / f"{module}.txt").write_text("data\n")
        datafiles = f"data_files=[('share/{module}', ['share/{module}.txt'])],"
    (src / "setup.py").write_text(textwrap.dedent(f"""
        from setuptools import setup
        setup(name={name!r}, version={version!r}, packages=[{module!r}], package_data={{{module!r}: ['blob.bin']}},
              entry_points={{'console_scripts': ['{module}-cli = {ep}']}}, {scripts} {datafiles})
    """))
    return src


def build_wheel(src: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*.whl"))
    subprocess.run([PY, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, env=_env())
    (new,) = set(out.glob("*.whl")) - before
    return new


def _env():
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return env


def make_venv(path: Path, with_pip: bool = True) -> Path:
    args = [PY, "-m", "venv", str(path)] + ([] if with_pip else ["--without-pip"])
    subprocess.run(args, check=True, capture_output=True)
    return path / "bin" / "python"


def pip(venv_python: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv_python), "-m", "pip", *args, "--disable-pip-version-check"],
                          capture_output=True, text=True, check=check, env=_env())


def stage(state: Path, whl: Path) -> dict:
    """Put a wheel into the agent's private staging directory as an upload would (0700 dirs), and describe it."""
    from deploy.remote.host.fsutil import sha256_file
    from deploy.remote.host.wheels import parse_wheel_filename
    sha = sha256_file(str(whl))
    d = state / "provision" / "incoming" / sha
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    for p in (state, state / "provision", state / "provision" / "incoming", d):
        p.chmod(0o700)
    (d / whl.name).write_bytes(whl.read_bytes())
    name, version = parse_wheel_filename(whl.name)
    return {"name": name, "version": version, "sha256": sha, "filename": whl.name}


def apply_args(venv_python: Path, install: list[dict], remove=(), pid: str = "t1") -> dict:
    """provision.apply's arguments, with the command prefixes the control machine builds."""
    from deploy.remote import commands
    py = str(venv_python)
    return {"id": pid, "venv": str(Path(py).parents[1]), "install": install, "remove": list(remove),
            "commands": {"pip_install": commands.pip_install(py), "pip_uninstall": commands.pip_uninstall(py),
                         "smoke": commands.smoke(py)}, "cuda_init": False}


def versions(venv_python: Path) -> dict[str, str]:
    out = pip(venv_python, "list", "--format=json").stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


def rewrite_wheel(whl: Path, changes: dict[str, bytes], out_dir: Path, extra: dict[str, bytes] | None = None) -> Path:
    """A copy of `whl` with some members replaced (and `extra` members added) and a RECORD that matches: a wheel
    whose every hash checks out."""
    import zipfile
    from deploy.remote.host.wheels import record_hash
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / whl.name
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        names = src.namelist()
        (rec,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        rows = []
        for n in names:
            if n == rec:
                continue
            data = changes.get(n, src.read(n))
            dst.writestr(n, data)
            rows.append(f"{n},{record_hash(data)},{len(data)}")
        for n, data in (extra or {}).items():
            dst.writestr(n, data)
            rows.append(f"{n},{record_hash(data)},{len(data)}")
        rows.append(f"{rec},,")
        dst.writestr(rec, "\n".join(rows) + "\n")
    return out
