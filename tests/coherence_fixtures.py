"""Coherence inputs made from the real captures only (tests/captures/CAPTURES.md): the SGLang 0.5.17 closure's
metadata with distributions swapped for captured alternates, elfsyms' report of the real sglang-kernel common_ops
symbols against the real torch exports, and the facts probe's raw document that carries them (what a fleet
host running SGLang 0.5.17 sends)."""
from __future__ import annotations

import json
from pathlib import Path

from deploy.lab.wheels import load_closure
from deploy.remote.host import elfsyms as E

CAPTURES = Path(__file__).parent / "captures"
CLOSURE = load_closure()
ENV = CLOSURE["environment"]  # the marker environment pip resolved the closure for (CPython 3.11, Linux x86_64)
ABI = json.loads((CAPTURES / "sgl-kernel-torch-abi.json").read_text())
SITE = "/opt/sglang/venv/lib/python3.11/site-packages"
PERSONA = Path(__file__).resolve().parents[1] / "lab" / "personas" / "h200-1gpu"


def closure_with(*replace: tuple[str, str | None]) -> list[dict]:
    """The captured closure with some distributions swapped for captured alternates (or removed: None)."""
    out = [d for d in CLOSURE["distributions"] if d["name"] not in {n for n, _ in replace}]
    for name, version in replace:
        if version:
            out.append(next(a for a in CLOSURE["alternates"] if a["name"] == name and a["version"] == version))
    return out


def native_report(kernel: str, torch_version: str, sm: str | None) -> dict:
    """elfsyms.check_site's report of sglang-kernel `kernel`'s common_ops for `sm` on torch `torch_version`,
    resolved from the captured symbols (the same function the host runs, on the captured tables)."""
    libs = {n: {"needed": lib["needed"], "defined": [[s, None] for s in lib["exports"]]}
            for n, lib in ABI["torch"][torch_version]["libraries"].items()}
    variant = "sm90" if sm == "sm_90" else "sm100"
    v = ABI["sglang_kernel"][kernel][variant]
    r = E.unresolved({"needed": v["needed"], "undefined": [[s, None, False] for s in v["torch_undefined"]]}, libs,
                     ("libtorch_global_deps.so",))
    r.update(role="sgl_kernel.common_ops", variant=variant, path=v["path"], ok=not r["unresolved"])
    return {"torch_lib": True, "sm": sm, "startup": [r], "other": [], "errors": []}


def probe_raw(dists: list[dict] | None = None, native: list[dict] | None = None, key: str = "k1",
              host: str = "h200") -> dict:
    """The facts probe's raw document of a host whose venv holds `dists` (default: the closure) with their
    requirements, and whose native report is `native` (default: sglang-kernel 0.4.5 on torch 2.11.0, sm_90):
    the H200 persona's nvidia-smi, Debian bookworm's glibc and Python."""
    dists = CLOSURE["distributions"] if dists is None else dists
    return {"hostname": host, "machine": "x86_64", "glibc": "glibc 2.36",
            "nvidia_smi_query": {"rc": 0, "out": (PERSONA / "query-gpu.csv").read_text(), "err": ""},
            "venv": {"path": "/opt/sglang/venv", "exists": True, "pyvenv_cfg": "version = 3.11.2\n",
                     "lib_dir": "python3.11", "purelib": SITE,
                     "collected": {"python": "3.11.2", "environment": ENV, "paths": [SITE], "key": key,
                                   "distributions": [dict(d, path=f"{SITE}/{d['name']}-{d['version']}.dist-info")
                                                     for d in dists], "problems": []},
                     "native": [native_report("0.4.5", "2.11.0+cu130", "sm_90")] if native is None else native},
            "incomplete": []}
