"""Coherence on the lab's real hosts: each managed venv holds the real metadata of the SGLang 0.5.17
closure, the host-side collectors (deploy/remote/host) run there with the venv's interpreter, and their
verdicts agree with the hosts' own `pip check` and dynamic linker. The drift knobs (fab lab.drift) make
the refusals phase 2 wires into inventory/provision/deploy."""
from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from deploy import coherence as C
from deploy.lab import elfstandin, fleet
from deploy.lab.wheels import load_closure
from deploy.remote.host import dists, elfsyms
from deploy.ssh import open_checked

# the lab as lab.up built it (ct200 +cu128, no drift), whatever ran on it before: tests/labstate.py
pytestmark = [pytest.mark.lab, pytest.mark.usefixtures("lab_as_built")]

VENV = fleet.VENV
CAPS_BOTH = {"sglang_versions": ["0.5.17", "0.5.23"]}
SM = {"ct129": "sm_120", "ct200": "sm_120", "h200": "sm_90"}
LOAD = elfstandin.DLOPEN_CHECK


def _run(lab, host: str, argv: list[str], ok=(0,)) -> str:
    conn = open_checked(lab, lab.hosts[host])
    try:
        r = conn.run(" ".join(shlex.quote(a) for a in argv), hide=True, warn=True, in_stream=False, timeout=120)
    finally:
        conn.close()
    assert r.exited in ok, f"{host}: {argv[:3]}: {r.stderr[-1500:]}"
    return r.stdout


def state(lab, host: str) -> dict:
    """What phase 2's probe will gather: distributions + environment, and the native-extension report."""
    got = json.loads(_run(lab, host, [f"{VENV}/bin/python", "-c", Path(dists.__file__).read_text()]))
    site = next(p for p in got["paths"] if p.startswith(VENV) and p.endswith("site-packages"))
    native = json.loads(_run(lab, host, [f"{VENV}/bin/python", "-c", Path(elfsyms.__file__).read_text(),
                                         site, SM[host]]))
    pip = _run(lab, host, [f"{VENV}/bin/python", "-m", "pip", "check", "--disable-pip-version-check"],
               ok=(0, 1)).splitlines()
    return {"dists": got, "native": native, "pip_check": pip, "site": site}


def test_every_lab_host_is_coherent_on_the_real_closure(lab):
    for host in ("ct129", "ct200", "h200"):
        s = state(lab, host)
        d = s["dists"]
        names = {dists.normalize(x["name"]): x for x in d["distributions"]}
        assert names["sglang"]["version"] == "0.5.17" and "sglang-kernel==0.4.5" in names["sglang"]["requires_dist"]
        assert names["sglang-kernel"]["version"] == "0.4.5" and names["transformers"]["version"] == "5.12.1"
        closure = {dists.normalize(x["name"]) for x in load_closure()["distributions"]}
        assert set(names) == closure | {"pip"}                   # setuptools: the venv's own, real one
        assert s["pip_check"] == ["No broken requirements found."]
        assert C.pip_check_lines(d["distributions"], d["environment"]) == s["pip_check"]
        assert C.deploy_verdict(d["distributions"], d["environment"], CAPS_BOTH).ok
        v = C.native_verdict(s["native"])
        assert v.ok, v.reasons
        (start,) = s["native"]["startup"]
        assert start["variant"] == ("sm90" if host == "h200" else "sm100") and start["torch_undefined"] == 111


def test_lab_drift_knobs_give_real_refusals(lab):
    try:
        fleet.set_drift("h200", "sglang-kernel-0.4.10", log=lambda *_: None)
        fleet.set_drift("ct200", "sglang-0.5.16", log=lambda *_: None)

        s = state(lab, "h200")
        d = s["dists"]
        assert C.pip_check_lines(d["distributions"], d["environment"]) == s["pip_check"]
        assert s["pip_check"] == [
            "sglang 0.5.17 has requirement sglang-kernel==0.4.5, but you have sglang-kernel 0.4.10.",
            "sglang-kernel 0.4.10 has requirement torch==2.14.1, but you have torch 2.11.0+cu130."]
        dv = C.deploy_verdict(d["distributions"], d["environment"], CAPS_BOTH)
        assert not dv.ok and "sglang 0.5.17 requires sglang-kernel==0.4.5, found sglang-kernel 0.4.10" in dv.reasons
        nv = C.native_verdict(s["native"])
        assert not nv.ok and "_ZN3c104cuda19CUDAErrorLogCaptureC1Ev (c10::cuda::CUDAErrorLogCapture" in nv.reasons[0]
        # the host's own dynamic linker refuses the stand-in for one of the symbols the check named
        lib, ext = f"{s['site']}/torch/lib", f"{s['site']}/sgl_kernel/sm90/common_ops.abi3.so"
        out = _run(lab, "h200", ["/usr/bin/python3", "-c", LOAD, lib, ext]).strip()
        named = {u["symbol"] for u in s["native"]["startup"][0]["unresolved"]}
        assert "undefined symbol: " in out and out.rsplit("undefined symbol: ", 1)[1] in named

        s = state(lab, "ct200")
        d = s["dists"]
        assert C.pip_check_lines(d["distributions"], d["environment"]) == s["pip_check"] and s["pip_check"]
        dv = C.deploy_verdict(d["distributions"], d["environment"], CAPS_BOTH)
        assert dv.reasons[0] == "SGLang 0.5.16 is not supported by the plugin (supported: 0.5.17, 0.5.23)"
        assert C.native_verdict(s["native"]).ok               # its kernel is still 0.4.5
        assert {r["host"]: r["drift"] for r in fleet.status()} == {
            "ct129": "coherent", "ct200": "sglang-0.5.16", "h200": "sglang-kernel-0.4.10"}
    finally:
        fleet.set_drift("h200", "coherent", log=lambda *_: None)
        fleet.set_drift("ct200", "coherent", log=lambda *_: None)
    for host in ("ct200", "h200"):
        s = state(lab, host)
        assert s["pip_check"] == ["No broken requirements found."] and C.native_verdict(s["native"]).ok
        out = _run(lab, host, ["/usr/bin/python3", "-c", LOAD, f"{s['site']}/torch/lib",
                               f"{s['site']}/{s['native']['startup'][0]['path']}"]).strip()
        assert out == "LOADED"


def test_unknown_drift_is_refused(lab):
    with pytest.raises(fleet.LabError, match="unknown drift"):
        fleet.set_drift("h200", "sglang-9.9")
    with pytest.raises(fleet.LabError, match="no lab host"):
        fleet.set_drift("nope", "coherent")
