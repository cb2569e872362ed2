"""Coherence before change, the pure parts on the real captures: the facts' verdicts (what `fab inventory` flags),
the provision blocker on an incoherent reference, and the deploy preflight's refusals; the facts probe's host
side (GPU archs, the cached distribution list and native report) run for real through the agent."""
from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from agenthelpers import result
from coherence_fixtures import ABI, CLOSURE, PERSONA, closure_with, native_report, probe_raw
from deploy import coherence as C
from deploy import facts as F
from deploy.lab import elfstandin, persona
from deploy.provision.plan import make_plan
from deploy.remote.host import probe as P

CAPS = C.load_capabilities()          # the plugin's own: SGLang 0.5.17 and 0.5.23
KERNEL_0410 = (closure_with(("sglang-kernel", "0.4.10")), [native_report("0.4.10", "2.11.0+cu130", "sm_90")])
PINS_0410 = ["sglang 0.5.17 has requirement sglang-kernel==0.4.5, but you have sglang-kernel 0.4.10.",
             "sglang-kernel 0.4.10 has requirement torch==2.14.1, but you have torch 2.11.0."]
SYMBOL = "_ZN3c104cuda19CUDAErrorLogCaptureC1Ev (c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture)"


# ---------------------------------------------------------------- facts: what fab inventory flags

def test_facts_of_a_coherent_host_carry_requirements_and_verdicts():
    f = F.build_facts("h200", probe_raw())
    c = f["coherence"]
    assert c["ok"] is True and c["reasons"] == [] and c["pip_check"]["details"]["distributions"] == 211
    assert c["native"]["ok"] and c["native"]["details"]["checked"] == ["sgl_kernel/sm90/common_ops.abi3.so"]
    sglang = next(d for d in f["venv"]["collected"]["distributions"] if d["name"] == "sglang")
    assert "sglang-kernel==0.4.5" in sglang["requires_dist"]                 # the requirements travel in the facts
    assert f["venv"]["distributions"]["sglang"] == "0.5.17" and f["packages"]["sglang-kernel"] == "0.4.5"
    assert f["facts_version"] == F.FACTS_VERSION and F.incoherent({"h200": f}) == {}
    from deploy.report import coherent_cell
    assert coherent_cell(f) == "ok"


def test_kernel_0410_is_flagged_with_pip_checks_lines_and_the_unresolved_symbol():
    f = F.build_facts("h200", probe_raw(*KERNEL_0410))
    c = f["coherence"]
    assert c["ok"] is False
    assert c["reasons"][:2] == [f"pip check: {line}" for line in PINS_0410]
    assert c["reasons"][2].startswith("native: sgl_kernel.common_ops (sm90) (sgl_kernel/sm90/common_ops.abi3.so): "
                                      "5 of its 99 torch symbols are not exported by the host's torch: ")
    assert SYMBOL in c["reasons"][2] and len(c["reasons"]) == 3
    from deploy.report import coherent_cell, incoherent_lines
    assert coherent_cell(f) == "2 unmet, native"
    assert F.incoherent({"h200": f, "ok": F.build_facts("ok", probe_raw())}) == {"h200": c["reasons"]}
    lines = [t.plain for t in incoherent_lines({"h200": f})]
    assert lines[0] == "h200: INCOHERENT (3 reason(s))" and lines[1] == "  " + c["reasons"][0]


def test_unsupported_sglang_alone_is_not_incoherent_but_its_unmet_pins_are():
    """Inventory judges the environment (pip check, native), not the plugin: 0.5.16's own pins are unmet."""
    f = F.build_facts("ct200", probe_raw(closure_with(("sglang", "0.5.16"))))
    assert f["coherence"]["ok"] is False and all(r.startswith("pip check: sglang 0.5.16 has requirement")
                                                 for r in f["coherence"]["reasons"])


def test_unknown_coherence_is_not_flagged():
    raw = probe_raw()
    raw["venv"]["native"] = None                       # the native check did not finish: pins still judged
    f = F.build_facts("h200", raw)
    assert f["coherence"]["ok"] is True and f["coherence"]["native"] is None
    del raw["venv"]["collected"]                       # nothing read: no verdict, nothing flagged
    assert F.build_facts("h200", raw)["coherence"] is None


