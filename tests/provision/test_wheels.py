"""RECORD repacking, drift detection, original-wheel matching, and the apply/restore/undo agent,
all with real setuptools wheels, real venvs and real pip (no hosts)."""
from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from deploy.provision import agent as agentmod
from deploy.provision.cache import WheelCache
from deploy.provision.wheels import WheelError, check_wheel

from provhelpers import agent, build_wheel, make_project, make_venv, pip, rewrite_wheel, versions


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two venvs with pip (a 'reference' and a 'target') and a few real wheels."""
    root = tmp_path_factory.mktemp("prov")
    wheels = root / "wheels"
    w = {
        "a1": build_wheel(make_project(root, "provtest-alpha", "1.0+cu130"), wheels),
        "a0": build_wheel(make_project(root, "provtest-alpha", "1.0+cu128"), wheels),
        "b2": build_wheel(make_project(root, "provtest-beta", "2.0"), wheels),
        "b1": build_wheel(make_project(root, "provtest-beta", "1.0"), wheels),
    }
    return {"root": root, "wheels": w, "ref": make_venv(root / "ref"), "tgt": make_venv(root / "tgt")}


def _record_rows(whl):
    with zipfile.ZipFile(whl) as zf:
        (rec,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        return {p: h for p, h, _s in agentmod.parse_record(zf.read(rec).decode()) if h}


def test_repack_reproduces_the_original_wheel(world, tmp_path):
    ref = world["ref"]
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["a1"]))
    out = agent(ref, "build", {"dists": [{"name": "provtest-alpha"}], "built_dir": str(tmp_path / "built")})
    r = out["dists"]["provtest-alpha"]
    assert r["drift"] == [] and r["filename"] == "provtest_alpha-1.0+cu130-py3-none-any.whl"
    info = check_wheel(r["path"])
    assert info["version"] == "1.0+cu130"
    # every file of the original wheel is in the rebuilt one with the same hash (scripts aside: both #!python)
    orig, rebuilt = _record_rows(world["wheels"]["a1"]), _record_rows(r["path"])
    assert orig == rebuilt
    # deterministic: the same installed files give the same bytes
    again = agent(ref, "build", {"dists": [{"name": "provtest-alpha"}], "built_dir": str(tmp_path / "b2")})
    assert again["dists"]["provtest-alpha"]["sha256"] == r["sha256"]


def test_rebuilt_wheel_installs_and_verifies_clean(world, tmp_path):
    ref, tgt = world["ref"], world["tgt"]
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["b2"]))
    r = agent(ref, "build", {"dists": [{"name": "provtest-beta"}], "built_dir": str(tmp_path)})["dists"]["provtest-beta"]
    p = pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", r["path"])
    assert p.returncode == 0
    assert pip(tgt, "check").returncode == 0
    scan = agent(tgt, "scan", {"dists": [{"name": "provtest-beta", "version": "2.0"}]})["dists"]["provtest-beta"]
    assert scan["drift"] == [] and scan["installed_bytes"] > 2048
    venv = tgt.parent.parent
    assert (venv / "bin" / "provtest_beta-tool").read_text().startswith(f"#!{venv}/bin/python")
    assert (venv / "bin" / "provtest_beta-cli").exists()        # regenerated from entry_points.txt
    assert (venv / "share" / "provtest_beta" / "provtest_beta.txt").read_text() == "data\n"


def test_scan_finds_the_original_wheel_by_hash_and_reports_drift(world, tmp_path):
    ref = world["ref"]
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["a1"]))
    house = tmp_path / "house"
    house.mkdir()
    # a decoy with the same name and version but other content must not be taken for the original
    decoy = build_wheel(make_project(tmp_path, "provtest-alpha", "1.0+cu130", body="VALUE = 2\n"), tmp_path / "d")
    (house / "sub").mkdir()
    (house / "sub" / decoy.name).write_bytes(decoy.read_bytes())
    s = agent(ref, "scan", {"dists": [{"name": "provtest-alpha"}], "wheelhouse": [str(house)]})["dists"]
    assert s["provtest-alpha"]["source"] is None
    (house / world["wheels"]["a1"].name).write_bytes(world["wheels"]["a1"].read_bytes())
    (house / "sub" / decoy.name).unlink()
    s = agent(ref, "scan", {"dists": [{"name": "provtest-alpha"}], "wheelhouse": [str(house)]})["dists"]
    src = s["provtest-alpha"]["source"]
    assert src["kind"] == "original" and src["sha256"] == agentmod.sha256_file(world["wheels"]["a1"])
    # patch an installed file by hand: drift is reported and the original is no longer offered
    site = Path(s["provtest-alpha"]["dist_info"]).parent
    (site / "provtest_alpha" / "__init__.py").write_text("PATCHED = True\n")
    s = agent(ref, "scan", {"dists": [{"name": "provtest-alpha"}], "wheelhouse": [str(house)]})["dists"]
    assert s["provtest-alpha"]["drift"] == [{"path": "provtest_alpha/__init__.py", "problem": "modified"}]
    assert s["provtest-alpha"]["source"] is None
    b = agent(ref, "build", {"dists": [{"name": "provtest-alpha"}], "built_dir": str(tmp_path / "b")})
    whl = b["dists"]["provtest-alpha"]
    assert whl["drift"] and check_wheel(whl["path"])         # the rebuilt wheel is valid, carrying the patch
    with zipfile.ZipFile(whl["path"]) as zf:
        assert zf.read("provtest_alpha/__init__.py") == b"PATCHED = True\n"


def test_check_wheel_rejects_tampering(world, tmp_path):
    bad = tmp_path / world["wheels"]["b1"].name
    with zipfile.ZipFile(world["wheels"]["b1"]) as src, zipfile.ZipFile(bad, "w") as dst:
        for n in src.namelist():
            data = src.read(n)
            dst.writestr(n, b"tampered" if n.endswith("__init__.py") else data)
    with pytest.raises(WheelError, match="RECORD hash"):
        check_wheel(bad)


def _stage(root: Path, whl: Path) -> dict:
    sha = agentmod.sha256_file(whl)
    d = root / "incoming" / sha
    d.mkdir(parents=True, exist_ok=True)
    (d / whl.name).write_bytes(whl.read_bytes())
    nv = agentmod.parse_wheel_filename(whl.name)
    return {"name": nv[0], "version": nv[1], "sha256": sha, "filename": whl.name}


def _payload(py, root, install, remove=(), pid="t1"):
    paths = [str(root / "incoming" / w["sha256"] / w["filename"]) for w in install]
    return {"id": pid, "root": str(root), "python": str(py), "install": install, "remove": list(remove),
            "pip_install": agentmod.pip_install_argv(str(py), paths),
            "pip_uninstall": agentmod.pip_uninstall_argv(str(py), list(remove)), "cuda_init": False}


def test_apply_then_undo_restores_exactly(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", str(w["a0"]), str(w["b1"]))
    pip(tgt, "uninstall", "-y", "provtest-gamma")
    before = versions(tgt)
    root = tmp_path / "stage"
    gamma = build_wheel(make_project(tmp_path, "provtest-gamma", "0.1"), tmp_path / "g")
    install = [_stage(root, w["a1"]), _stage(root, gamma)]
    out = agent(tgt, "apply", _payload(tgt, root, install, remove=["provtest-beta"]))
    assert out["ok"], out
    now = versions(tgt)
    assert now["provtest-alpha"] == "1.0+cu130" and now["provtest-gamma"] == "0.1" and "provtest-beta" not in now
    assert set(out["smoke_modules"]) == {"provtest_alpha", "provtest_gamma"}
    manifest = json.loads((Path(out["backup"]) / "manifest.json").read_text())
    assert manifest["before"] == {"provtest-alpha": "1.0+cu128", "provtest-beta": "1.0", "provtest-gamma": None}
    u = agent(tgt, "undo", {"root": str(root)})
    assert u["ok"], u
    assert versions(tgt) == before
    scan = agent(tgt, "scan", {"dists": [{"name": "provtest-alpha"}, {"name": "provtest-beta"}]})["dists"]
    assert scan["provtest-alpha"]["drift"] == [] and scan["provtest-beta"]["drift"] == []
    assert agent(tgt, "undo", {"root": str(root)})["ok"] is False      # nothing left to undo


def test_pip_failing_half_way_restores_the_backup(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", str(w["a0"]), str(w["b1"]))
    before = versions(tgt)
    root = tmp_path / "stage"
    # a wheel pip cannot install: its console script entry point has no callable. pip installs in
    # reverse name order, so beta and alpha are replaced before pip stops in the middle of this one
    # (leaving it half installed: its files are in place, its scripts are not)
    good = build_wheel(make_project(tmp_path, "provtest-0broken", "1.0"), tmp_path / "z")
    broken = rewrite_wheel(good, {"provtest_0broken-1.0.dist-info/entry_points.txt":
                                  b"[console_scripts]\nprovtest_0broken-cli = provtest_0broken:\n"}, tmp_path / "zz")
    install = [_stage(root, broken), _stage(root, w["a1"]), _stage(root, w["b2"])]
    out = agent(tgt, "apply", _payload(tgt, root, install, pid="fail1"))
    assert not out["ok"] and out["restored"] is True, out
    assert "pip install failed" in out["error"]
    steps = [s["step"] for s in out["steps"]]
    assert steps == ["install", "restore-uninstall", "restore-install"]
    assert "Successfully installed provtest-alpha" not in out["steps"][0]["output"]
    assert versions(tgt) == before
    scan = agent(tgt, "scan", {"dists": [{"name": "provtest-alpha"}, {"name": "provtest-beta"}]})["dists"]
    assert scan["provtest-alpha"]["drift"] == [] and scan["provtest-beta"]["drift"] == []


def test_apply_refuses_a_corrupted_staged_wheel(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    root = tmp_path / "stage"
    item = _stage(root, w["a1"])
    p = root / "incoming" / item["sha256"] / item["filename"]
    p.write_bytes(p.read_bytes()[:-10])
    before = versions(tgt)
    out = agent(tgt, "apply", _payload(tgt, root, [item]))
    assert not out["ok"] and "sha256" in out["error"] and versions(tgt) == before


def test_finalize_renames_good_parts_and_drops_bad_ones(world, tmp_path):
    root = tmp_path / "stage"
    good, bad = world["wheels"]["a1"], world["wheels"]["b1"]
    for whl, data in ((good, good.read_bytes()), (bad, bad.read_bytes()[:100])):
        sha = agentmod.sha256_file(whl)
        d = root / "incoming" / sha
        d.mkdir(parents=True)
        (d / (whl.name + ".part")).write_bytes(data)
    ws = [{"sha256": agentmod.sha256_file(x), "filename": x.name} for x in (good, bad)]
    out = agent(world["tgt"], "finalize", {"root": str(root), "wheels": ws})["wheels"]
    assert out == {ws[0]["sha256"]: "ok", ws[1]["sha256"]: "bad-hash"}
    st = agent(world["tgt"], "stage", {"root": str(root)})
    assert list(st["staged"]) == [ws[0]["sha256"]] and st["parts"] == {}


def test_cache_refuses_a_corrupted_wheel(world, tmp_path):
    cache = WheelCache(tmp_path / "cache")
    whl = world["wheels"]["a1"]
    sha = agentmod.sha256_file(whl)
    p = cache.add_file(whl)
    assert cache.get(sha) == p
    cache2 = WheelCache(tmp_path / "cache")            # a new run: nothing remembered, hash checked again
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    assert cache2.get(sha) is None and not p.exists()
    assert any("corrupted" in e for e in cache2.events)


def test_pip_argv_is_offline_and_exact():
    argv = agentmod.pip_install_argv("/v/bin/python", ["/s/a.whl"])
    assert argv[:4] == ["/v/bin/python", "-m", "pip", "install"]
    assert {"--no-index", "--no-deps", "--force-reinstall"} <= set(argv) and argv[-1] == "/s/a.whl"


def test_agent_fits_in_one_argument():
    from deploy.provision.overlay import AGENT_SOURCE, agent_argv
    argv = agent_argv("/v/bin/python", "scan", {"dists": [{"name": "torch"}] * 50})
    assert all(len(a.encode()) < 128 * 1024 for a in argv)   # MAX_ARG_STRLEN on Linux
    assert argv[2] == AGENT_SOURCE
