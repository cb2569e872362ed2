"""Faults of issue 9 on the lab's real hosts (real sshd, systemd, pip): what was done, what was seen, what was
lost (nothing). Each test starts from a healthy release on the hosts it uses and leaves one behind.

  Ctrl-C / EOF at the confirmation prompt     no host locked, nothing changed
  a broken lock                               the run that lost it stops and hands off; no rollback over the other
  sshd stopped mid-deploy (session killed)    the host's agent finishes and rolls back on its own; the client
                                              reads the outcome when sshd is back
  activation failing after the pip step       the plugin, overlays, unit and `current` are all as before
  a group-writable venv                       refused before root runs it
  a world-readable secrets file               refused; env files are 0600 root from creation
  provision while a deploy holds the lock     refused: one lock per host for both
"""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CLEAN, agent_call, host_lock, lab_inventory, ssh

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
HOSTS = ["ct129", "h200"]
FAB = str(Path(sys.executable).with_name("fab"))


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory, fab):
    tmp = tmp_path_factory.mktemp("labfaults")
    for h in HOSTS:
        ssh(lab, h, CLEAN + "; rm -f /etc/ddtree/secrets.env")
    inv = lab_inventory(tmp, keep=HOSTS)
    r = fab("deploy", "--yes", "--mode", "tree-verify", inventory=inv)
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"tmp": tmp, "lab": lab, "inv": inv}
    for h in HOSTS:
        ssh(lab, h, CLEAN + f"; {lab.hosts[h].vars['venv']}/bin/python -m pip uninstall -y -q sglang-ddtree",
            check=False)


def rows(fab, inv, hosts):
    r = fab("status", "--json", "--hosts", hosts, inventory=inv)
    return json.loads(r.stdout)


def healthy(fab, inv, hosts) -> dict:
    """{host: release} after asserting every service of `hosts` is up and healthy and no lock is held."""
    rs = rows(fab, inv, hosts)
    for r in rs:
        assert r["health"] == "ok" and r["state"] == "active/running" and r["lock"] is None, r
    return {r["host"]: r["release"] for r in rs}


