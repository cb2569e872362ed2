"""The smoke import judged against the reference: the child's per-module JSON report (run for real), its parsing and
the judgement (pure), and provision with real wheels, venvs and pip through the real agent: a module that fails on
the reference too is a warning, one that fails on the target only restores the backup."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agenthelpers import call, once, result
from deploy.inventory import Host
from deploy.provision import overlay
from deploy.provision.plan import make_plan, render
from deploy.remote import commands
from deploy.remote.host import importsmoke as S

from provhelpers import build_wheel, make_project, make_venv, pip, stage, versions


# ---------------------------------------------------------------- the child program, run for real

def _child(tmp_path, modules, mode="nocuda"):
    """SMOKE_CODE under this python, with `modules` ({name: source}) importable from a directory of their own."""
    lib = tmp_path / f"lib{len(list(tmp_path.glob('lib*')))}"
    lib.mkdir()
    for name, src in modules.items():
        (lib / f"{name}.py").write_text(src)
    argv = [sys.executable, "-B", "-c", commands.SMOKE_CODE, json.dumps(list(modules)), mode]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(lib)))


def test_the_child_reports_every_module_and_keeps_module_output_off_its_report(tmp_path):
    p = _child(tmp_path, {"okmod": "print('chatty on import')\nimport os\nos.write(1, b'raw fd 1 noise\\n')\n",
                          "badmod": "import provtest_not_installed_anywhere\n",
                          "exitmod": "raise SystemExit(3)\n",
                          "longmod": "raise RuntimeError('x' * 5000)\n",
                          "lastmod": "VALUE = 1\n"})
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in p.stdout.splitlines()]           # stdout: the report and nothing else
    assert [d["module"] for d in lines] == ["okmod", "badmod", "exitmod", "longmod", "lastmod"]
    assert "chatty on import" in p.stderr and "raw fd 1 noise" in p.stderr
    got = S.parse(p.stdout, ["okmod", "badmod", "exitmod", "longmod", "lastmod"])
    assert got["okmod"] is None and got["lastmod"] is None
    assert got["badmod"] == "ModuleNotFoundError: No module named 'provtest_not_installed_anywhere'"
    assert got["exitmod"] == "SystemExit: 3"
    assert got["longmod"].startswith("RuntimeError: xxx") and len(got["longmod"]) == S.ERROR_CHARS
    assert len(p.stdout) <= S.output_cap(list(got))


def test_a_module_that_ends_the_process_fails_and_the_rest_are_not_reached(tmp_path):
    p = _child(tmp_path, {"first": "", "crash": "import os\nos._exit(7)\n", "later": ""})
    assert p.returncode == 7
    got = S.parse(p.stdout, ["first", "crash", "later"], p.returncode)
    assert got == {"first": None, "crash": "the import ended the smoke process (exit 7)",
                   "later": "not reached: the smoke process ended at crash"}


def test_cuda_init_is_skipped_when_torch_itself_fails_to_import(tmp_path):
    """The cuda step is as before (import torch, torch.cuda.init()); a torch that does not import is a module
    failure, judged against the reference, not a crash of the whole smoke."""
    p = _child(tmp_path, {"torch": "raise ImportError('libcudart.so.13: cannot open shared object file')\n"},
               mode="cuda")
    assert p.returncode == 0, p.stderr
    assert S.parse(p.stdout, ["torch"])["torch"].startswith("ImportError: libcudart.so.13")
    p = _child(tmp_path, {"torch": "class cuda:\n    @staticmethod\n    def init():\n        raise RuntimeError('no driver')\n"},
               mode="cuda")
    assert p.returncode != 0 and "no driver" in p.stderr                 # a failing CUDA init still fails the run
    assert S.parse(p.stdout, ["torch"])["torch"] is None


# ---------------------------------------------------------------- parsing and judgement (pure)

def test_parse_keeps_only_reports_of_the_requested_modules():
    out = "\n".join(["not json", json.dumps({"module": "a", "error": None}), json.dumps(["a"]),
                     json.dumps({"module": "stranger", "error": None}), json.dumps({"module": "b", "error": "E" * 999}),
                     json.dumps({"module": "a", "error": "a later line cannot change a report"})])
    got = S.parse(out, ["a", "b", "c"], rc=None, timed_out=True)
    assert got == {"a": None, "b": "E" * S.ERROR_CHARS, "c": "the import did not finish before the deadline"}
    assert S.parse("", []) == {}


def test_judge_holds_the_target_to_what_imports_on_the_reference():
    target = {"ok": None, "both": "ModuleNotFoundError: No module named 'httpx2'", "regressed": "ImportError: boom",
              "fixed": None, "unknown": "ImportError: x"}
    reference = {"ok": None, "both": "ModuleNotFoundError: No module named 'httpx2'", "regressed": None,
                 "fixed": "ImportError: old"}
    v = S.judge(target, reference)
    assert v["imported"] == ["fixed", "ok"]
    assert v["failed_on_both"] == {"both": "ModuleNotFoundError: No module named 'httpx2'"}
    assert v["failed"] == {"regressed": "ImportError: boom", "unknown": "ImportError: x"}   # unknown: must import
    assert S.warnings(v) == ["fails on the reference too: both (ModuleNotFoundError: No module named 'httpx2')"]
    assert S.failure(v) == ("smoke import failed on the target, not on the reference: regressed (ImportError: boom), "
                            "unknown (ImportError: x)")
    clean = S.judge({"ok": None, "both": "E"}, {"both": "E"})
    assert S.failure(clean) is None and clean["failed_on_both"] == {"both": "E"}
    assert S.judge({"m": "E"}, None)["failed"] == {"m": "E"}


@pytest.mark.parametrize("bad", [["m"], {"m": 1}, {1: None}, "m"])
def test_a_malformed_reference_map_is_refused(bad):
    with pytest.raises(ValueError):
        S.checked_reference(bad)
    assert S.checked_reference(None) == {}


def test_the_plan_lists_reference_failures_as_warnings():
    from rich.console import Console
    ref = _facts("gpu-ref", {"anthropic": "0.70.0", "sglang": "0.5.17"})
    tgt = _facts("gpu-drift", {})
    scan = {"anthropic": {"smoke": {"modules": {"anthropic": "ModuleNotFoundError: No module named 'httpx2'"}}},
            "sglang": {"smoke": {"modules": {"sglang": None}}}}
    plan = make_plan(ref, tgt, ["*"], scan)
    assert plan.reference_smoke == {"anthropic": "ModuleNotFoundError: No module named 'httpx2'", "sglang": None}
    assert [(w.code, w.message) for w in plan.warnings] == [
        ("reference-smoke", "fails on the reference too: anthropic (ModuleNotFoundError: No module named 'httpx2')")]
    assert plan.to_json()["reference_smoke"] == plan.reference_smoke and not plan.blocked
    con = Console(record=True, width=200)
    render(plan, con)
    assert "fails on the reference too: anthropic" in con.export_text()
    scan["sglang"]["smoke"] = {"error": "root will not run /v/bin/python: writable by group"}
    plan = make_plan(ref, tgt, ["*"], scan)
    assert "sglang" not in plan.reference_smoke
    assert any(w.code == "reference-smoke" and w.message.startswith("sglang: the smoke import did not run on gpu-ref")
               for w in plan.warnings)


def _facts(host, dists):
    return {"host": host, "venv": {"path": "/opt/sglang/venv", "exists": True, "python": "3.11.2",
                                   "distributions": dict(dists)}, "coherence": {"ok": True}}


# ---------------------------------------------------------------- provision with real venvs through the agent

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A reference venv where provtest-anth's module fails (it imports a module nobody has, as anthropic imports
    httpx2 on the GPU lab's reference) and provtest-delta's imports only thanks to helper-refonly, which is not
    managed; a target venv with older builds of both."""
    root = tmp_path_factory.mktemp("provsmoke")
    house, old = root / "house", root / "old"
    w = {"anth": build_wheel(make_project(root, "provtest-anth", "2.0", body="import provtest_httpx2\n"), house),
         "delta": build_wheel(make_project(root, "provtest-delta", "2.0", body="import helper_refonly\n"), house),
         "alpha": build_wheel(make_project(root, "provtest-alpha", "2.0", body="print('alpha says hello')\n"), house),
         "helper": build_wheel(make_project(root, "helper-refonly", "1.0"), root / "helper"),
         "anth1": build_wheel(make_project(root, "provtest-anth", "1.0"), old),
         "delta1": build_wheel(make_project(root, "provtest-delta", "1.0"), old),
         "alpha1": build_wheel(make_project(root, "provtest-alpha", "1.0"), old)}
    ref, tgt = make_venv(root / "ref"), make_venv(root / "tgt")
    pip(ref, "install", "--no-index", "--no-deps", *(str(w[k]) for k in ("anth", "delta", "alpha", "helper")))
    return {"root": root, "house": house, "wheels": w, "ref": ref, "tgt": tgt}