def test_markers_are_evaluated_with_the_venvs_python_not_the_agents():
    dists = [{"name": "a", "version": "1", "requires_dist": ['b; python_version >= "3.12"'], "path": "/x"}]
    raw = probe_raw(dists, native=[])
    assert F.build_facts("h", raw)["coherence"]["ok"] is True                # a 3.11 venv: b is not needed
    raw["venv"]["pyvenv_cfg"], raw["venv"]["lib_dir"] = "version = 3.12.3\n", "python3.12"
    c = F.build_facts("h", raw)["coherence"]                                  # the agent is 3.11, the venv 3.12
    assert c["reasons"] == ["pip check: a 1 requires b, which is not installed."]
    assert C.venv_environment({"python_version": "3.11", "implementation_name": "cpython"}, "3.12") == {
        "python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
        "implementation_version": "3.12.0"}


def test_verdicts_are_reused_only_when_their_inputs_are_the_same():
    first = F.build_facts("h200", probe_raw(key="k1"))
    again = F.build_facts("h200", probe_raw(key="k1"), previous=first)
    assert again["coherence"] is first["coherence"]                           # not computed again
    bad = F.build_facts("h200", probe_raw(*KERNEL_0410, key="k2"), previous=first)
    assert bad["coherence"]["ok"] is False                                     # other metadata: judged again
    raw = probe_raw(key="k1", native=KERNEL_0410[1])
    assert F.build_facts("h200", raw, previous=first)["coherence"]["ok"] is False   # other ELF report


def test_an_unchanged_distribution_list_comes_from_the_previous_facts():
    first = F.build_facts("h200", probe_raw(key="k1"))
    raw = probe_raw(key="k1")
    raw["venv"]["collected"] = {k: v for k, v in raw["venv"]["collected"].items()
                                if k not in ("distributions", "problems")} | {"unchanged": True}
    f = F.build_facts("h200", raw, previous=first)
    assert f["venv"]["distributions"] == first["venv"]["distributions"] and f["coherence"]["ok"]
    assert f["venv"]["collected"]["distributions"] == first["venv"]["collected"]["distributions"]
    f = F.build_facts("h200", copy.deepcopy(raw), previous=None)            # nothing held: incomplete, not empty
    assert f["venv"]["collected"] is None and f["coherence"] is None
    assert F.incomplete_summary(f) == "venv: the probe left out a distribution list these facts lack"


# ---------------------------------------------------------------- provision: an incoherent reference blocks

PATTERNS = ["torch", "triton", "sglang", "sglang-kernel", "flashinfer*", "nvidia-*", "cuda-*"]


def test_an_incoherent_reference_is_one_blocker_per_reason():
    ref = F.build_facts("ct129", probe_raw(*KERNEL_0410, host="ct129"))
    tgt = F.build_facts("ct200", probe_raw(host="ct200"))
    p = make_plan(ref, tgt, PATTERNS)
    assert [i.name for i in p.installs] == ["sglang-kernel"] and p.blocked
    assert [(b.code, b.message) for b in p.blockers] == [("incoherent-reference", f"ct129: {r}")
                                                         for r in ref["coherence"]["reasons"]]
    j = p.to_json()
    assert j["blocked"] and len(j["blockers"]) == 3 and SYMBOL in j["blockers"][2]["message"]
    ok = make_plan(F.build_facts("ct129", probe_raw(host="ct129")), tgt, PATTERNS)
    assert not ok.blocked and ok.empty
    unknown = dict(ref, coherence=None)
    p = make_plan(unknown, tgt, PATTERNS)
    assert [b.code for b in p.blockers] == [] and [w.code for w in p.warnings] == ["reference-coherence"]


# ---------------------------------------------------------------- deploy: the preflight refusals

def _refusals(raw: dict, caps: dict = CAPS):
    return C.deploy_refusals(F.build_facts("h", raw)["venv"], caps)


def test_deploy_preflight_passes_on_the_fleets_line():
    assert _refusals(probe_raw()) == ([], [])


def test_deploy_refuses_kernel_0410_by_its_pins_and_its_symbols():
    refused, _ = _refusals(probe_raw(*KERNEL_0410))
    assert refused[:2] == ["coherence: sglang 0.5.17 requires sglang-kernel==0.4.5, found sglang-kernel 0.4.10",
                           "coherence: sglang-kernel 0.4.10 requires torch==2.14.1, found torch 2.11.0"]
    assert refused[2].startswith("native: sgl_kernel.common_ops (sm90) (sgl_kernel/sm90/common_ops.abi3.so): 5 of its "
                                 "99 torch symbols are not exported by the host's torch: ") and SYMBOL in refused[2]
    assert len(refused) == 3


def test_deploy_refuses_the_native_check_alone():
    """Pins met, common_ops still built for another torch (a hand-copied kernel): the ELF check refuses."""
    refused, _ = _refusals(probe_raw(native=KERNEL_0410[1]))
    assert len(refused) == 1 and refused[0].startswith("native: ") and SYMBOL in refused[0]


