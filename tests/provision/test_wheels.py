"""RECORD repacking, drift detection, original-wheel matching, and the provision ops (scan, build, receive, apply,
undo), all with real setuptools wheels, real venvs and real pip -- run through the real agent (the loader under the
system python3, the zipapp, a private state directory), no hosts."""
from __future__ import annotations

import hashlib

import os
import zipfile
from pathlib import Path

import pytest

from agenthelpers import call, once, result
from deploy.provision.cache import CacheError, WheelCache
from deploy.provision.wheels import WheelError, check_wheel
from deploy.remote import client, commands
from deploy.remote.host import wheels as W
from deploy.remote.host.fsutil import sha256_file

from provhelpers import apply_args, build_wheel, make_project, make_venv, pip, rewrite_wheel, stage, versions


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


def venv_of(py: Path) -> str:
    return str(py.parents[1])


def _record_rows(whl):
    with zipfile.ZipFile(whl) as zf:
        (rec,) = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
        return {p: h for p, h, _s in W.parse_record(zf.read(rec).decode()) if h}


def build(py, state, *names):
    return result("provision.build", {"venv": venv_of(py), "dists": [{"name": n} for n in names]}, state,
                  lock=once())["dists"]


def scan(py, state, names, house=None):
    return result("provision.scan", {"venv": venv_of(py), "dists": [{"name": n} for n in names],
                                     "wheelhouse": [str(house)] if house else []}, state,
                  env={"PATH": "/usr/bin:/bin", "HOME": str(state.parent / "home")})["dists"]


def test_repack_reproduces_the_original_wheel(world, tmp_path):
    ref = world["ref"]
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["a1"]))
    r = build(ref, tmp_path / "s1", "provtest-alpha")["provtest-alpha"]
    assert r["drift"] == [] and r["filename"] == "provtest_alpha-1.0+cu130-py3-none-any.whl"
    assert r["path"].startswith(str(tmp_path / "s1" / "provision" / "built"))   # in the private state only
    info = check_wheel(r["path"])
    assert info["version"] == "1.0+cu130"
    # every file of the original wheel is in the rebuilt one with the same hash (scripts aside: both #!python)
    assert _record_rows(world["wheels"]["a1"]) == _record_rows(r["path"])
    # deterministic: the same installed files give the same bytes
    assert build(ref, tmp_path / "s2", "provtest-alpha")["provtest-alpha"]["sha256"] == r["sha256"]


def test_a_file_of_exactly_32_bytes_is_hashed_not_taken_for_a_digest(world, tmp_path):
    """A 32-byte file is data like any other (jedi 0.20.1 ships one: a typeshed stub): its RECORD hash is its
    sha256, and the rebuilt wheel passes its own check (a provision on the GPU lab once refused jedi for this)."""
    data = b"def read_chart(chartspace): ...\n"
    assert len(data) == 32
    assert W.record_hash(data) == W.record_digest(hashlib.sha256(data).digest())
    ref = world["ref"]
    whl = build_wheel(make_project(tmp_path, "provtest-gamma", "1.0", body="X = 1\n"), tmp_path / "w")
    whl = rewrite_wheel(whl, {}, tmp_path / "w2", extra={"provtest_gamma/stub32.pyi": data})
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(whl))
    r = build(ref, tmp_path / "s", "provtest-gamma")["provtest-gamma"]
    assert r["drift"] == []
    check_wheel(r["path"])  # raises on a member that does not match its RECORD


def test_rebuilt_wheel_installs_and_verifies_clean(world, tmp_path):
    ref, tgt = world["ref"], world["tgt"]
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["b2"]))
    r = build(ref, tmp_path / "s", "provtest-beta")["provtest-beta"]
    assert pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", r["path"]).returncode == 0
    assert pip(tgt, "check").returncode == 0
    s = scan(tgt, tmp_path / "s2", ["provtest-beta"])["provtest-beta"]
    assert s["drift"] == [] and s["installed_bytes"] > 2048
    venv = tgt.parent.parent
    assert (venv / "bin" / "provtest_beta-tool").read_text().startswith(f"#!{venv}/bin/python")
    assert (venv / "bin" / "provtest_beta-cli").exists()        # regenerated from entry_points.txt
    assert (venv / "share" / "provtest_beta" / "provtest_beta.txt").read_text() == "data\n"


