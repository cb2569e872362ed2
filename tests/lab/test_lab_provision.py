"""`provision` on the lab's real hosts (real sshd, SFTP, pip): the faults of issue 3.

Isolation: these tests never touch the shared /opt/sglang/venv. They create their own venvs
(/opt/provtest/venv on ct129 and ct200), their own agent state directory (staging, backups, lock), and their
own control-side cache, and remove them at the end. The managed set is `provtest-*`.
"""
from __future__ import annotations

import dataclasses
import json
import posixpath
from pathlib import Path

import pytest

from deploy.inventory import Host
from deploy.provision import overlay
from deploy.provision.cache import WheelCache
from deploy.remote.host.fsutil import sha256_file
from deploy.ssh import open_checked

from provhelpers import build_wheel, make_project, rewrite_wheel

pytestmark = pytest.mark.lab

VENV = "/opt/provtest/venv"
HOUSE = "/opt/provtest/wheelhouse"
ROOT = "/var/lib/ddtree-provtest"
BLOB = 48 << 20  # large enough that a cut lands mid-wheel (events every 0.25 s)


def _sh(conn, cmd, **kw):
    r = conn.run(cmd, hide=True, warn=True, in_stream=False, **kw)
    assert r.exited == 0, f"{cmd}: {r.stderr}"
    return r.stdout


def _versions(inv, name):
    conn = open_checked(inv, inv.hosts[name])
    try:
        out = _sh(conn, f"{VENV}/bin/python -m pip list --format=json --disable-pip-version-check")
    finally:
        conn.close()
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)
            if d["name"].lower().startswith("provtest")}