def test_deploy_refuses_an_unsupported_sglang_and_unmet_pins_of_a_supported_one():
    refused, warnings = _refusals(probe_raw(closure_with(("sglang", "0.5.16"))))
    assert refused[0] == "coherence: SGLang 0.5.16 is not supported by the plugin (supported: 0.5.17, 0.5.23)"
    assert "coherence: sglang 0.5.16 requires flashinfer_python[cu13]==0.6.14, found flashinfer-python 0.6.15.post1" \
        in refused
    assert any("other unmet requirement(s)" in w for w in warnings)          # helion etc.: shown, not refusing
    refused, _ = _refusals(probe_raw(closure_with(("sglang", "0.5.23"))))
    assert refused == ["coherence: sglang 0.5.23 requires flashinfer_python[cu13]==0.7.2, found flashinfer-python "
                       "0.6.15.post1", "coherence: sglang 0.5.23 requires sglang-kernel==0.4.10, found sglang-kernel "
                       "0.4.5", "coherence: sglang 0.5.23 requires torch==2.14.1, found torch 2.11.0"]
    refused, _ = _refusals(probe_raw(), {"sglang_versions": ["0.5.23"]})   # a plugin that dropped 0.5.17
    assert refused == ["coherence: SGLang 0.5.17 is not supported by the plugin (supported: 0.5.23)"]


def test_deploy_refuses_what_it_could_not_check():
    raw = probe_raw()
    raw["venv"]["native"] = None
    assert _refusals(raw)[0] == ["native: the native-extension check did not run (incomplete facts: see fab "
                                 "inventory)"]
    assert _refusals(probe_raw(), {"modes": ["tree-verify"]})[0][0].startswith(
        "coherence: capabilities.json declares no SGLang versions")
    del raw["venv"]["collected"]
    assert _refusals(raw)[0][0].startswith("coherence: the venv's distributions were not read")
    assert C.deploy_refusals({"path": "/opt/sglang/venv", "exists": False}, CAPS)[0] == [
        "coherence: the venv /opt/sglang/venv does not exist"]
    assert C.deploy_refusals(None, CAPS)[0] == ["coherence: the venv ? does not exist"]


def test_native_verdict_of_several_archs_and_of_an_unknown_arch():
    both = [native_report("0.4.10", "2.11.0+cu130", "sm_90"), native_report("0.4.10", "2.11.0+cu130", "sm_120")]
    v = C.native_verdict(both)
    assert not v.ok and [r.split(" ")[1] for r in v.reasons] == ["(sm90)", "(sm100)"]
    assert v.details == {"sm": ["sm_90", "sm_120"], "checked": ["sgl_kernel/sm90/common_ops.abi3.so",
                                                                 "sgl_kernel/sm100/common_ops.abi3.so"]}
    v = C.native_verdict([native_report("0.4.5", "2.11.0+cu130", None)])
    assert v.ok and v.warnings == ("no GPU arch from nvidia-smi: checked the sgl_kernel.common_ops that loads "
                                   "without a GPU (sm100)",)


# ---------------------------------------------------------------- the probe's host side, run for real

def test_gpu_archs_on_the_host_agree_with_the_control_sides_parser():
    for text in ((PERSONA / "query-gpu.csv").read_text(), persona.persona_files("rtxpro6000-8gpu", "x")["query-gpu.csv"]):
        want = list(dict.fromkeys(g["sm"] for g in F.parse_query_gpu_csv(text)))
        assert P.gpu_archs({"rc": 0, "out": text}) == want and want in (["sm_90"], ["sm_120"])
    assert P.gpu_archs({"rc": 9, "out": ""}) == [] and P.gpu_archs(None) == []
    assert P.gpu_archs({"rc": 0, "out": "index, name\n0, x\n"}) == []


