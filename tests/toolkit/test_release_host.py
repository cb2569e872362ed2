"""The release ops' secrets checks and the systemd files of an activation, run for real on this machine (as root,
like the agent on a host): the agent itself through its loader for the probe and apply, the activation's
systemd step through its own code on a scratch unit directory.

- release.probe reports the secrets env file and each API-key file as the unit's ExecStartPre would judge them
  (the same module, server_secrets.py), never the key; the plan refuses such a host before staging.
- release.apply checks them before its first change: a restart with an unsafe key file changes nothing.
- the unit file and the per-GPU drop-ins switch together with one daemon-reload; stale drop-ins of ours go, other
  files stay; a failure part-way is undone byte for byte.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from agenthelpers import call, once, result
from deploy.release import changes
from deploy.remote.host import unitfiles
from deploy.remote.host.registry import Context
from deploy.remote.host.releasehost import ReleaseHost

from helpers import KEY, public_dir, secret_file


@pytest.fixture
def host(tmp_path):
    """A host's release layout in tmp_path: release root, state dir, an empty venv, an /etc/ddtree-like dir."""
    etc = public_dir(tmp_path / "etc")
    (tmp_path / "venv").mkdir()
    return {"root": str(tmp_path / "ddtree" / "releases"), "state_dir": str(tmp_path / "ddtree"),
            "venv": str(tmp_path / "venv"), "etc": etc, "state": tmp_path / "agent"}


def test_probe_judges_secrets_and_key_files_as_the_unit_will_and_never_returns_a_key(host):
    etc = host["etc"]
    good = secret_file(etc, "good.yaml", f"api-key: {KEY}\n")
    loose = secret_file(etc, "loose.yaml", f"api-key: {KEY}\n", 0o644)
    bad = secret_file(etc, "bad.yaml", "api-key: short\n")
    link = etc / "link.yaml"
    link.symlink_to(good)
    env = secret_file(etc, "secrets.env", "HF_TOKEN=x\n", 0o640)
    files = [good, loose, bad, str(link), str(etc / "missing.yaml")]
    out = result("release.probe", {"root": host["root"], "state_dir": host["state_dir"], "venv": host["venv"],
                                   "secrets_file": env, "api_key_files": files}, host["state"])
    assert KEY not in repr(out)
    assert out["secrets"] == f"{env}: has mode 0640; it must be 0600 (or 0400): chmod 600 {env}"
    keys = out["api_keys"]
    assert keys[good] == "ok" and "has mode 0644" in keys[loose] and "16-512 characters" in keys[bad]
    assert "symbolic link" in keys[str(link)] and "no such file" in keys[str(etc / "missing.yaml")]
    os.chmod(env, 0o600)
    out = result("release.probe", {"root": host["root"], "state_dir": host["state_dir"], "venv": host["venv"],
                                   "secrets_file": env}, host["state"])
    assert out["secrets"] == "ok" and out["api_keys"] == {}
    os.unlink(env)
    out = result("release.probe", {"root": host["root"], "state_dir": host["state_dir"], "venv": host["venv"],
                                   "secrets_file": env}, host["state"])
    assert out["secrets"] == "absent"
    # the plan: refused (with the reason) for the inventory's key file, and for a restart's key files
    state = {"secrets": "absent", "api_keys": keys}
    assert changes.secrets_refusals(state, [good, None]) == []
    assert changes.secrets_refusals(state, [loose]) == [f"API key file: {keys[loose]}"]
    assert changes.secrets_refusals({"secrets": "absent"}, [good]) == [f"API key file: {good}: not checked by "
                                                                       "the host"]
    assert changes.secrets_refusals({"secrets": "x: has mode 0644"}, []) == ["secrets file: x: has mode 0644"]


def test_a_directory_others_can_write_is_refused_for_a_key_file(host, tmp_path):
    """The unit's check looks at the file and its directory; root's check looks at every directory above it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    inner = shared / "keys"
    inner.mkdir(mode=0o755)
    os.chmod(inner, 0o755)
    f = secret_file(inner, "k.yaml", f"api-key: {KEY}\n")
    out = result("release.probe", {"root": host["root"], "state_dir": host["state_dir"], "venv": host["venv"],
                                   "api_key_files": [f]}, host["state"])
    assert "writable by group or others" in out["api_keys"][f], out["api_keys"]


def test_apply_with_an_unsafe_key_file_restarts_nothing(host, tmp_path):
    """Before its first change, release.apply checks what the unit's ExecStartPre will check: with a world-readable
    key file nothing runs (the batch's commands would leave marks), and the outcome is journaled."""
    loose = secret_file(host["etc"], "k.yaml", f"api-key: {KEY}\n", 0o644)
    mark = tmp_path / "restarted"
    batch = {"instances": ["gpu0"], "reset_failed": ["touch", str(mark)], "restart": ["touch", str(mark)],
             "gates": {"gpu0": {"port": 1, "digest": "d", "expect": {}, "address": "127.0.0.1",
                                "api_key_file": loose}}}
    args = {"root": host["root"], "state_dir": host["state_dir"], "venv": host["venv"], "start_timeout": 5,
            "gate_timeout": 5, "batches": [batch], "journal": {"event": "restart"}, "fail_event": "restart",
            "mark_failed": False}
    res = result("release.apply", args, host["state"], lock=once())
    assert not res["ok"] and res["kind"] == "secrets" and "has mode 0644" in res["error"], res
    assert "nothing changed" in res["error"] and KEY not in repr(res)
    assert not mark.exists() and res["restarted"] == []
    os.chmod(loose, 0o600)
    # the same batch once the file is fixed: the check passes and the batch runs (no unit here: its gate fails)
    fin, _replies, _p = call("release.apply", dict(args, start_timeout=1, gate_timeout=1), host["state"],
                             lock=once())
    assert fin["type"] == "result" and mark.exists() and fin["result"].get("kind") != "secrets"


# ---------------------------------------------------------------- the systemd step of an activation

def _host(unit_dir: Path) -> ReleaseHost:
    return ReleaseHost(Context({"deadline": 60}, None), {"root": "/nonexistent", "state_dir": "/nonexistent",
                                                         "venv": "/nonexistent", "unit_dir": str(unit_dir)})


def tree(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.read_bytes() if p.is_file() else None, oct(p.stat().st_mode & 0o777))
            for p in sorted(d.rglob("*"))}