@pytest.fixture(scope="module")
def world(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("labprov")
    import os
    w = {}
    for key, name, ver, big in (("a1", "provtest-alpha", "1.0+cu130", True), ("a0", "provtest-alpha", "1.0+cu128", True),
                                ("b2", "provtest-beta", "2.0", False), ("b1", "provtest-beta", "1.0", False),
                                ("x", "provtest-extra", "0.1", False)):
        src = make_project(tmp, name, ver)
        if big:  # a payload large enough to cut a transfer in the middle of
            (src / name.replace("-", "_") / "blob.bin").write_bytes(os.urandom(BLOB))
        w[key] = build_wheel(src, tmp / "wheels")
    setup = {"ct129": ["a1", "b2"], "ct200": ["a0", "b1", "x"]}
    for hname, keys in setup.items():
        conn = open_checked(lab, lab.hosts[hname])
        try:
            _sh(conn, f"rm -rf /opt/provtest {ROOT} && mkdir -p {HOUSE} && python3 -m venv {VENV}")
            for k in keys:
                conn.put(str(w[k]), posixpath.join(HOUSE, w[k].name))
            _sh(conn, f"{VENV}/bin/python -m pip install -q --no-index --no-deps --disable-pip-version-check "
                      + " ".join(posixpath.join(HOUSE, w[k].name) for k in keys))
            if hname == "ct129":  # keep only alpha's original: beta must be rebuilt from its RECORD
                _sh(conn, f"rm {HOUSE}/{w['b2'].name}")
            else:
                _sh(conn, f"rm -rf {HOUSE}")
        finally:
            conn.close()
    hosts = dict(lab.hosts)
    for hname in ("ct129", "ct200"):
        h = hosts[hname]
        hosts[hname] = dataclasses.replace(h, vars=dict(h.vars, venv=VENV, managed=["provtest-*"],
                                                        wheelhouse=[HOUSE]))
    hosts["ghost"] = Host("ghost", "127.0.0.1", "root", 1, (), vars=dict(hosts["ct200"].vars))
    inv = dataclasses.replace(lab, hosts=hosts, path=str(tmp / "inventory.yaml"))
    yield {"inv": inv, "wheels": w, "tmp": tmp, "cache": WheelCache(tmp / "cache")}
    for hname in setup:
        conn = open_checked(lab, lab.hosts[hname])
        try:
            conn.run(f"rm -rf /opt/provtest {ROOT}", hide=True, warn=True, in_stream=False)
        finally:
            conn.close()


def _opts(world, **kw):
    from rich.console import Console
    kw.setdefault("state_dir", ROOT)
    return overlay.Options(yes=True, cache=world["cache"], progress=False, console=Console(width=200, record=True),
                           **kw)


BEFORE = {"provtest-alpha": "1.0+cu128", "provtest-beta": "1.0", "provtest-extra": "0.1"}
REF = {"provtest-alpha": "1.0+cu130", "provtest-beta": "2.0"}


def test_dry_run_plan_changes_nothing(world):
    rep = overlay.provision(world["inv"], "ct200", _opts(world, dry_run=True))
    (h,) = rep.hosts
    assert h.status == "planned" and h.ok
    st = {i.name: i.status for i in h.plan.items}
    assert st == {"provtest-alpha": "local-tag-mismatch", "provtest-beta": "other-version",
                  "provtest-extra": "extra"}
    assert h.plan.sources["provtest-alpha"]["kind"] == "original"     # found in ct129's wheelhouse by hash
    assert h.plan.sources["provtest-beta"]["kind"] == "rebuild"
    assert rep.sent_bytes == 0 and rep.fetched_bytes == 0
    assert _versions(world["inv"], "ct200") == BEFORE


def test_cut_connection_mid_transfer_then_resume(world):
    cut = {"sent": 0, "done": False}

    def hook(host, ssh_proc, n):
        cut["sent"] += n
        if cut["sent"] > 0 and not cut["done"]:           # at the first word of progress (after ~1 MiB)
            cut["done"] = True
            ssh_proc.kill()                                # the SSH connection drops mid-wheel

    rep = overlay.provision(world["inv"], "ct200", _opts(world, hooks={"put_progress": hook}))
    (h,) = rep.hosts
    assert cut["done"] and not h.ok and h.status == "failed"
    assert _versions(world["inv"], "ct200") == BEFORE               # nothing partial was installed
    conn = open_checked(world["inv"], world["inv"].hosts["ct200"])
    try:
        parts = conn.run(f"find {ROOT}/provision/incoming -name '*.part' -printf '%s\\n'", hide=True,
                         in_stream=False).stdout.split()
    finally:
        conn.close()
    assert parts and 0 < int(parts[0]) < BLOB + (64 << 10)

    # next run (and an unreachable host alongside it): resumes, converges, ghost reported
    rep = overlay.provision(world["inv"], "ct200,ghost", _opts(world))
    by = {h.host: h for h in rep.hosts}
    assert by["ghost"].status == "unreachable" and not by["ghost"].ok
    assert by["ct200"].status == "provisioned", by["ct200"].error
    assert any(v > 0 for v in by["ct200"].details.get("resumed", {}).values())
    assert by["ct200"].sent_bytes < world["wheels"]["a1"].stat().st_size + (64 << 10)
    assert not rep.ok                                                  # the exit code says ghost failed
    assert _versions(world["inv"], "ct200") == REF
    assert set(by["ct200"].details["smoke_modules"]) == {"provtest_alpha", "provtest_beta"}


def test_second_run_transfers_nothing(world):
    rep = overlay.provision(world["inv"], "ct200", _opts(world))
    (h,) = rep.hosts
    assert h.status == "in-sync" and h.ok and rep.sent_bytes == 0 and rep.fetched_bytes == 0


def test_undo_restores_the_previous_builds(world):
    rep = overlay.undo(world["inv"], "ct200", _opts(world))
    (h,) = rep.hosts
    assert h.ok and h.status == "undone", h.error
    assert _versions(world["inv"], "ct200") == BEFORE


def test_corrupted_cached_wheel_is_fetched_again(world):
    cache = world["cache"]
    sha = sha256_file(str(world["wheels"]["a1"]))
    (p,) = list((cache.root / sha[:2] / sha).glob("*.whl"))
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))
    conn = open_checked(world["inv"], world["inv"].hosts["ct200"])
    try:
        _sh(conn, f"rm -rf {ROOT}/provision/incoming/{sha}")  # so the target needs the wheel from the cache again
    finally:
        conn.close()
    world["cache"] = WheelCache(cache.root)             # a new run remembers nothing
    rep = overlay.provision(world["inv"], "ct200", _opts(world))
    (h,) = rep.hosts
    assert h.status == "provisioned", h.error
    assert any("corrupted" in e for e in rep.events)
    assert rep.fetched_bytes >= world["wheels"]["a1"].stat().st_size
    assert _versions(world["inv"], "ct200") == REF
    assert overlay.undo(world["inv"], "ct200", _opts(world)).ok
    assert _versions(world["inv"], "ct200") == BEFORE