@pytest.fixture()
def standin_venv(tmp_path):
    """A venv as the lab has one, on this machine: real dist-info (the closure's metadata) and the ELF stand-ins of
    torch 2.11.0's libraries and sglang-kernel 0.4.5's common_ops (deploy/lab/elfstandin.py)."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    (venv / "pyvenv.cfg").write_text("version = 3.11.2\n")
    from deploy.lab.wheels import write_dist_info
    for d in CLOSURE["distributions"]:
        write_dist_info(site, d)
    torch_lib = site / "torch" / "lib"
    elfstandin.build_torch_lib(torch_lib, ABI["torch"]["2.11.0+cu130"], "2.11.0+cu130")
    for variant in ("sm90", "sm100"):
        elfstandin.build_common_ops(site / "sgl_kernel" / variant / "common_ops.abi3.so",
                                    ABI["sglang_kernel"]["0.4.5"][variant], torch_lib, "0.4.5", variant)
    return venv


def test_probe_collects_requirements_and_native_report_and_caches_them(standin_venv, tmp_path):
    """The real facts.probe op through the loader: requirements and the native report on the first call; the
    second call reads no metadata or ELF file (both cached by stat), and leaves out the list the caller holds."""
    state = tmp_path / "state"
    env = {"PATH": "/usr/bin:/bin"}                     # no nvidia-smi here: no GPU arch, sgl_kernel's own choice
    args = {"venv": str(standin_venv), "budget": 20, "import_torch": False}
    raw = result("facts.probe", args, state, env=env)
    f = F.build_facts("local", raw)
    assert f["coherence"]["ok"] is True and f["coherence"]["native"]["details"]["checked"] == [
        "sgl_kernel/sm100/common_ops.abi3.so"]
    assert len(f["venv"]["collected"]["distributions"]) == 211 and not f["incomplete"]
    assert {p.name for p in state.iterdir()} >= {"cache-dists.json", "cache-native.json"}
    before = {p.name: p.stat().st_mtime_ns for p in state.iterdir()}
    again = result("facts.probe", dict(args, known_dists=raw["venv"]["collected"]["key"]), state, env=env)
    assert {p.name: p.stat().st_mtime_ns for p in state.iterdir()} == before          # served from the caches
    assert again["venv"]["collected"]["unchanged"] and "distributions" not in again["venv"]["collected"]
    assert again["venv"]["native"] == raw["venv"]["native"]
    assert F.build_facts("local", again, previous=f)["venv"]["distributions"] == f["venv"]["distributions"]
    # sglang-kernel 0.4.10's common_ops in place of 0.4.5's (another size): the report is made again, and refuses
    ops = standin_venv / "lib" / "python3.11" / "site-packages" / "sgl_kernel" / "sm100" / "common_ops.abi3.so"
    ops.unlink()
    elfstandin.build_common_ops(ops, ABI["sglang_kernel"]["0.4.10"]["sm100"], ops.parents[2] / "torch" / "lib",
                                "0.4.10", "sm100")
    bad = F.build_facts("local", result("facts.probe", args, state, env=env), previous=f)
    assert bad["coherence"]["ok"] is False and SYMBOL in bad["coherence"]["reasons"][0]
    # an installed distribution more (a new METADATA): the list is read again
    shutil.copytree(next((ops.parents[2]).glob("sglang-0.5.17.dist-info")), ops.parents[2] / "zzz-1.0.dist-info")
    (ops.parents[2] / "zzz-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: zzz\nVersion: 1.0\n")
    third = result("facts.probe", dict(args, known_dists=raw["venv"]["collected"]["key"]), state, env=env)
    assert len(third["venv"]["collected"]["distributions"]) == 212


def test_a_probe_without_a_venv_or_torch_has_no_native_report(tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    raw = result("facts.probe", {"venv": str(venv), "budget": 20, "import_torch": False}, tmp_path / "s",
                 env={"PATH": "/usr/bin:/bin"})
    f = F.build_facts("x", raw)
    assert f["venv"]["collected"]["distributions"] == [] and f["coherence"]["ok"] is True
    assert json.dumps(f["coherence"]["native"]["warnings"]) == '["torch is not installed: no native extension to check"]'


def test_tree_verify_under_graphs_is_refused_where_the_adapter_cannot_capture_the_tree_mask():
    """The plugin's capabilities say per SGLang version whether tree-verify runs under decode CUDA graphs;
    a host whose SGLang says no is refused at the plan (naming the services and the fix), one that says yes
    is not, and services rendered without graphs never are."""
    from types import SimpleNamespace as NS

    from deploy import coherence as C

    caps = {"per_version": {"0.5.17": {"tree_verify_cuda_graphs": True}, "0.5.23": {"tree_verify_cuda_graphs": False}}}
    svc = [NS(instance="gpu0"), NS(instance="gpu3")]

    def venv(v):
        return {"collected": {"distributions": [{"name": "SGLang", "version": v}, {"name": "torch", "version": "2.11.0"}]}}

    assert C.tree_graph_refusal(venv("0.5.17"), caps, svc) == []
    (msg,) = C.tree_graph_refusal(venv("0.5.23"), caps, svc)
    assert "gpu0, gpu3" in msg and "SGLang 0.5.23" in msg and "cuda_graphs: false" in msg and "(0.5.17)" in msg
    assert C.tree_graph_refusal(venv("0.5.23"), caps, []) == []
    assert C.tree_graph_refusal({}, caps, svc) == []  # no SGLang: deploy_refusals refuses it already