def test_scan_finds_the_original_wheel_by_hash_and_reports_drift(world, tmp_path):
    ref = world["ref"]
    state = tmp_path / "state"
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["a1"]))
    house = tmp_path / "house"
    house.mkdir()
    # a decoy with the same name and version but other content must not be taken for the original
    decoy = build_wheel(make_project(tmp_path, "provtest-alpha", "1.0+cu130", body="VALUE = 2\n"), tmp_path / "d")
    (house / "sub").mkdir()
    (house / "sub" / decoy.name).write_bytes(decoy.read_bytes())
    assert scan(ref, state, ["provtest-alpha"], house)["provtest-alpha"]["source"] is None
    (house / world["wheels"]["a1"].name).write_bytes(world["wheels"]["a1"].read_bytes())
    (house / "sub" / decoy.name).unlink()
    s = scan(ref, state, ["provtest-alpha"], house)
    src = s["provtest-alpha"]["source"]
    assert src["kind"] == "original" and src["sha256"] == sha256_file(str(world["wheels"]["a1"]))
    # patch an installed file by hand: drift is reported and the original is no longer offered
    site = Path(s["provtest-alpha"]["dist_info"]).parent
    (site / "provtest_alpha" / "__init__.py").write_text("PATCHED = True\n")
    s = scan(ref, state, ["provtest-alpha"], house)
    assert s["provtest-alpha"]["drift"] == [{"path": "provtest_alpha/__init__.py", "problem": "modified"}]
    assert s["provtest-alpha"]["source"] is None
    whl = build(ref, state, "provtest-alpha")["provtest-alpha"]
    assert whl["drift"] and check_wheel(whl["path"])         # the rebuilt wheel is valid, carrying the patch
    with zipfile.ZipFile(whl["path"]) as zf:
        assert zf.read("provtest_alpha/__init__.py") == b"PATCHED = True\n"


def test_scan_never_offers_a_planted_built_wheel(world, tmp_path):
    """Issue 9: a built.json planted in the staging area (names a '../' path, or a wheel that is not the installed
    files) was offered as 'rebuilt' and installed as root on every target. Now the built directory is private and
    what is there is checked against the installed RECORD before it is offered."""
    ref = world["ref"]
    state = tmp_path / "state"
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(world["wheels"]["a1"]))
    key = scan(ref, state, ["provtest-alpha"])["provtest-alpha"]["record_sha256"]
    bdir = state / "provision" / "built" / key
    bdir.mkdir(parents=True, mode=0o700)
    (state / "provision").chmod(0o700)
    (state / "provision" / "built").chmod(0o700)
    evil = rewrite_wheel(world["wheels"]["a1"], {"provtest_alpha/__init__.py": b"import os  # planted\n"},
                         tmp_path / "evil", extra={"evil.pth": b"import os; os.system('touch /tmp/owned')\n"})
    (bdir / evil.name).write_bytes(evil.read_bytes())
    for filename in ("../../../../etc/cron.d/x.whl", evil.name):
        (bdir / "built.json").write_text(
            '{"filename": "%s", "sha256": "%s", "size": %d}' % (filename, sha256_file(str(evil)), evil.stat().st_size))
        assert scan(ref, state, ["provtest-alpha"])["provtest-alpha"]["source"] is None
    # the genuine rebuild is offered again (and checked, not trusted)
    good = build(ref, state, "provtest-alpha")["provtest-alpha"]
    assert scan(ref, state, ["provtest-alpha"])["provtest-alpha"]["source"]["sha256"] == good["sha256"]


