"""The health gate against the lab stand-in on loopback (real HTTP, real processes), its misbehaviours,
and the agent's host lock. The stand-in runs under /usr/bin/python3 with SGLang hidden (stdlib only),
as on the lab hosts."""
from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from agenthelpers import call, result
from deploy.remote.host import gate as agent
from deploy.remote.host import locks
from deploy.remote.host.activation import overlay_check

ROOT = Path(__file__).resolve().parents[2]
SERVER = ROOT / "deploy" / "labserver" / "server.py"
EXPECT = {"model": "qwen3-8b", "algorithm": "DDTREE"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def labserver():
    procs = []

    def start(env=None, algorithm="DDTREE"):
        port = free_port()
        argv = ["/usr/bin/python3", "-I", str(SERVER), "--model-path", "/models/Qwen3-8B", "--served-model-name",
                "qwen3-8b", "--host", "127.0.0.1", "--port", str(port), "--speculative-algorithm", algorithm,
                "--speculative-draft-model-path", "/models/d", "--speculative-dflash-block-size", "16",
                "--speculative-num-draft-tokens", "17"]
        p = subprocess.Popen(argv, env={"PATH": "/usr/bin:/bin", **(env or {})}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        procs.append(p)
        return p, port
    yield start
    for p in procs:
        if p.poll() is None:
            p.terminate()
            p.wait(5)


def test_healthy_server_passes_the_gate_with_sglang_shapes(labserver):
    p, port = labserver()
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=5)
    assert g["ok"], g
    assert set(g["steps"]) == {"ready", "health_generate", "models", "generate", "server_info"}
    assert g["algorithm"] == "DDTREE" and g["accept_length"] > 1
    models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-8b"
    info = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/get_server_info"))
    assert info["version"] == "0.5.23" and info["speculative_num_draft_tokens"] == 17
    assert "avg_spec_accept_length" in info["internal_states"][0]
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"model": "qwen3-8b", "prompt": "hi", "max_tokens": 4}).encode())
    c = json.load(urllib.request.urlopen(req))
    assert c["object"] == "text_completion" and c["usage"]["completion_tokens"] == 4


def test_wrong_algorithm_fails_at_server_info(labserver):
    _, port = labserver({"LABSERVER_WRONG_ALGORITHM": "EAGLE"})
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=5)
    assert not g["ok"] and g["step"] == "server_info" and "'EAGLE'" in g["detail"]


def test_wrong_model_fails_at_models(labserver):
    _, port = labserver()
    g = agent.gate(port, dict(EXPECT, model="llama"), start_timeout=10, gate_timeout=5)
    assert not g["ok"] and g["step"] == "models"


def test_never_ready_times_out(labserver):
    _, port = labserver({"LABSERVER_NEVER_READY": "1"})
    t = time.monotonic()
    g = agent.gate(port, EXPECT, start_timeout=1.5, gate_timeout=5)
    assert not g["ok"] and g["step"] == "ready" and "503" in g["detail"]
    assert time.monotonic() - t < 5


def test_slow_load_then_ready(labserver):
    _, port = labserver({"LABSERVER_LOAD_SECONDS": "1"})
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=5)
    assert g["ok"] and g["steps"]["ready"] >= 0.9


def test_crash_after_n_requests(labserver):
    p, port = labserver({"LABSERVER_CRASH_AFTER": "3"})
    g = agent.gate(port, EXPECT, start_timeout=10, gate_timeout=5)
    assert not g["ok"] and g["step"] in ("models", "generate")
    assert p.wait(5) == 70


def test_fail_at_start(labserver):
    p, port = labserver({"LABSERVER_FAIL_AT_START": "1"})
    assert p.wait(5) == 1
    assert "failing to load the model" in p.stdout.read()


def _state(tmp_path):
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    return str(d)


