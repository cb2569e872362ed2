"""The two distributions: the serving wheel (sglang-ddtree) holds only what an SGLang server imports, and every
module in it imports without the measurement tools; the tools wheel (sglang-ddtree-tools) holds the tools and
depends on the serving one."""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVING = ROOT / "overlays" / "sglang-ddtree"
TOOLS = ROOT / "overlays" / "sglang-ddtree-tools"
TOOL_MODULES = sorted(p.stem for p in (TOOLS / "src" / "sglang_ddtree_tools").glob("*.py") if p.stem != "__init__")


def build(project: Path, tmp_path: Path) -> Path:
    """The project's wheel, built from a clean copy (as fab deploy's builder does), offline."""
    src = tmp_path / project.name
    shutil.copytree(project, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation",
                          "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (whl,) = (tmp_path / "dist").glob(project.name.replace("-", "_") + "-*.whl")
    return whl


def modules(whl: Path) -> dict[str, str]:
    """{dotted module name: source} of every Python module in the wheel."""
    with zipfile.ZipFile(whl) as z:
        return {n[:-3].replace("/", ".").removesuffix(".__init__"): z.read(n).decode()
                for n in z.namelist() if n.endswith(".py")}


def imported(name: str, source: str) -> set[str]:
    """Every module name `source` (module `name`) imports, relative imports resolved."""
    pkg = name if source and name.count(".") == 0 else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return out


def test_the_tools_are_a_distribution_of_their_own():
    assert {"bench", "smoke", "servers", "paired", "hostload", "spy", "profile_step", "tiny", "markov",
            "trainkit", "report"} <= set(TOOL_MODULES)


def test_serving_wheel_holds_no_tool_and_every_module_imports_without_them(tmp_path):
    whl = build(SERVING, tmp_path)
    mods = modules(whl)
    assert "sglang_ddtree.plugin" in mods and "sglang_ddtree.adapters.worker" in mods
    shipped_tools = sorted(f"sglang_ddtree.{m}" for m in TOOL_MODULES if f"sglang_ddtree.{m}" in mods)
    assert shipped_tools == [], f"measurement/training modules in the serving wheel: {shipped_tools}"
    for name, src in mods.items():
        bad = sorted(m for m in imported(name, src) if m.split(".")[0] == "sglang_ddtree_tools"
                     or m in {f"sglang_ddtree.{t}" for t in TOOL_MODULES})
        assert not bad, f"{name} imports {bad}"
    # installed alone (the tools made unimportable), every module of the wheel imports; a module that needs
    # another SGLang release than this venv's (the per-version workers) may fail, but never for want of a tool
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                        str(target), str(whl)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    code = (
        "import importlib, json, sys\n"
        "class NoTools:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'sglang_ddtree_tools':\n"
        "            raise ImportError('the tools are not installed: ' + name)\n"
        "sys.meta_path.insert(0, NoTools())\n"
        "out = {}\n"
        "for m in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        mod = importlib.import_module(m)\n"
        "        assert mod.__file__.startswith(sys.argv[2]), mod.__file__\n"
        "        out[m] = None\n"
        "    except Exception as exc:\n"
        "        out[m] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH=str(target))
    r = subprocess.run([sys.executable, "-c", code, json.dumps(sorted(mods)), str(target)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert not [m for m, e in got.items() if e and "tools" in e], got
    failed = {m: e for m, e in got.items() if e}
    assert set(failed) <= {"sglang_ddtree.adapters.v0_5_17_worker", "sglang_ddtree.adapters.v0_5_23_worker",
                           "sglang_ddtree.adapters.worker", "sglang_ddtree.tree_kernels"}, failed
    assert got["sglang_ddtree.plugin"] is None and got["sglang_ddtree.config"] is None


def test_tools_wheel_holds_the_tools_and_depends_on_the_serving_plugin(tmp_path):
    whl = build(TOOLS, tmp_path)
    mods = modules(whl)
    assert {f"sglang_ddtree_tools.{m}" for m in TOOL_MODULES} <= set(mods)
    assert not [m for m in mods if m.split(".")[0] == "sglang_ddtree"], "the tools wheel must not carry the plugin"
    with zipfile.ZipFile(whl) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: sglang-ddtree" in meta


def test_report_module_imports_nothing_but_the_standard_library():
    """The control side loads sglang_ddtree_tools/report.py by path, without torch or SGLang: beside the standard
    library it reads only the plugin's contract (itself standard library only), from the checkout when the plugin
    is not installed."""
    src = (TOOLS / "src" / "sglang_ddtree_tools" / "report.py").read_text()
    mods = set(imported("sglang_ddtree_tools.report", src)) - {""}
    tops = {m.split(".")[0] for m in mods if m != "sglang_ddtree.contract" and m != "sglang_ddtree"}
    assert tops <= set(sys.stdlib_module_names), tops - set(sys.stdlib_module_names)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