def test_pip_failure_restores_and_drift_is_shown(world):
    """Someone hand-patches alpha's entry points on the reference: the plan shows the drift, the wheel is
    rebuilt from the patched files, pip fails half-way on the target, and the target is restored."""
    inv = world["inv"]
    conn = open_checked(inv, inv.hosts["ct129"])
    ep = None
    try:
        ep = _sh(conn, f"ls -d {VENV}/lib/python3*/site-packages/provtest_alpha-*.dist-info").strip() + "/entry_points.txt"
        _sh(conn, f"cp -p {ep} {ep}.keep")   # put back byte for byte below (the reference must not keep drift)
        _sh(conn, f"printf '[console_scripts]\\nprovtest_alpha-cli = provtest_alpha:\\n' > {ep}")
        rep = overlay.provision(inv, "ct200", _opts(world))
    finally:
        if ep:
            conn.run(f"mv {ep}.keep {ep}", hide=True, warn=True, in_stream=False)
        conn.close()
    (h,) = rep.hosts
    assert any(w.code == "drift" and "entry_points.txt" in w.message for w in h.plan.warnings)
    assert h.plan.sources["provtest-alpha"]["kind"] == "rebuilt"
    assert not h.ok and "pip install failed" in h.error and "restored from the backup" in h.error
    assert "Invalid script entry point" in h.error
    assert [s["step"] for s in h.details["steps"]][0] == "install"
    assert _versions(inv, "ct200") == BEFORE