def test_check_wheel_rejects_tampering(world, tmp_path):
    bad = tmp_path / world["wheels"]["b1"].name
    with zipfile.ZipFile(world["wheels"]["b1"]) as src, zipfile.ZipFile(bad, "w") as dst:
        for n in src.namelist():
            data = src.read(n)
            dst.writestr(n, b"tampered" if n.endswith("__init__.py") else data)
    with pytest.raises(WheelError, match="RECORD hash"):
        check_wheel(bad)


def test_check_wheel_refuses_a_stray_pth_and_unsafe_members(world, tmp_path):
    whl = rewrite_wheel(world["wheels"]["b1"], {}, tmp_path / "p", extra={"zz_evil.pth": b"import os\n"})
    with pytest.raises(WheelError, match=r"zz_evil\.pth.*every interpreter start"):
        check_wheel(whl)
    assert check_wheel(whl, allow_pth=["zz_evil.pth"])["pth"] == ["zz_evil.pth"]   # one the dist really installs
    bad = rewrite_wheel(world["wheels"]["b1"], {}, tmp_path / "q", extra={"../escape.py": b"x = 1\n"})
    with pytest.raises(WheelError, match="safe relative path"):
        check_wheel(bad)


def test_wheel_names_are_matched_whole():
    assert W.parse_wheel_filename("torch-2.11.0+cu130-cp311-cp311-linux_x86_64.whl") == ("torch", "2.11.0+cu130")
    for bad in ("../../../../etc/cron.d/x-1.0-py3-none-any.whl", "a/b-1.0-py3-none-any.whl",
                "x-1.0-py3-none-any.whl\n", ".x-1.0-py3-none-any.whl", "x-1.0-py3-none-any.whl/..", "x.whl",
                "x-1 0-py3-none-any.whl", "-1.0-py3-none-any.whl"):
        assert W.parse_wheel_filename(bad) is None, bad


def test_wheel_matches_installed_rejects_a_changed_file_and_an_extra_pth(world, tmp_path):
    """Issue 9: wheel_matches_installed accepted a wheel with a changed file (RECORD left as it was) and one with an
    extra .pth member; either would have been shipped as 'the original' and installed as root."""
    ref = world["ref"]
    orig = world["wheels"]["a1"]
    pip(ref, "install", "--no-index", "--no-deps", "--force-reinstall", str(orig))
    di = Path(scan(ref, tmp_path / "s", ["provtest-alpha"])["provtest-alpha"]["dist_info"])
    assert W.wheel_matches_installed(str(orig), str(di))
    changed = tmp_path / "changed" / orig.name
    changed.parent.mkdir()
    with zipfile.ZipFile(orig) as src, zipfile.ZipFile(changed, "w") as dst:   # RECORD untouched: old hashes
        for n in src.namelist():
            dst.writestr(n, b"import os  # changed\n" if n == "provtest_alpha/__init__.py" else src.read(n))
    assert not W.wheel_matches_installed(str(changed), str(di))
    stray = tmp_path / "stray" / orig.name
    stray.parent.mkdir()
    with zipfile.ZipFile(orig) as src, zipfile.ZipFile(stray, "w") as dst:     # an unlisted extra member
        for n in src.namelist():
            dst.writestr(n, src.read(n))
        dst.writestr("evil.pth", b"import os\n")
    assert not W.wheel_matches_installed(str(stray), str(di))
    listed = rewrite_wheel(orig, {}, tmp_path / "listed", extra={"evil.pth": b"import os\n"})  # listed, hashed
    assert not W.wheel_matches_installed(str(listed), str(di))