def _provision(world, tmp_path, names):
    """Plan from the reference's real scan (with its smoke import), then apply the plan's payload on the target."""
    ref, tgt, w = world["ref"], world["tgt"], world["wheels"]
    pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", str(w["anth1"]), str(w["delta1"]),
        str(w["alpha1"]))
    scan = result("provision.scan", {"venv": str(ref.parents[1]), "dists": [{"name": n} for n in names],
                                     "wheelhouse": [str(world["house"])],
                                     "commands": {"smoke": commands.smoke(str(ref))}}, tmp_path / "refstate",
                  env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")})["dists"]
    ref_d = dict(versions(ref))
    tgt_d = {n: v for n, v in versions(tgt).items() if n in names}
    plan = make_plan(_facts("ref", {n: ref_d[n] for n in names}), _facts("tgt", tgt_d), ["provtest-*"], scan)
    assert [i.name for i in plan.installs] == sorted(names) and not plan.blocked, plan.blockers
    host = Host("tgt", "127.0.0.1", "root", 22, (), vars={"venv": str(tgt.parents[1])})
    state = tmp_path / "state"
    for n in names:
        stage(state, w[n.removeprefix("provtest-")])
    payload = overlay.apply_payload(host, plan, "smoke1", str(state))
    return plan, result("provision.apply", payload, state, lock=once())


def test_a_module_failing_on_the_reference_too_is_a_warning_and_the_apply_succeeds(world, tmp_path):
    plan, out = _provision(world, tmp_path, ["provtest-alpha", "provtest-anth"])
    why = "ModuleNotFoundError: No module named 'provtest_httpx2'"
    assert plan.reference_smoke == {"provtest_alpha": None, "provtest_anth": why}
    assert [w.message for w in plan.warnings if w.code == "reference-smoke"] == [
        f"fails on the reference too: provtest_anth ({why})"]
    assert out["ok"], out
    assert out["warnings"] == [f"fails on the reference too: provtest_anth ({why})"]
    assert out["smoke"] == {"imported": ["provtest_alpha"], "failed_on_both": {"provtest_anth": why}, "failed": {}}
    smoke_step = [s for s in out["steps"] if s["step"] == "smoke"][0]
    assert "alpha says hello" in smoke_step["output"]                      # what modules print is kept apart
    now = versions(world["tgt"])
    assert now["provtest-alpha"] == "2.0" and now["provtest-anth"] == "2.0"


def test_a_module_failing_on_the_target_only_restores_the_backup(world, tmp_path):
    plan, out = _provision(world, tmp_path, ["provtest-alpha", "provtest-delta"])
    assert plan.reference_smoke == {"provtest_alpha": None, "provtest_delta": None}
    assert not [w for w in plan.warnings if w.code == "reference-smoke"]
    assert not out["ok"] and out["restored"] is True, out
    assert out["error"] == ("smoke import failed on the target, not on the reference: provtest_delta "
                            "(ModuleNotFoundError: No module named 'helper_refonly')")
    now = versions(world["tgt"])
    assert now["provtest-alpha"] == "1.0" and now["provtest-delta"] == "1.0"   # restored from the backup


def test_apply_refuses_a_malformed_reference_map_before_anything_changes(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    state = tmp_path / "state"
    before = versions(tgt)
    payload = overlay.apply_payload(Host("tgt", "127.0.0.1", "root", 22, (), vars={"venv": str(tgt.parents[1])}),
                                    _plan_for(stage(state, w["alpha"])), "bad1", str(state))
    payload["reference_smoke"] = {"provtest_alpha": 3}
    fin, _r, _p = call("provision.apply", payload, state, lock=once())
    assert fin["kind"] == "bad-request" and "reference_smoke" in fin["error"], fin
    assert versions(tgt) == before and not (state / "provision" / "backups").exists()


def _plan_for(item):
    from deploy.provision.plan import Item, Plan
    plan = Plan("tgt", "ref", [Item(item["name"], "other-version", item["version"], "1.0")])
    plan.sources[item["name"]] = {"sha256": item["sha256"], "filename": item["filename"]}
    return plan


def test_scan_without_the_smoke_command_runs_no_import(world, tmp_path):
    scan = result("provision.scan", {"venv": str(world["ref"].parents[1]), "dists": [{"name": "provtest-anth"}]},
                  tmp_path / "s", env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")})["dists"]
    assert "smoke" not in scan["provtest-anth"]
    assert Path(scan["provtest-anth"]["dist_info"]).is_dir()


def test_a_reference_venv_root_must_not_run_is_not_smoked_and_says_why(world, tmp_path):
    ref = world["ref"]
    site = next(Path(ref.parents[1]).glob("lib/python3*/site-packages"))
    mode = site.stat().st_mode
    site.chmod(mode | 0o020)
    try:
        scan = result("provision.scan", {"venv": str(ref.parents[1]), "dists": [{"name": "provtest-anth"}],
                                         "commands": {"smoke": commands.smoke(str(ref))}}, tmp_path / "s",
                      env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home")})["dists"]
    finally:
        site.chmod(mode)
    err = scan["provtest-anth"]["smoke"]["error"]
    assert err.startswith(f"root will not run {ref}") and "writable by group" in err