def spawn(inv, *args, env=None):
    e = dict(os.environ, DEPLOY_INVENTORY=str(inv), COLUMNS="250", **(env or {}))
    return subprocess.Popen([FAB, *args], cwd=ROOT, env=e, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_lock(lab, host, timeout=60.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        lk = host_lock(lab, host)
        if lk:
            return lk
        time.sleep(0.2)
    pytest.fail(f"no lock appeared on {host}")


def journal(lab, host, n=5) -> list[dict]:
    return [json.loads(x) for x in ssh(lab, host, f"tail -n {n} /opt/ddtree/journal.jsonl").stdout.splitlines() if x]


# ---------------------------------------------------------------- the prompt

def at_the_prompt(inv, keys: bytes) -> tuple[int, str]:
    """Run `fab deploy --hosts h200` on a terminal, answer the prompt with `keys`, return (exit code, output)."""
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.execve(FAB, [FAB, "deploy", "--hosts", "h200", "--mode", "shadow-linear"],
                  dict(os.environ, DEPLOY_INVENTORY=str(inv), COLUMNS="250"))
    out, sent, end = b"", 0.0, time.monotonic() + 240
    while time.monotonic() < end and not (sent and time.monotonic() > sent + 30):
        r, _, _ = select.select([fd], [], [], 0.5)
        if r:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        if not sent and b"Proceed with this rollout?" in out:
            time.sleep(0.5)           # the question is up and the terminal is read
            os.write(fd, keys)
            sent = time.monotonic()
    done, status = os.waitpid(pid, os.WNOHANG)
    if not done:
        os.kill(pid, 9)               # never leave it waiting on a terminal nobody reads
        _, status = os.waitpid(pid, 0)
    os.close(fd)
    assert sent, out.decode(errors="replace")
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace")


@pytest.mark.parametrize("keys", [b"\x03", b"\x04"], ids=["ctrl-c", "eof"])
def test_ctrl_c_or_eof_at_the_prompt_leaves_no_lock(env, fab, keys):
    """Issue 9: Ctrl-C or EOF at the confirmation prompt left every planned host locked. The plan now only reads
    the hosts; the lock is taken by the change itself, after the answer."""
    before = healthy(fab, env["inv"], "h200")
    code, out = at_the_prompt(env["inv"], keys)
    assert code != 0 and "not confirmed" in out and "systemctl restart --no-block sglang-ddtree@gpu0.service" in out
    assert host_lock(env["lab"], "h200") is None
    assert healthy(fab, env["inv"], "h200") == before          # nothing changed
    r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "tree-verify", inventory=env["inv"])  # no --break-lock
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------- locks

def test_a_broken_lock_stops_the_run_that_held_it(env, fab):
    """Issue 9: a broken lock was not noticed by the run that held it. Run A deploys ct129 in two slow batches;
    someone breaks A's lock while A gates its first batch; A notices before its next step, stops, rolls nothing
    back and does not release the new holder's lock. Every service keeps serving; a later deploy converges."""
    lab = env["lab"]
    slow = lab_inventory(env["tmp"], "slow.yaml", keep=HOSTS, vars={"max_unavailable": 4,
                                                                    "env": {"LABSERVER_LOAD_SECONDS": "4"}})
    before = healthy(fab, env["inv"], "ct129")["ct129"]
    a = spawn(slow, "deploy", "--yes", "--hosts", "ct129", "--mode", "shadow-linear")
    try:
        held = wait_lock(lab, "ct129")
        assert held["command"].startswith("fab deploy") and held["token"] and held["expires_ts"] > time.time()
        time.sleep(2)                                              # A is gating its first batch
        agent_call(lab, "ct129", "lock.acquire", {"holder": "bob@desk", "command": "fab deploy --break-lock",
                                                  "token": "t-bob", "ttl": 600, "break": True,
                                                  "journal": "/opt/ddtree/journal.jsonl"})
    finally:
        out_a = a.communicate(timeout=300)[0]
    try:
        assert a.returncode != 0 and "is now held by bob@desk" in out_a, out_a
        assert "rolling back" not in out_a and out_a.count("gate ok") == 4      # stopped before the second batch
        assert host_lock(lab, "ct129")["holder"] == "bob@desk"                 # never released by A
        rs = rows(fab, env["inv"], "ct129")
        assert all(r["health"] == "ok" for r in rs)                            # nothing down
        assert sorted(r["running_release"] == before for r in rs) == [False] * 4 + [True] * 4
        events = [j["event"] for j in journal(lab, "ct129", 4)]
        assert events[-2:] == ["break-lock", "lock-lost"], events
    finally:
        agent_call(lab, "ct129", "lock.release", {"token": "t-bob"})
    r = fab("deploy", "--yes", "--hosts", "ct129", "--mode", "shadow-linear", inventory=env["inv"])
    assert r.returncode == 0, r.stdout + r.stderr
    rels = healthy(fab, env["inv"], "ct129")
    assert all(x["running_release"] == x["release"] for x in rows(fab, env["inv"], "ct129"))
    assert len(set(rels.values())) == 1


def test_provision_and_deploy_share_one_lock(env, fab):
    lab = env["lab"]
    agent_call(lab, "h200", "lock.acquire", {"holder": "alice@laptop", "command": "fab deploy", "token": "t-share",
                                             "ttl": 600})
    try:
        r = fab("provision", "h200", "--yes", inventory=env["inv"])
        assert r.returncode != 0 and "locked by alice@laptop running 'fab deploy'" in r.stdout + r.stderr
        r = fab("deploy", "--yes", "--hosts", "h200", inventory=env["inv"])
        assert r.returncode != 0 and "locked by alice@laptop" in r.stderr
    finally:
        agent_call(lab, "h200", "lock.release", {"token": "t-share"})


# ---------------------------------------------------------------- the link

def session_sshd(lab, host: str, pid: int) -> int:
    """The sshd process serving the session that runs `pid` on `host`."""
    script = (f"p={pid}; while [ \"$p\" -gt 1 ]; do c=$(cat /proc/$p/comm); "
              f"case $c in sshd*) echo $p; exit 0;; esac; p=$(awk '/^PPid/{{print $2}}' /proc/$p/status); done; exit 1")
    return int(ssh(lab, host, script).stdout.strip())


def test_sshd_stopped_mid_deploy_the_host_rolls_back_on_its_own(env, fab):
    """Issue 9: an SSH drop during a deploy recorded a failure and rolled nothing back. Here sshd is stopped and
    the deploy's session killed while the new release loads (it will fail its gate); the host's agent carries on
    alone, rolls back, journals it and frees the lock; when sshd is back the client reads that outcome."""
    lab = env["lab"]
    good = healthy(fab, env["inv"], "h200")["h200"]
    bad = lab_inventory(env["tmp"], "bad-slow.yaml", keep=HOSTS, hosts={"h200": {"services": {0: {"env": {
        "LABSERVER_LOAD_SECONDS": "6", "LABSERVER_WRONG_ALGORITHM": "EAGLE"}}}}})
    a = spawn(bad, "deploy", "--yes", "--hosts", "h200")
    try:
        lk = wait_lock(lab, "h200")
        sess = session_sshd(lab, "h200", lk["agent"]["pid"])
        ssh(lab, "h200", "systemd-run --quiet --on-active=10 --unit=ddtree-fault-sshd-back systemctl start ssh.service;"
                         f" systemctl stop ssh.service; kill {sess}")
    finally:
        out = a.communicate(timeout=400)[0]
    print(out)
    assert a.returncode != 0, out
    assert "LINK LOST" in out and "on the host: deploy-failed" in out, out
    assert healthy(fab, env["inv"], "h200")["h200"] == good       # back on the previous release, serving
    last = journal(lab, "h200", 1)[-1]
    assert last["event"] == "deploy-failed" and last["rollback_ok"] is True and last["rolled_back_to"] == good


# ---------------------------------------------------------------- one transaction

def test_activation_failing_after_pip_undoes_every_step(env, fab):
    """Issue 9: activation installed the plugin and patched overlays before switching `current`; a failure after the
    pip step left the new plugin under the old release. A directory planted where the unit file goes makes the unit
    step fail after pip: the plugin, unit and `current` are all as before, and no service was restarted."""
    lab = env["lab"]
    before = rows(fab, env["inv"], "h200")[0]
    inv_before = ssh(lab, "h200", "systemctl show -p InvocationID --value sglang-ddtree@gpu0").stdout
    unit = "/etc/systemd/system/sglang-ddtree@.service"
    ssh(lab, "h200", f"cp {unit} /root/unit.keep && rm {unit} && mkdir {unit} && touch {unit}/planted")
    try:
        r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "shadow-linear", inventory=env["inv"])
        out = r.stdout + r.stderr
        assert r.returncode != 0 and "failed at unit" in out and "every step done was undone" in out, out
        after = rows(fab, env["inv"], "h200")[0]
        assert after["plugin"] == before["plugin"] and after["release"] == before["release"], (before, after)
        assert after["health"] == "ok" and after["mode"] == "tree-verify"
        assert ssh(lab, "h200", "systemctl show -p InvocationID --value sglang-ddtree@gpu0").stdout == inv_before
        assert ssh(lab, "h200", f"ls {unit}").stdout.split() == ["planted"]   # the plant itself left alone
    finally:
        ssh(lab, "h200", f"rm -rf {unit} && mv /root/unit.keep {unit} && systemctl daemon-reload")
    assert healthy(fab, env["inv"], "h200")["h200"] == before["release"]


