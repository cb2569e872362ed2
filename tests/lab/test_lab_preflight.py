"""Coherence before change on the lab: the drift knobs (`fab lab.drift`, real captured metadata and ELF stand-ins)
make a host incoherent; `fab inventory` flags it, `fab provision` blocks on an incoherent reference and `fab deploy`
refuses it at the plan -- no lock taken, nothing staged, no service restarted -- while the other hosts of the run
proceed; `lab.drift HOST coherent` makes the same deploy pass again.

The hosts get a good release first (module fixture), so that a refused deploy has services it could have restarted
and a release it could have replaced. Every test puts its host back to `coherent`; the fixture leaves no release.
"""
from __future__ import annotations

import json

import pytest

from helpers import CLEAN, lab_inventory, ssh, strip_ansi

pytestmark = pytest.mark.lab
HOSTS = ["ct129", "ct200", "h200"]
SYMBOL = "_ZN3c104cuda19CUDAErrorLogCaptureC1Ev (c10::cuda::CUDAErrorLogCapture::CUDAErrorLogCapture)"
NATIVE_0410 = ("native: sgl_kernel.common_ops ({v}) (sgl_kernel/{v}/common_ops.abi3.so): 5 of its 99 torch symbols "
               "are not exported by the host's torch: ")
# What a refused deploy must leave as it was: the host lock, the releases and `current`, the journal, every
# service's invocation (a restart makes a new one), the plugin in the venv, provision's staging.
SNAPSHOT = ("test -e /var/lib/ddtree/lock.json && echo LOCKED; ls -1 /opt/ddtree/releases; "
            "readlink /opt/ddtree/releases/current; wc -l < /opt/ddtree/journal.jsonl; "
            "systemctl show -p Id,InvocationID,ActiveState 'sglang-ddtree@*'; "
            "ls /opt/sglang/venv/lib/python3.11/site-packages | md5sum; "
            "find /var/lib/ddtree/provision 2>/dev/null | sort")


def snapshot(lab, host: str) -> str:
    return ssh(lab, host, SNAPSHOT, check=False).stdout