def test_apply_then_undo_restores_exactly(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    state = tmp_path / "state"
    pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", str(w["a0"]), str(w["b1"]))
    pip(tgt, "uninstall", "-y", "provtest-gamma")
    before = versions(tgt)
    gamma = build_wheel(make_project(tmp_path, "provtest-gamma", "0.1"), tmp_path / "g")
    install = [stage(state, w["a1"]), stage(state, gamma)]
    out = result("provision.apply", apply_args(tgt, install, remove=["provtest-beta"]), state, lock=once())
    assert out["ok"], out
    now = versions(tgt)
    assert now["provtest-alpha"] == "1.0+cu130" and now["provtest-gamma"] == "0.1" and "provtest-beta" not in now
    assert set(out["smoke_modules"]) == {"provtest_alpha", "provtest_gamma"}
    assert out["backup"].startswith(str(state / "provision" / "backups"))
    manifest = result("provision.backups", {}, state)["backups"][-1]
    assert manifest["before"] == {"provtest-alpha": "1.0+cu128", "provtest-beta": "1.0", "provtest-gamma": None}
    undo = dict(apply_args(tgt, []), id=None)
    u = result("provision.undo", undo, state, lock=once())
    assert u["ok"], u
    assert versions(tgt) == before
    s = scan(tgt, tmp_path / "s2", ["provtest-alpha", "provtest-beta"])
    assert s["provtest-alpha"]["drift"] == [] and s["provtest-beta"]["drift"] == []
    assert result("provision.undo", undo, state, lock=once())["ok"] is False      # nothing left to undo


def test_pip_failing_half_way_restores_the_backup(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    state = tmp_path / "state"
    pip(tgt, "install", "--no-index", "--no-deps", "--force-reinstall", str(w["a0"]), str(w["b1"]))
    before = versions(tgt)
    # a wheel pip cannot install: its console script entry point has no callable. pip installs in
    # reverse name order, so beta and alpha are replaced before pip stops in the middle of this one
    # (leaving it half installed: its files are in place, its scripts are not)
    good = build_wheel(make_project(tmp_path, "provtest-0broken", "1.0"), tmp_path / "z")
    broken = rewrite_wheel(good, {"provtest_0broken-1.0.dist-info/entry_points.txt":
                                  b"[console_scripts]\nprovtest_0broken-cli = provtest_0broken:\n"}, tmp_path / "zz")
    install = [stage(state, broken), stage(state, w["a1"]), stage(state, w["b2"])]
    out = result("provision.apply", apply_args(tgt, install, pid="fail1"), state, lock=once())
    assert not out["ok"] and out["restored"] is True, out
    assert "pip install failed" in out["error"]
    assert [s["step"] for s in out["steps"]] == ["install", "restore-uninstall", "restore-install"]
    assert "Successfully installed provtest-alpha" not in out["steps"][0]["output"]
    assert versions(tgt) == before
    s = scan(tgt, tmp_path / "s2", ["provtest-alpha", "provtest-beta"])
    assert s["provtest-alpha"]["drift"] == [] and s["provtest-beta"]["drift"] == []


def test_apply_refuses_a_corrupted_staged_wheel(world, tmp_path):
    tgt, w = world["tgt"], world["wheels"]
    state = tmp_path / "state"
    item = stage(state, w["a1"])
    p = state / "provision" / "incoming" / item["sha256"] / item["filename"]
    p.write_bytes(p.read_bytes()[:-10])
    before = versions(tgt)
    fin, _r, _p = call("provision.apply", apply_args(tgt, [item]), state, lock=once())
    assert fin["kind"] == "bad-wheel" and "sha256" in fin["error"] and versions(tgt) == before


def test_apply_checks_record_hashes_before_install(world, tmp_path):
    """A staged wheel whose sha256 is the one asked for but whose members do not match its RECORD (sent by a
    compromised cache) is refused before pip runs."""
    tgt, w = world["tgt"], world["wheels"]
    state = tmp_path / "state"
    bad = tmp_path / "bad" / w["a1"].name
    bad.parent.mkdir()
    with zipfile.ZipFile(w["a1"]) as src, zipfile.ZipFile(bad, "w") as dst:
        for n in src.namelist():
            dst.writestr(n, b"import os\n" if n == "provtest_alpha/__init__.py" else src.read(n))
    before = versions(tgt)
    fin, _r, _p = call("provision.apply", apply_args(tgt, [stage(state, bad)]), state, lock=once())
    assert fin["kind"] == "bad-wheel" and "RECORD" in fin["error"], fin
    assert versions(tgt) == before


def test_apply_refuses_a_group_writable_venv(world, tmp_path):
    """Issue 9: root ran {venv}/bin/python (pip, the smoke import) with no look at who can write the venv; a
    group-writable site-packages lets that group run code as root. Now nothing runs and nothing changes."""
    tgt, w = world["tgt"], world["wheels"]
    state = tmp_path / "state"
    site = next(Path(venv_of(tgt)).glob("lib/python3*/site-packages"))
    before = versions(tgt)
    mode = site.stat().st_mode
    site.chmod(mode | 0o020)
    try:
        fin, _r, _p = call("provision.apply", apply_args(tgt, [stage(state, w["a1"])]), state, lock=once())
    finally:
        site.chmod(mode)
    assert fin["kind"] == "unsafe-venv" and "writable by group" in fin["error"] and "nothing changed" in fin["error"]
    assert versions(tgt) == before
    assert not (state / "provision" / "backups").exists()        # refused before even the backup


def test_a_change_without_the_lock_is_refused(world, tmp_path):
    fin, _r, _p = call("provision.apply", apply_args(world["tgt"], []), tmp_path / "state")
    assert fin["kind"] == "no-lock"
    fin, _r, _p = call("provision.apply", apply_args(world["tgt"], []), tmp_path / "state",
                       lock={"token": "t" * 32, "mode": "held"})
    assert fin["kind"] == "lock-lost"                              # a held lock that was never taken


def test_receive_resumes_checks_on_arrival_and_refuses_unsafe_paths(world, tmp_path):
    state = tmp_path / "state"
    whl, other = world["wheels"]["a1"], world["wheels"]["b1"]
    data, sha = whl.read_bytes(), sha256_file(str(whl))
    held = {"token": "r" * 32, "mode": "held"}
    result("lock.acquire", {"token": held["token"], "holder": "t", "command": "pytest"}, state)
    one = {"sha256": sha, "filename": whl.name, "size": len(data)}
    half = len(data) // 2

    def receive(*wheels, data, **kw):
        return result("provision.receive", {"wheels": list(wheels)}, state, lock=held, data=data, **kw)["wheels"]
    assert receive(dict(one, offset=0), data=data[:half]) == {sha: {"status": "partial", "have": half}}
    st = result("facts.probe", {"staged": True, "budget": 5}, state)["stage"]
    assert st["parts"] == {sha: {"filename": whl.name, "size": half}} and st["staged"] == {}
    # the rest of it and a second wheel in the same stream; the wrong bytes under a name are deleted on arrival
    odata = other.read_bytes()
    out = receive(dict(one, offset=half), {"sha256": "0" * 64, "filename": other.name, "size": len(odata)},
                  data=data[half:] + odata)
    assert out[sha]["status"] == "ok" and out["0" * 64]["status"] == "bad-hash"
    assert (state / "provision" / "incoming" / sha / whl.name).read_bytes() == data
    assert not any((state / "provision" / "incoming" / ("0" * 64)).iterdir())
    # a '../' name never becomes a path, and nothing of the stream is read
    fin, _r, _p = call("provision.receive", {"wheels": [dict(one, filename="../../../../tmp/x-1.0-py3-none-any.whl")]},
                       state, lock=held, data=data)
    assert fin["type"] == "error" and "not a wheel file name" in fin["error"]
    # a symlink planted where the upload goes is refused, its target untouched
    victim = tmp_path / "victim"
    victim.write_text("keep")
    d = state / "provision" / "incoming" / ("1" * 64)
    d.mkdir(mode=0o700)
    (d / (whl.name + ".part")).symlink_to(victim)
    fin, _r, _p = call("provision.receive", {"wheels": [dict(one, sha256="1" * 64, offset=0)]}, state, lock=held,
                       data=data)
    assert fin["kind"] == "unsafe" and "symbolic link" in fin["error"] and victim.read_text() == "keep"


def test_send_streams_several_wheels_and_refuses_non_wheels(world, tmp_path):
    state = tmp_path / "state"
    a, b = world["wheels"]["a1"], world["wheels"]["b1"]
    fin, _r, p = call("provision.send", {"files": [{"path": str(a), "offset": 10}, {"path": str(b)}]}, state,
                      raw=True)
    assert fin["type"] != "error" and p.returncode == 0 and p.stdout == a.read_bytes()[10:] + b.read_bytes()
    fin, _r, p = call("provision.send", {"files": [{"path": "/etc/shadow"}]}, state, raw=True)
    assert fin["type"] == "error" and p.stdout == b""


def test_loader_refuses_an_unsafe_state_directory(tmp_path):
    """The agent's state directory is checked with lstat before anything runs from it."""
    target = tmp_path / "real"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o770)
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    os.chown(foreign, 65534, 65534)
    for state, why in ((link, "symbolic link"), (loose, "must be a 0700 directory"), (foreign, "owned by uid 65534")):
        fin, _r, _p = call("facts.probe", {"budget": 5}, state)
        assert fin["kind"] == "agent-state" and why in fin["error"], (state, fin)
        assert not list(Path(state).glob("agent-*.pyz"))


def test_cache_refuses_a_corrupted_wheel_and_an_unsafe_name(world, tmp_path):
    cache = WheelCache(tmp_path / "cache")
    whl = world["wheels"]["a1"]
    sha = sha256_file(str(whl))
    p = cache.add_file(whl)
    assert cache.get(sha) == p
    cache2 = WheelCache(tmp_path / "cache")            # a new run: nothing remembered, hash checked again
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    assert cache2.get(sha) is None and not p.exists()
    assert any("corrupted" in e for e in cache2.events)
    with pytest.raises(CacheError, match="not a wheel file name"):
        cache.part_path(sha, "../../../../etc/cron.d/x-1.0-py3-none-any.whl")
    assert not (tmp_path / "etc").exists()
    stray = rewrite_wheel(whl, {}, tmp_path / "s", extra={"evil.pth": b"import os\n"})
    with pytest.raises(CacheError, match="evil.pth"):
        cache.add_file(stray)
    assert cache.get(sha256_file(str(stray))) is None


def test_pip_argv_is_offline_isolated_and_exact():
    argv = commands.pip_install("/v/bin/python", ["/s/a.whl"])
    assert argv[:4] == ["/v/bin/python", "-m", "pip", "install"]
    assert {"--isolated", "--no-index", "--no-deps", "--force-reinstall"} <= set(argv) and argv[-1] == "/s/a.whl"
    assert "--isolated" in commands.pip_uninstall("/v/bin/python", ["x"])


def test_only_the_loader_travels_in_argv():
    """Issue 9: ~30 KB of agent source travelled in argv on every call. Now argv holds the ~6 KB loader, the state
    directory and the zipapp's hash; the request goes on stdin."""
    from deploy.remote import zipapp
    argv = client.loader_argv("/var/lib/ddtree", zipapp.build().sha256)
    assert len(" ".join(argv).encode()) < 8000           # was ~30 KB of agent source
    assert argv[-1] == zipapp.build().sha256 and argv[-2] == "/var/lib/ddtree"
    assert "def repack" not in argv[4] and "def gate" not in argv[4]
    compile(argv[4], "<loader>", "exec")                      # the stripped loader is still the loader
    cmd = client.command_line(argv, "deploy", root=True)
    assert cmd.startswith("sudo -n -- python3 -I -S -c ")
    assert client.command_line(argv, "deploy", root=False).startswith("python3 ")