# ---------------------------------------------------------------- trust

def test_a_group_writable_venv_is_refused_before_root_runs_it(env, fab):
    lab = env["lab"]
    site = ssh(lab, "h200", "ls -d /opt/sglang/venv/lib/python3*/site-packages").stdout.strip()
    before = healthy(fab, env["inv"], "h200")
    ssh(lab, "h200", f"chmod g+w {site}")
    try:
        r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "shadow-linear", inventory=env["inv"])
        assert r.returncode != 0 and "root will not run it" in r.stdout and "writable by group" in r.stdout, r.stdout
        r = fab("provision", "h200", "--dry-run", inventory=env["inv"])
        assert "venv-trust" in r.stdout or "in sync" in r.stdout, r.stdout
    finally:
        ssh(lab, "h200", f"chmod g-w {site}")
    assert healthy(fab, env["inv"], "h200") == before


def test_secrets_file_mode_is_checked_and_env_files_are_private(env, fab):
    lab = env["lab"]
    modes = ssh(lab, "h200", "stat -c '%a %U:%G' /opt/ddtree/releases/current/env/*.env").stdout.split("\n")
    assert {m for m in modes if m} == {"600 root:root"}             # never 0644 (nor 0640 to the service)
    ssh(lab, "h200", "mkdir -p /etc/ddtree && printf 'HF_TOKEN=x\\n' > /etc/ddtree/secrets.env && "
                     "chmod 644 /etc/ddtree/secrets.env")
    try:
        r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "shadow-linear", inventory=env["inv"])
        assert r.returncode != 0, r.stdout
        assert "REFUSED secrets file: /etc/ddtree/secrets.env: has mode 0644" in r.stdout, r.stdout
        ssh(lab, "h200", "chmod 600 /etc/ddtree/secrets.env")
        r = fab("deploy", "--yes", "--hosts", "h200", "--mode", "shadow-linear", inventory=env["inv"])
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        ssh(lab, "h200", "rm -f /etc/ddtree/secrets.env")
    healthy(fab, env["inv"], "h200")