def test_lock_is_exclusive_names_its_holder_and_journals_a_break(tmp_path):
    state = _state(tmp_path)
    first = locks.acquire(state, {"holder": "alice@laptop", "command": "fab deploy", "token": "t1"})
    assert first["ok"] and first["lock"]["expires_ts"] > first["lock"]["started_ts"]
    second = locks.acquire(state, {"holder": "bob@desk", "command": "fab deploy", "token": "t2"})
    assert not second["ok"] and second["holder"]["holder"] == "alice@laptop"
    assert not locks.release(state, "t2")  # only the holder releases
    broken = locks.acquire(state, {"holder": "bob@desk", "command": "x", "token": "t2", "break": True})
    assert broken["ok"] and broken["took_over"]["holder"] == "alice@laptop"
    from deploy.remote.host.fsutil import tail_jsonl
    events = tail_jsonl(f"{state}/journal.jsonl", 5)
    assert events[-1]["event"] == "break-lock" and events[-1]["broken"]["holder"] == "alice@laptop"
    # the run whose lock was broken notices at its next step, and cannot release the new holder's lock
    with pytest.raises(locks.LockLost, match="bob@desk"):
        locks.check(state, "t1")
    assert not locks.release(state, "t1")
    assert locks.release(state, "t2") and locks.read(state) is None


def test_a_lock_expires_and_one_held_by_a_dead_agent_is_stale(tmp_path):
    """Issue 9: locks never expired; a run cut off after taking one left every later run refused until someone
    broke it by hand. A lock now carries an expiry (renewed by each step of its run), and a lock taken for one
    agent call names that call's process: once the process is gone, so is the lock."""
    import subprocess
    import time
    state = _state(tmp_path)
    assert locks.acquire(state, {"holder": "gone@laptop", "token": "t1", "ttl": 1})["ok"]
    assert not locks.acquire(state, {"holder": "me", "token": "t2"})["ok"]
    time.sleep(1.2)
    got = locks.acquire(state, {"holder": "me", "token": "t2"})
    assert got["ok"] and got["took_over"]["holder"] == "gone@laptop"
    assert locks.check(state, "t2", extend=3600)["expires_ts"] > time.time() + 3500   # a step renews it
    locks.release(state, "t2")
    p = subprocess.Popen(["sleep", "30"])
    assert locks.acquire(state, {"holder": "agent", "token": "t3", "ttl": 3600}, agent_pid=p.pid)["ok"]
    assert not locks.acquire(state, {"holder": "me", "token": "t4"})["ok"]
    p.kill()
    p.wait()
    assert locks.stale(locks.read(state)) == f"its agent process {p.pid} is gone"
    assert locks.acquire(state, {"holder": "me", "token": "t4"})["ok"]


def test_lock_ops_through_the_agent(tmp_path):
    state = tmp_path / "state"
    assert result("lock.acquire", {"holder": "a", "command": "c", "token": "t1"}, state)["ok"]
    fin, _r, _p = call("lock.acquire", {"holder": "b", "command": "c", "token": "t2"}, state)
    assert fin["kind"] == "locked" and fin["holder"]["holder"] == "a"
    assert (state / "lock.json").stat().st_mode & 0o777 == 0o600
    assert result("lock.release", {"token": "t1"}, state) == {"released": True}


def test_overlay_guard(tmp_path):
    import hashlib
    sp = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (sp / "pkg").mkdir(parents=True)
    (sp / "pkg-1.0.dist-info").mkdir()
    (sp / "pkg" / "mod.py").write_text("ORIG\n")
    o = {"package": "pkg", "version": "1.0", "path": "pkg/mod.py",
         "sha256": hashlib.sha256(b"ORIG\n").hexdigest(), "new_sha256": hashlib.sha256(b"NEW\n").hexdigest()}
    (sp / "pkg-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n\n")
    assert overlay_check(str(tmp_path / "venv"), [o])[0]["ok"]
    assert "is 1.0 on the host" in overlay_check(str(tmp_path / "venv"), [dict(o, version="2.0")])[0]["why"]
    (sp / "pkg" / "mod.py").write_text("SOMEONE ELSE'S PATCH\n")
    [c] = overlay_check(str(tmp_path / "venv"), [o])
    assert not c["ok"] and "expects" in c["why"]