@pytest.fixture(scope="module")
def env(lab, fab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labpreflight")
    for h in HOSTS:
        ssh(lab, h, CLEAN)
        assert fab("lab.drift", h, "coherent").returncode == 0
    inv = lab_inventory(tmp, keep=HOSTS)
    r = fab("deploy", "--yes", "--hosts", "ct200,h200", "--mode", "shadow-linear", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"lab": lab, "inv": inv, "tmp": tmp}
    for h in HOSTS:
        fab("lab.drift", h, "coherent")
        ssh(lab, h, CLEAN + f"; {lab.hosts[h].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
            check=False)


def drift(fab, host: str, kind: str) -> None:
    r = fab("lab.drift", host, kind)
    assert r.returncode == 0, r.stdout + r.stderr


def other_mode(fab, inv, host: str) -> str:
    rows = json.loads(fab("status", "--json", "--hosts", host, inventory=inv).stdout)
    return "tree-verify" if rows[0]["mode"] == "shadow-linear" else "shadow-linear"


def refused_lines(out: str, host: str) -> list[str]:
    return [ln.split(" REFUSED ", 1)[1] for ln in out.splitlines() if ln.startswith(f"[{host}] REFUSED ")]


def test_kernel_0410_on_h200_is_flagged_and_refused_with_nothing_touched(env, fab):
    lab, inv = env["lab"], env["inv"]
    drift(fab, "h200", "sglang-kernel-0.4.10")
    try:
        r = fab("inventory", "--json", "--refresh", "--hosts", "h200", inventory=inv)
        assert r.returncode == 3, r.stderr                     # every fact came back; the host is incoherent
        doc = json.loads(r.stdout)
        reasons = doc["incoherent"]["h200"]
        assert reasons[:2] == [
            "pip check: sglang 0.5.17 has requirement sglang-kernel==0.4.5, but you have sglang-kernel 0.4.10.",
            "pip check: sglang-kernel 0.4.10 has requirement torch==2.14.1, but you have torch 2.11.0+cu130."]
        assert reasons[2].startswith(NATIVE_0410.format(v="sm90")) and SYMBOL in reasons[2] and len(reasons) == 3
        assert doc["hosts"]["h200"]["coherence"]["ok"] is False and not doc["incomplete"]
        assert "collected" not in doc["hosts"]["h200"]["venv"]           # --json: the verdicts, not the raw lists
        table = strip_ansi(fab("inventory", "--hosts", "h200", inventory=inv).stdout)   # cached facts: same flags
        assert "2 unmet, native" in next(ln for ln in table.splitlines() if ln.startswith("h200 "))
        assert "h200: INCOHERENT (3 reason(s))" in table

        before = snapshot(lab, "h200")
        assert "LOCKED" not in before and "ActiveState=active" in before
        r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "tree-verify", "--json", inventory=inv)
        out = r.stdout + r.stderr
        assert r.returncode == 1, out
        got = refused_lines(r.stdout, "h200")
        assert got[:2] == ["coherence: sglang 0.5.17 requires sglang-kernel==0.4.5, found sglang-kernel 0.4.10",
                           "coherence: sglang-kernel 0.4.10 requires torch==2.14.1, found torch 2.11.0+cu130"]
        assert got[2].startswith(NATIVE_0410.format(v="sm90")) and SYMBOL in got[2] and len(got) == 3
        assert "deploy: 0/1 hosts ok" in r.stderr
        assert [ln for ln in r.stdout.splitlines() if ln.startswith("[h200]")] == [f"[h200] REFUSED {x}" for x in got]
        summary = json.loads(r.stdout[r.stdout.index("\n{") + 1:])
        h = summary["hosts"]["h200"]
        assert h["kind"] == "refused" and h["phase"] == "plan" and h["coherence"]["refused"] == got
        assert h["coherence"]["gpu_archs"] == ["sm_90"] and h["coherence"]["sglang"] == "0.5.17"
        assert snapshot(lab, "h200") == before                 # no lock, no release, no restart, no staging

        # the other hosts of the run proceed, as with every other plan refusal
        r = fab("deploy", "--yes", "--hosts", "ct200,h200", "--mode", "tree-verify", inventory=inv)
        assert r.returncode == 1 and "[ct200] REFUSED" not in r.stdout and len(refused_lines(r.stdout, "h200")) == 3
        assert "deploy ok   ct200" in r.stderr and "deploy: 1/2 hosts ok" in r.stderr, r.stdout + r.stderr
        assert snapshot(lab, "h200") == before
    finally:
        drift(fab, "h200", "coherent")
    r = fab("inventory", "--json", "--refresh", "--hosts", "h200", inventory=inv)
    assert r.returncode == 0 and json.loads(r.stdout)["incoherent"] == {}
    r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "tree-verify", inventory=inv)
    assert r.returncode == 0 and "REFUSED" not in r.stdout, r.stdout + r.stderr
    assert "gate ok" in r.stdout and snapshot(lab, "h200") != before


@pytest.mark.parametrize("kind,first", [
    ("sglang-0.5.16", "coherence: SGLang 0.5.16 is not supported by the plugin (supported: 0.5.17, 0.5.23)"),
    ("sglang-0.5.23", "coherence: sglang 0.5.23 requires flashinfer_python[cu13]==0.7.2, found flashinfer-python "
                      "0.6.15.post1")])
