"""What a hostile but realistic operator does to a rollout, on the lab with the real sglang-router, and what the
rollout now guarantees: each GPU ends serving the new release or the old one, in its router, and the router holds
exactly the host's enabled workers.

  a GPU's port changes under load           the worker at the OLD url is drained and removed, the new one added
                                            (deploy, the automatic rollback, fab rollback); a worker nobody names
                                            is taken out (drained) by the next run, which says so; `fab status`
                                            exits 1 while one is there
  the host's agent SIGKILLed mid-rollout    the run says the agent died and what it last did; `fab status` exits 1
                                            (GPU out, the dead run's lock); the next run names the interrupted run
                                            and finishes it: every GPU back in the router on the active release
  a GPU server SIGSTOPped (hung)            an unchanged deploy restarts it (not "nothing restarted"); its drain
                                            reads "unknown" and waits to the deadline, then says so

Host: ct129 restricted to 2 GPUs (one keeps serving while the other restarts), its router on its own address with
an API key. Order matters: each test starts from the state the previous one left (a healthy release).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deploy.lab import loadgen

from helpers import CLEAN, lab_inventory, ssh, strip_ansi

pytestmark = pytest.mark.lab
ROOT = Path(__file__).resolve().parents[2]
FAB = str(Path(sys.executable).with_name("fab"))
KEY = "Kq8hostileRolloutLab0123456789ab"
KEY_FILE = "/etc/ddtree/api-key.yaml"
HOST = "ct129"
DRAIN = 5  # s: the inventory's drain_timeout here


@pytest.fixture(scope="module")
def env(lab, tmp_path_factory, fab):
    tmp = tmp_path_factory.mktemp("hostile")
    ssh(lab, HOST, CLEAN + f"; install -d -m 0755 /etc/ddtree && (umask 077; printf 'api-key: {KEY}\\n' > {KEY_FILE})")
    host = {"gpus": 2, "vars": {"listen_address": lab.hosts[HOST].address, "api_key_file": KEY_FILE,
                                "router": {"drain_timeout": DRAIN}}}
    base = lab_inventory(tmp, "base.yaml", keep=[HOST], hosts={HOST: host})
    r = fab("deploy", "--yes", inventory=base)
    assert r.returncode == 0, r.stdout + r.stderr
    yield {"lab": lab, "tmp": tmp, "base": base, "host": host,
           "router": f"http://{lab.hosts[HOST].address}:8000"}
    ssh(lab, HOST, CLEAN + f"; rm -f {KEY_FILE}; {lab.hosts[HOST].vars['venv']}/bin/python -m pip uninstall -y -q "
                           "sglang-ddtree", check=False)


def router_workers(env) -> dict:
    """{url: healthy} as the router lists them (GET /workers with the key)."""
    import urllib.request
    req = urllib.request.Request(env["router"] + "/workers", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return {w["url"]: w["is_healthy"] for w in json.loads(r.read())["workers"]}


def settled(env, want: set[str], timeout: float = 20.0) -> dict:
    """The router's workers once they are `want`, all healthy (or what it lists at the timeout)."""
    end = time.monotonic() + timeout
    while True:
        ws = router_workers(env)
        if (set(ws) == want and all(ws.values())) or time.monotonic() > end:
            return ws
        time.sleep(0.3)


def status(fab, inv):
    r = fab("status", "--json", "--hosts", HOST, inventory=inv)
    return r, json.loads(r.stdout)


def load(env, **kw):
    return loadgen.Load([(env["router"], KEY)], clients=kw.pop("clients", 6), total=10000,
                        time_cap=kw.pop("time_cap", 120), max_new_tokens=kw.pop("max_new_tokens", 40), **kw).start()