def test_fab_cli_json_dry_run_and_no_terminal(fab, lab):
    r = fab("provision", "ct200", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (h,) = doc["hosts"]
    assert h["host"] == "ct200" and h["status"] in ("planned", "in-sync")
    if h["status"] == "planned":
        torch = {i["name"]: i for i in h["plan"]["items"]}["torch"]
        assert torch["status"] == "local-tag-mismatch" and torch["target"].endswith("+cu128")
    # no terminal and no --yes: never waits, changes nothing, says why, exits non-zero
    r = fab("provision", "ct200")
    if h["status"] == "planned":
        assert r.returncode != 0 and "--yes" in (r.stdout + r.stderr)
    r = fab("provision", "ct129", "--dry-run")
    assert "reference" in r.stdout


# ---------------------------------------------------------------- faults of issue 9 (planted files, trust)

def test_faults_planted_in_the_old_world_writable_staging_dir_are_never_used(world):
    """Issue 9's attack: a local user plants built/<sha256 of RECORD>/built.json and a wheel with a .pth under the
    old fixed /var/tmp/ddtree-provision; it was offered as 'rebuilt' and installed as root everywhere. The agent
    never reads /var/tmp; its own staging is private."""
    inv = world["inv"]
    conn = open_checked(inv, inv.hosts["ct129"])
    try:
        key = _sh(conn, f"sha256sum {VENV}/lib/python3*/site-packages/provtest_beta-2.0.dist-info/RECORD").split()[0]
        d = f"/var/tmp/ddtree-provision/built/{key}"
        _sh(conn, f"mkdir -p {d} && chown -R deploy /var/tmp/ddtree-provision && "
                  f"printf 'import os\\n' > /tmp/evil.pth && cd /tmp && "
                  f"python3 -m zipfile -c {d}/provtest_beta-2.0-py3-none-any.whl evil.pth && "
                  f"printf '{{\"filename\": \"provtest_beta-2.0-py3-none-any.whl\", \"sha256\": \"%s\", \"size\": 1}}' "
                  f"$(sha256sum {d}/provtest_beta-2.0-py3-none-any.whl | cut -d' ' -f1) > {d}/built.json")
        rep = overlay.provision(inv, "ct200", _opts(world, dry_run=True))
        (h,) = rep.hosts
        assert h.plan.sources["provtest-beta"]["kind"] in ("rebuild", "rebuilt"), h.plan.sources
        assert h.plan.sources["provtest-beta"].get("sha256") != _sh(
            conn, f"sha256sum {d}/provtest_beta-2.0-py3-none-any.whl").split()[0]
    finally:
        conn.run("rm -rf /var/tmp/ddtree-provision /tmp/evil.pth", hide=True, warn=True, in_stream=False)
        conn.close()


def test_faults_planted_symlink_built_json_and_dotdot_name_in_the_private_dir(world, tmp_path):
    """Inside the private state directory (root only, so only root could plant these): a symlinked state dir is
    refused outright; a built.json naming '../../../../etc/cron.d/...' is never offered or followed; a symlink
    planted where an upload lands is refused and its target left alone. Nothing is installed from any of them."""
    inv = world["inv"]
    ref, tgt = open_checked(inv, inv.hosts["ct129"]), open_checked(inv, inv.hosts["ct200"])
    try:
        # a symlinked state directory
        _sh(tgt, "mkdir -p /root/elsewhere && ln -sfn /root/elsewhere /var/lib/ddtree-provlink")
        rep = overlay.provision(inv, "ct200", _opts(world, state_dir="/var/lib/ddtree-provlink"))
        (h,) = rep.hosts
        assert not h.ok and "symbolic link" in h.error, h.error
        assert _sh(tgt, "ls -A /root/elsewhere").strip() == ""
        # a built.json with a '../' name in the reference's private built directory
        rep = overlay.provision(inv, "ct200", _opts(world, dry_run=True))
        key = _sh(ref, f"sha256sum {VENV}/lib/python3*/site-packages/provtest_beta-2.0.dist-info/RECORD").split()[0]
        d = f"{ROOT}/provision/built/{key}"
        _sh(ref, f"mkdir -p {d} && chmod 700 {ROOT}/provision {ROOT}/provision/built {d} && "
                 f"printf '{{\"filename\": \"../../../../etc/cron.d/ddtree-x-1.0-py3-none-any.whl\", "
                 f"\"sha256\": \"{'a' * 64}\", \"size\": 1}}' > {d}/built.json")
        rep = overlay.provision(inv, "ct200", _opts(world, dry_run=True))
        (h,) = rep.hosts
        assert h.plan.sources["provtest-beta"]["kind"] == "rebuild"   # the planted one is not offered
        # a symlink where the upload of alpha's wheel lands on the target
        sha = h.plan.sources["provtest-alpha"]["sha256"]
        part = f"{ROOT}/provision/incoming/{sha}/{world['wheels']['a1'].name}.part"
        _sh(tgt, f"rm -rf {ROOT}/provision/incoming/{sha} && mkdir -p -m 700 {ROOT}/provision/incoming/{sha} && "
                 f"echo keep > /root/victim && ln -s /root/victim {part}")
        rep = overlay.provision(inv, "ct200", _opts(world))
        (h,) = rep.hosts
        assert not h.ok and "symbolic link" in h.error, h.error
        assert _sh(tgt, "cat /root/victim").strip() == "keep"
        assert _versions(inv, "ct200") == BEFORE
        assert not list(Path("/etc/cron.d").glob("ddtree-x*"))
        assert _sh(ref, "ls /etc/cron.d").find("ddtree-x") < 0 and _sh(tgt, "ls /etc/cron.d").find("ddtree-x") < 0
    finally:
        for c in (ref, tgt):
            c.run(f"rm -rf /var/lib/ddtree-provlink /root/elsewhere /root/victim {ROOT}/provision/built "
                  f"{ROOT}/provision/incoming", hide=True, warn=True, in_stream=False)
            c.close()


def test_fault_group_writable_target_venv_blocks_the_provision(world):
    inv = world["inv"]
    conn = open_checked(inv, inv.hosts["ct200"])
    site = _sh(conn, f"ls -d {VENV}/lib/python3*/site-packages").strip()
    try:
        _sh(conn, f"chmod g+w {site}")
        rep = overlay.provision(inv, "ct200", _opts(world))
        (h,) = rep.hosts
        assert h.status == "blocked" and "venv-trust" in h.error and "writable by group" in h.error, h.error
        assert _versions(inv, "ct200") == BEFORE and rep.sent_bytes == 0
    finally:
        _sh(conn, f"chmod g-w {site}")
        conn.close()


# ---------------------------------------------------------------- the smoke import, judged against the reference

def test_the_smoke_import_is_judged_against_the_reference(world):
    """A module that fails on the reference too (anthropic importing httpx2 on the GPU lab's reference) is a plan
    warning and a warning in the result; one that imports on the reference only (its helper is not managed, so the
    target lacks it) fails the apply, and the target is restored."""
    inv, tmp = world["inv"], world["tmp"]
    anth = build_wheel(make_project(tmp, "provtest-anth", "2.0", body="import provtest_httpx2\n"), tmp / "smoke")
    delta = build_wheel(make_project(tmp, "provtest-delta", "2.0", body="import helper_refonly\n"), tmp / "smoke")
    helper = build_wheel(make_project(tmp, "helper-refonly", "1.0"), tmp / "smoke")
    ref = open_checked(inv, inv.hosts["ct129"])

    def ref_install(*whls):
        for whl in whls:
            ref.put(str(whl), posixpath.join(HOUSE, whl.name))
        _sh(ref, f"{VENV}/bin/python -m pip install -q --no-index --no-deps --disable-pip-version-check "
                 + " ".join(posixpath.join(HOUSE, w.name) for w in whls))
    try:
        ref_install(anth)
        why = "ModuleNotFoundError: No module named 'provtest_httpx2'"
        rep = overlay.provision(inv, "ct200", _opts(world))
        (h,) = rep.hosts
        assert h.status == "provisioned", h.error
        assert f"fails on the reference too: provtest_anth ({why})" in [w.message for w in h.plan.warnings]
        assert h.plan.reference_smoke["provtest_anth"] == why and h.plan.reference_smoke["provtest_alpha"] is None
        assert h.warnings == [f"fails on the reference too: provtest_anth ({why})"]
        assert _versions(inv, "ct200") == dict(REF, **{"provtest-anth": "2.0"})

        ref_install(helper, delta)
        rep = overlay.provision(inv, "ct200", _opts(world))
        (h,) = rep.hosts
        assert not h.ok and h.details["restored"] is True
        assert h.error.startswith("smoke import failed on the target, not on the reference: provtest_delta "
                                  "(ModuleNotFoundError: No module named 'helper_refonly')"), h.error
        assert "restored from the backup" in h.error
        assert _versions(inv, "ct200") == dict(REF, **{"provtest-anth": "2.0"})
    finally:
        ref.run(f"{VENV}/bin/python -m pip uninstall -q -y provtest-anth provtest-delta helper-refonly",
                hide=True, warn=True, in_stream=False)
        ref.close()
    assert overlay.undo(inv, "ct200", _opts(world)).ok
    assert _versions(inv, "ct200") == BEFORE
