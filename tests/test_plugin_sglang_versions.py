"""The plugin's CPU suite against SGLang 0.5.17 too (the line the fleet runs; torch 2.11.0 pins).

The main venv carries SGLang 0.5.23; scripts/bootstrap builds .venv-sglang-0.5.17 with SGLang 0.5.17, the plugin
and its tools. This runs tests/plugin there, as a subprocess, with this checkout's plugin and tools sources first on
PYTHONPATH (what is tested is the checkout, not the copy the venv got when it was built), and fails if that venv is
missing or any test fails - so the README's one test command covers both supported SGLang versions."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-sglang-0.5.17"
SOURCES = [ROOT / "overlays/sglang-ddtree/src", ROOT / "overlays/sglang-ddtree-tools/src"]


def test_plugin_suite_passes_under_sglang_0517():
    py = VENV / "bin" / "python"
    assert py.exists(), f"{VENV} is missing: run scripts/bootstrap (it builds the SGLang 0.5.17 test venv)"
    ver = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                         capture_output=True, text=True, timeout=120)
    assert ver.stdout.strip() == "0.5.17", ver.stderr[-2000:]
    out = subprocess.run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/plugin"],
                         cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, SOURCES))))
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0, tail
    passed = int(re.search(r"(\d+) passed", out.stdout).group(1))
    assert passed >= 200, tail  # the whole plugin suite ran, not a stub of it
    print("SGLang 0.5.17: " + re.search(r"(\d+ passed[^\n]*) in [0-9.]+s", out.stdout).group(1))
