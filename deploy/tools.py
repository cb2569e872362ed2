"""The plugin's measurement tools (`overlays/sglang-ddtree-tools`, package `sglang_ddtree_tools`) as the control side
uses them: the bench report's reader, and the tools wheel that `fab bench` and `fab smoke` carry to a host.

The serving wheel a release installs into a host's venv holds only what an SGLang server imports. The tools (the
bench and smoke host modules, the tiny models and the training kit they use, their reports) are a second
distribution: each `bench.run` / `smoke.run` call carries this checkout's tools wheel on the call's stdin, and the
host op installs it into the run's private work directory (`pip --no-index --no-deps --target`), on `PYTHONPATH`
of that run's module only, never into the serving venv; the work directory is removed when the run ends.

`report`: the one module that holds the bench report's schema and its checks (`sglang_ddtree_tools/report.py`,
stdlib only), loaded here from the checkout by path, so the control side needs neither the plugin nor torch for it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS_DIR = REPO / "overlays" / "sglang-ddtree-tools"  # the tools project (the serving one: build.DEFAULT_PLUGIN_DIR)
DIST = "sglang-ddtree-tools"
PACKAGE = "sglang_ddtree_tools"
REPORT_FILE = TOOLS_DIR / "src" / PACKAGE / "report.py"


def _load_report():
    """sglang_ddtree_tools/report.py as a module of its own (private name: it never shadows an installed copy)."""
    name = "deploy._tools_report"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPORT_FILE)
    if spec is None or spec.loader is None:
        raise ImportError(f"{REPORT_FILE}: the bench report module is missing from this checkout")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


report = _load_report()


@dataclass(frozen=True)
class ToolsWheel:
    name: str  # the wheel's file name
    version: str
    data: bytes = b""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def agent_args(self) -> dict:
        """What the host op needs to take the wheel off the call's stdin and check it (the bytes follow)."""
        return {"wheel": self.name, "size": len(self.data), "sha256": self.sha256}


@functools.lru_cache(maxsize=1)  # built once per run of the toolkit
def wheel() -> ToolsWheel:
    """This checkout's tools wheel, built offline (deploy/release/build.py: the version carries a build id)."""
    from .release import build

    out = Path(tempfile.mkdtemp(prefix="ddtree-tools-wheel-"))
    try:
        w = build.build_plugin(build.new_release_id(salt="tools"), TOOLS_DIR, out_dir=out)
        return ToolsWheel(name=w.wheel.name, version=w.version, data=w.wheel.read_bytes())
    finally:
        shutil.rmtree(out, ignore_errors=True)