def test_sglang_version_drift_on_ct200_is_refused_with_nothing_touched(env, fab, kind, first):
    lab, inv = env["lab"], env["inv"]
    drift(fab, "ct200", kind)
    try:
        r = fab("inventory", "--json", "--refresh", "--hosts", "ct200", inventory=inv)
        assert r.returncode == 3 and all(x.startswith(f"pip check: sglang {kind[7:]} ")
                                         for x in json.loads(r.stdout)["incoherent"]["ct200"]), r.stdout
        before = snapshot(lab, "ct200")
        assert "LOCKED" not in before and "ActiveState=active" in before
        mode = other_mode(fab, inv, "ct200")                    # a deploy that would restart every service
        r = fab("deploy", "--yes", "--hosts", "ct200", "--mode", mode, inventory=inv)
        assert r.returncode == 1, r.stdout + r.stderr
        got = refused_lines(r.stdout, "ct200")
        assert got[0] == first, got
        if kind == "sglang-0.5.23":                             # supported, but pinned to another torch and kernel
            want = [first, "coherence: sglang 0.5.23 requires sglang-kernel==0.4.10, found sglang-kernel 0.4.5",
                    "coherence: sglang 0.5.23 requires torch==2.14.1, found torch 2.11.0+cu128"]
            if mode == "tree-verify":  # rendered with decode CUDA graphs, which only 0.5.17's adapter captures
                want.append("coherence: tree-verify under decode CUDA graphs (gpu0, gpu1, gpu2, gpu3, gpu4, gpu5, gpu6, "
                            "gpu7) is not supported by the plugin with SGLang 0.5.23 (capabilities.json: "
                            "tree_verify_cuda_graphs is false); set cuda_graphs: false for these services, or run an "
                            "SGLang whose adapter captures the tree mask (0.5.17)")
            assert got == want, got
        else:
            assert "coherence: sglang 0.5.16 requires flashinfer_python[cu13]==0.6.14, found flashinfer-python " \
                   "0.6.15.post1" in got and not any(x.startswith("native:") for x in got)
        assert snapshot(lab, "ct200") == before
    finally:
        drift(fab, "ct200", "coherent")
    r = fab("deploy", "--yes", "--hosts", "ct200", "--mode", mode, inventory=inv)
    assert r.returncode == 0 and "REFUSED" not in r.stdout, r.stdout + r.stderr
    assert snapshot(lab, "ct200") != before


def test_provision_blocks_on_an_incoherent_reference_and_runs_nothing(env, fab):
    lab, inv = env["lab"], env["inv"]
    drift(fab, "ct129", "sglang-kernel-0.4.10")
    try:
        before = snapshot(lab, "ct200")
        r = fab("provision", "ct200", "--yes", "--json", inventory=inv)
        assert r.returncode == 1, r.stdout + r.stderr
        (host,) = json.loads(r.stdout)["hosts"]
        assert host["status"] == "blocked" and host["sent_bytes"] == 0
        blockers = host["plan"]["blockers"]
        assert [b["code"] for b in blockers] == ["incoherent-reference"] * 3
        assert [b["message"] for b in blockers[:2]] == [
            "ct129: pip check: sglang 0.5.17 has requirement sglang-kernel==0.4.5, but you have sglang-kernel 0.4.10.",
            "ct129: pip check: sglang-kernel 0.4.10 has requirement torch==2.14.1, but you have torch 2.11.0+cu130."]
        assert blockers[2]["message"].startswith("ct129: " + NATIVE_0410.format(v="sm100"))   # RTX PRO 6000: sm_120
        assert {i["name"] for i in host["plan"]["items"] if i["action"] == "install"} == {"sglang-kernel", "torch"}
        assert snapshot(lab, "ct200") == before                # no lock, no staging, the venv untouched
        table = strip_ansi(fab("provision", "ct200", "--dry-run", inventory=inv).stdout)
        assert "BLOCKED" in table and "BLOCKER incoherent-reference: ct129: pip check: sglang 0.5.17" in table
    finally:
        drift(fab, "ct129", "coherent")
    r = fab("provision", "ct200", "--dry-run", "--json", inventory=inv)
    (host,) = json.loads(r.stdout)["hosts"]
    assert r.returncode == 0 and host["status"] == "planned" and host["plan"]["blockers"] == [], r.stdout
    assert snapshot(lab, "ct200") == before