def test_a_port_change_drains_the_old_worker_and_a_worker_nobody_names_is_taken_out(env, fab):
    """Issue 26, finding 1: `services: {0: {port: 30010}}` on a GPU serving on 30000, under load. The drain looked
    the worker up by its NEW url ("gpu0 not in the router; drained 0"), restarted the serving server undrained and
    left http://127.0.0.1:30000 in the router for good (unhealthy, and `fab status` exit 0)."""
    moved = lab_inventory(env["tmp"], "moved.yaml", keep=[HOST], hosts={HOST: dict(
        env["host"], services={0: {"port": 30010}})})
    assert settled(env, {"http://127.0.0.1:30000", "http://127.0.0.1:30001"}) == {
        "http://127.0.0.1:30000": True, "http://127.0.0.1:30001": True}
    lg = load(env)
    time.sleep(1.5)
    r = fab("deploy", "--yes", inventory=moved)
    lg.stop()
    out = strip_ansi(r.stdout)
    s = loadgen.summary(lg.results)
    print(f"\nport change 30000 -> 30010 on {HOST} gpu0 under 6 streaming clients: {s}")
    assert r.returncode == 0, out + r.stderr
    assert re.search(r"gpu0 out of the router \(and its old worker http://127\.0\.0\.1:30000\); drained \d+ in-flight",
                     out), out
    assert "gpu0 not in the router" not in out and "gpu0 :30010 gate ok" in out, out
    assert s["failed"] == 0 and s["completed"] > 10, s
    want = {"http://127.0.0.1:30001", "http://127.0.0.1:30010"}
    assert settled(env, want) == dict.fromkeys(want, True)
    rc, rows = status(fab, moved)
    assert rc.returncode == 0 and {row["router"] for row in rows} == {"in/healthy"}, rc.stderr

    # a worker the inventory does not name (the same server under another url): fab status says so and exits 1;
    # the next run, with nothing to restart, takes it out drained and says so
    import urllib.request
    stray = "http://localhost:30001"
    req = urllib.request.Request(env["router"] + "/workers", method="POST",
                                 data=json.dumps({"url": stray, "api_key": KEY}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=5).read()
    assert stray in settled(env, want | {stray})
    r = fab("status", "--hosts", HOST, inventory=moved)
    assert r.returncode == 1 and f"the router holds worker(s) the inventory does not name: {stray}" in r.stderr, \
        r.stdout + r.stderr
    lg = load(env)
    time.sleep(1.0)
    r = fab("deploy", "--yes", inventory=moved)
    lg.stop()
    out = strip_ansi(r.stdout)
    s = loadgen.summary(lg.results)
    assert r.returncode == 0 and "nothing restarted" in out, out + r.stderr
    assert re.search(rf"router worker {re.escape(stray)} is not in the inventory: out of the router; drained \d+", out)
    assert settled(env, want) == dict.fromkeys(want, True) and s["failed"] == 0, s
    # a port change whose new server fails its gate: the automatic rollback puts gpu0 back at 30010, and the
    # router holds neither 30020 nor anything else
    bad = lab_inventory(env["tmp"], "bad.yaml", keep=[HOST], hosts={HOST: dict(
        env["host"], services={0: {"port": 30020, "env": {"LABSERVER_FAIL_AT_START": "1"}}})})
    r = fab("deploy", "--yes", inventory=bad)
    out = strip_ansi(r.stdout)
    assert r.returncode == 1 and "gpu0 :30020 gate FAILED" in out and re.search(r"rollback to \S+ ok", out), out
    assert "(and its old worker http://127.0.0.1:30010)" in out, out
    assert settled(env, want) == dict.fromkeys(want, True)
    # `fab rollback` to the release on 30000: the worker at 30010 goes, drained
    r = fab("rollback", inventory=env["base"])
    out = strip_ansi(r.stdout)
    assert r.returncode == 0 and "(and its old worker http://127.0.0.1:30010)" in out, out + r.stderr
    want = {"http://127.0.0.1:30000", "http://127.0.0.1:30001"}
    assert settled(env, want) == dict.fromkeys(want, True)
    assert status(fab, env["base"])[0].returncode == 0


def agent_pid(lab) -> int | None:
    r = ssh(lab, HOST, "cat /var/lib/ddtree/lock.json 2>/dev/null", check=False)
    try:
        return int(json.loads(r.stdout)["agent"]["pid"])
    except (ValueError, KeyError, TypeError):
        return None


def test_an_agent_killed_mid_rollout_is_reported_and_the_next_run_finishes_it(env, fab):
    """Issue 26, finding 2: the host's agent SIGKILLed right after `gpu0 out of the router`. The run said `the agent
    gave no answer (exit -1): ` and nothing more; the host stayed half-rolled (gpu0 out of the router), the dead
    run's lock stayed, `fab status` exited 0, and the next deploy took the lock over without a word."""
    lab = env["lab"]
    lg = load(env)
    time.sleep(1.5)
    p = subprocess.Popen([FAB, "deploy", "--yes", "--mode", "shadow-linear"], cwd=ROOT, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, DEPLOY_INVENTORY=str(env["base"]), COLUMNS="250"))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(p.stdout.readline, "")), daemon=True)
    reader.start()
    end, killed = time.monotonic() + 180, None
    while time.monotonic() < end and p.poll() is None:
        if any("gpu0 out of the router" in ln for ln in lines):
            killed = agent_pid(lab)
            assert killed, "".join(lines)
            ssh(lab, HOST, f"kill -9 {killed}")
            break
        time.sleep(0.05)
    p.wait(120)
    reader.join(10)
    out = strip_ansi("".join(lines))
    time.sleep(2)
    lg.stop()
    s = loadgen.summary(lg.results)
    print(f"\nagent SIGKILLed after gpu0 left the router, under 6 streaming clients: {s}")
    assert killed and p.returncode == 1, out
    assert "the host's agent died during deploy without an answer" in out, out
    assert re.search(r"its last report: gpu0 out of the router; drained \d+ in-flight", out), out
    assert not re.search(r"exit -?\d+\):\s*$", out, re.M), out
    assert s["failed"] == 0, s  # gpu0 was drained; gpu1 kept serving

    r, rows = status(fab, env["base"])
    r2 = fab("status", "--hosts", HOST, inventory=env["base"])
    assert r.returncode == 1 and r2.returncode == 1, r2.stdout + r2.stderr
    assert f"{HOST}:gpu0 out of the router" in r2.stderr, r2.stderr
    assert "the lock of a dead run" in r2.stderr and "stopped at step 'restart gpu0'" in r2.stderr, r2.stderr

    lg = load(env)
    time.sleep(1.0)
    r = fab("deploy", "--yes", "--mode", "shadow-linear", inventory=env["base"])
    lg.stop()
    out = strip_ansi(r.stdout)
    s = loadgen.summary(lg.results)
    assert r.returncode == 0, out + r.stderr
    assert re.search(r"found an interrupted run: \S+ running 'fab deploy --yes --mode shadow-linear' since \S+ "
                     r"stopped at step 'restart gpu0' \(its agent process \d+ is gone\); GPUs it left out of the "
                     r"router: gpu0", out), out
    assert "took over the lock of an interrupted run" in out and "gpu0 back in the router" in out, out
    assert s["failed"] == 0, s
    want = {"http://127.0.0.1:30000", "http://127.0.0.1:30001"}
    assert settled(env, want) == dict.fromkeys(want, True)
    r, rows = status(fab, env["base"])
    assert r.returncode == 0, r.stderr
    assert all(row["running_release"] == row["release"] and row["router"] == "in/healthy" and row["lock"] is None
               and row["mode"] == "shadow-linear" for row in rows), rows
    hist = fab("status", "--history", "5", "--hosts", HOST, inventory=env["base"])
    assert "interrupted" in hist.stdout, hist.stdout