@pytest.fixture
def systemd(tmp_path):
    """A unit directory holding an old unit, a stale drop-in of ours (gpu5) and someone else's drop-in on gpu0,
    and a release directory with the new unit and drop-ins for gpu0 and gpu1."""
    units = tmp_path / "system"
    units.mkdir(mode=0o755)
    os.chmod(units, 0o755)
    (units / "sglang-ddtree@.service").write_text("[Service]\nExecStart=/old\n")
    for d, name in (("sglang-ddtree@gpu5.service.d", "50-ddtree-gpu.conf"),
                    ("sglang-ddtree@gpu0.service.d", "10-operator.conf")):
        (units / d).mkdir()
        (units / d / name).write_text(f"# {d}/{name}\n")
    tdir = tmp_path / "rel"
    (tdir / "systemd").mkdir(parents=True)
    (tdir / "systemd" / "sglang-ddtree@.service").write_text("[Service]\nExecStart=/new\n")
    man = {"release": "r2", "services": {}}
    for g in (0, 1):
        rel = f"sglang-ddtree@gpu{g}.service.d/50-ddtree-gpu.conf"
        (tdir / "systemd" / rel).parent.mkdir()
        (tdir / "systemd" / rel).write_text(f"[Service]\nDeviceAllow=/dev/nvidia{g} rw\n")
        man["services"][f"gpu{g}"] = {"dropin": rel}
    return units, tdir, man


def test_unit_and_drop_ins_switch_together_and_stale_ones_go(systemd, tmp_path):
    units, tdir, man = systemd
    h = _host(units)
    reloads = tmp_path / "reloads"
    reload_argv = ["sh", "-c", f"echo reload >> {reloads}"]
    undo: list = []
    before = tree(units)
    spec = {"dropin_name": "50-ddtree-gpu.conf"}
    changed = unitfiles.put_systemd(h, unitfiles.systemd_files(h, str(tdir), man, spec), undo, reload_argv)
    assert [Path(p).relative_to(units).as_posix() for p in changed] == [
        "sglang-ddtree@.service", "sglang-ddtree@gpu0.service.d/50-ddtree-gpu.conf",
        "sglang-ddtree@gpu1.service.d/50-ddtree-gpu.conf", "sglang-ddtree@gpu5.service.d/50-ddtree-gpu.conf"]
    after = tree(units)
    assert after["sglang-ddtree@.service"][0] == b"[Service]\nExecStart=/new\n"
    assert after["sglang-ddtree@gpu1.service.d/50-ddtree-gpu.conf"] == (
        b"[Service]\nDeviceAllow=/dev/nvidia1 rw\n", "0o644")
    assert after["sglang-ddtree@gpu1.service.d"] == (None, "0o755")
    assert "sglang-ddtree@gpu5.service.d" not in after                          # stale: gone, with its dir
    assert after["sglang-ddtree@gpu0.service.d/10-operator.conf"] == before[
        "sglang-ddtree@gpu0.service.d/10-operator.conf"]                        # not ours: kept
    assert reloads.read_text() == "reload\n"                                    # one daemon-reload for all
    # the same again changes nothing and reloads nothing
    assert unitfiles.put_systemd(h, unitfiles.systemd_files(h, str(tdir), man, spec), [], reload_argv) == []
    assert reloads.read_text() == "reload\n"
    # the transaction's undo puts back every file as it was
    [(name, fn)] = undo
    fn()
    assert name == "unit" and tree(units) == before and reloads.read_text() == "reload\nreload\n"


def test_a_failure_part_way_is_undone_and_a_hostile_drop_in_path_is_refused(systemd, tmp_path):
    units, tdir, man = systemd
    h = _host(units)
    before = tree(units)
    # a directory planted where gpu1's drop-in goes: the unit and gpu0's drop-in were written first
    (units / "sglang-ddtree@gpu1.service.d" / "50-ddtree-gpu.conf").mkdir(parents=True)
    planted = tree(units)
    undo: list = []
    with pytest.raises(OSError):
        unitfiles.put_systemd(h, unitfiles.systemd_files(h, str(tdir), man, {"dropin_name": "50-ddtree-gpu.conf"}),
                              undo, ["true"])
    assert (units / "sglang-ddtree@.service").read_text().endswith("/new\n")   # part-way
    undo[0][1]()
    assert tree(units) == planted and planted != before
    bad = {"release": "r3", "services": {"gpu0": {"dropin": "../../cron.d/x.conf"}}}
    with pytest.raises(RuntimeError, match="refusing drop-in path"):
        unitfiles.systemd_files(h, str(tdir), bad, {"dropin_name": "50-ddtree-gpu.conf"})
    other = {"release": "r3", "services": {"gpu0": {"dropin": "sglang-ddtree@gpu1.service.d/50-ddtree-gpu.conf"}}}
    with pytest.raises(RuntimeError, match="refusing drop-in path"):
        unitfiles.systemd_files(h, str(tdir), other, {"dropin_name": "50-ddtree-gpu.conf"})