def main_pid(lab, inst="gpu0") -> str:
    return ssh(lab, HOST, f"systemctl show -p MainPID --value sglang-ddtree@{inst}").stdout.strip()


def test_a_hung_server_is_restarted_and_its_drain_waits_to_the_deadline(env, fab):
    """Issue 26, finding 3: a SIGSTOPped GPU server. Its /metrics timeout read as 0 in flight ("drained 0 in-flight
    request(s)", false; the deadline never applied), and an unchanged deploy said "nothing restarted", exit 0."""
    lab = env["lab"]
    r = fab("deploy", "--yes", "--mode", "shadow-linear", inventory=env["base"])  # the release the host runs
    assert r.returncode == 0, r.stdout + r.stderr
    pid = main_pid(lab)
    ssh(lab, HOST, f"kill -STOP {pid}")
    try:
        r = fab("status", "--hosts", HOST, inventory=env["base"])
        assert r.returncode == 1 and f"{HOST}:gpu0" in r.stderr, r.stderr  # fab status saw the hang already
        t = time.monotonic()
        r = fab("deploy", "--yes", "--mode", "shadow-linear", inventory=env["base"])
        took = time.monotonic() - t
    finally:
        ssh(lab, HOST, f"kill -CONT {pid}", check=False)
    out = strip_ansi(r.stdout)
    assert r.returncode == 0, out + r.stderr
    assert "nothing restarted" not in out and "restart: gpu0 (not healthy (/health: timed out))" in out, out
    m = re.search(r"gpu0 out of the router; DRAIN DEADLINE passed after ([0-9.]+)s with its in-flight requests "
                  r"unknown \(/metrics timed out\): restarting anyway", out)
    assert m and float(m.group(1)) >= DRAIN and took >= DRAIN, out
    assert "gpu0 :30000 gate ok" in out and "gpu0 back in the router" in out and "gpu1" not in out, out
    assert main_pid(lab) != pid
    r, rows = status(fab, env["base"])
    assert r.returncode == 0 and {row["health"] for row in rows} == {"ok"}, (r.stderr, rows)
