"""The agent's drain (deploy/remote/host/drain.py) against the real sglang-router 0.3.2 (its wheel, unpacked, run
through bin/router_launch.py) and two lab stand-in servers, all on this machine's loopback: a batch taken out
together, the requests it was serving finishing, put back healthy; a server that never drains given up on at the
deadline; a router that does not answer is an error, not a silent restart."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

from deploy.release import router as routermod
from deploy.remote.host import drain

ROOT = Path(__file__).resolve().parents[2]
LABSERVER = ROOT / "deploy" / "labserver" / "server.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if pred():
                return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drain")
    zipfile.ZipFile(routermod.wheel().path).extractall(tmp / "wheel")
    ports = [free_port(), free_port()]
    procs = []
    for i, port in enumerate(ports):
        env = {"PATH": "/usr/bin:/bin", "LABSERVER_TOKEN_SECONDS": "0.05", **({"LABSERVER_NEVER_DRAINS": "1"} if i else {})}
        procs.append(subprocess.Popen(["/usr/bin/python3", "-I", str(LABSERVER), "--model-path", "/models/m",
                                       "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
                                       "--speculative-algorithm", "DDTREE", "--enable-metrics"], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    rport, mport = free_port(), free_port()
    code = ("import sys; sys.path[:0] = sys.argv[1:3]; import router_launch; "
            "sys.exit(router_launch.main(sys.argv[3:]))")
    args = ["--", "--host", "127.0.0.1", "--port", str(rport), "--policy", "round_robin", "--prometheus-host",
            "127.0.0.1", "--prometheus-port", str(mport), "--health-check-interval-secs", "1",
            "--worker-urls"] + [f"http://127.0.0.1:{p}" for p in ports]
    log = open(tmp / "router.log", "w")
    procs.append(subprocess.Popen([sys.executable, "-I", "-c", code, str(tmp / "wheel"), str(ROOT / "deploy" / "release"),
                                   *args], stdout=log, stderr=subprocess.STDOUT))
    spec = {"address": "127.0.0.1", "port": rport, "api_key_file": None, "timeout": 10,
            "workers": {"gpu0": f"http://127.0.0.1:{ports[0]}", "gpu1": f"http://127.0.0.1:{ports[1]}"}}
    try:
        assert wait(lambda: len([w for w in drain.workers(spec).values() if w["is_healthy"]]) == 2), \
            (tmp / "router.log").read_text()[-2000:]
        yield {"spec": spec, "ports": ports, "router": f"http://127.0.0.1:{rport}", "procs": procs}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)


def stream(base, n, out):
    body = json.dumps({"text": "x", "stream": True, "sampling_params": {"max_new_tokens": n}}).encode()
    req = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            out.append(sum(1 for line in r if line.startswith(b"data: {")))
    except Exception as exc:
        out.append(repr(exc))


def test_a_batch_drains_its_requests_and_comes_back(fleet):
    spec, ports = fleet["spec"], fleet["ports"]
    spec = dict(spec, workers={"gpu0": spec["workers"]["gpu0"]})
    got = []
    ths = [threading.Thread(target=stream, args=(fleet["router"], 30, got)) for _ in range(4)]  # 1.5 s each
    for t in ths:
        t.start()
    assert wait(lambda: drain.server_load(ports[0])[0] >= 1, 5)
    res = drain.take_out(spec, {"gpu0": (ports[0], "127.0.0.1")})["gpu0"]
    assert res["removed"] and res["drained"] and not res["timed_out"] and res["in_flight"] == 0
    assert res["in_flight_at_start"] >= 1 and res["seconds"] > 0.3, res
    assert spec["workers"]["gpu0"] not in drain.workers(spec)
    for t in ths:
        t.join()
    assert got == [30] * 4, got  # nothing cut: the router let what it proxied run to its end
    assert drain.warm_up(ports[0])["ok"]
    back = drain.put_back(spec, "gpu0")
    assert back["ok"] and drain.workers(spec)[spec["workers"]["gpu0"]]["is_healthy"], back


def test_a_server_that_never_drains_is_given_up_on_at_the_deadline(fleet):
    spec, ports = dict(fleet["spec"], timeout=1.5), fleet["ports"]
    t = time.monotonic()
    res = drain.take_out(spec, {"gpu1": (ports[1], "127.0.0.1")})["gpu1"]
    assert res["timed_out"] and not res["drained"] and res["in_flight"] == 1 and 1.5 <= res["seconds"] < 3, res
    assert time.monotonic() - t < 4
    assert drain.put_back(spec, "gpu1")["ok"]


def test_a_router_that_does_not_answer_is_an_error(fleet):
    dead = dict(fleet["spec"], port=free_port())
    assert drain.alive(dead)[0] is False
    with pytest.raises(RuntimeError, match="did not list its workers"):
        drain.take_out(dead, {"gpu0": (fleet["ports"][0], "127.0.0.1")})


# ---------------------------------------------------------------- the reading of a server: idle, busy or unknown

def test_a_reading_is_idle_busy_or_unknown():
    page = "sglang:num_running_reqs{{model_name=\"m\"}} {r}\nsglang:num_queue_reqs{{model_name=\"m\"}} {q}\n"
    assert drain.reading(200, page.format(r=0, q=0))[:2] == (drain.IDLE, 0)
    assert drain.reading(200, page.format(r=2, q=1))[:2] == (drain.BUSY, 3)
    refused = urllib.error.URLError(ConnectionRefusedError(111, "Connection refused"))
    assert drain.reading(None, None, refused)[:2] == (drain.IDLE, 0)  # nothing listens: nothing in flight
    for err in (TimeoutError("timed out"), urllib.error.URLError(TimeoutError("timed out")),
                ConnectionResetError(104, "Connection reset by peer")):
        st, n, detail = drain.reading(None, None, err)
        assert (st, n) == (drain.UNKNOWN, None) and detail.startswith("/metrics"), (err, detail)
    assert drain.reading(None, None, TimeoutError("timed out"))[2] == "/metrics timed out"
    assert drain.reading(503, "")[:2] == (drain.UNKNOWN, None)
    assert drain.reading(200, "# nothing sglang here\nprocess_cpu_seconds_total 3\n")[:2] == (drain.UNKNOWN, None)


def test_a_stopped_server_is_unknown_and_waited_on_to_the_deadline(fleet):
    """A SIGSTOPped server (hung) accepts the connection and never answers /metrics: the drain does not call it
    drained; it waits until the deadline and says the count is unknown."""
    spec, ports = dict(fleet["spec"], timeout=2.0), fleet["ports"]
    pid = next(p for p in fleet["procs"] if str(ports[0]) in p.args)
    os.kill(pid.pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        res = drain.take_out(spec, {"gpu0": (ports[0], "127.0.0.1")})["gpu0"]
        took = time.monotonic() - t
    finally:
        os.kill(pid.pid, signal.SIGCONT)
    assert res["removed"] and res["timed_out"] and not res["drained"] and res["in_flight"] is None, res
    assert "timed out" in res["detail"] and took >= 2.0, (res, took)
    assert wait(lambda: drain.server_load(ports[0])[0] == 0, 10)
    assert drain.put_back(spec, "gpu0")["ok"]


def test_prune_takes_out_only_the_workers_the_release_does_not_name(fleet):
    spec, ports = fleet["spec"], fleet["ports"]
    alias = f"http://localhost:{ports[0]}"  # the same server under a url no release names
    code, _d, raw = drain._router(spec, "POST", "/workers", {"url": alias})
    assert code in (200, 201, 202), raw
    assert wait(lambda: alias in drain.workers(spec), 15)
    expected = dict(spec, expected=sorted(spec["workers"].values()))
    assert drain.prune(expected, keep=[alias]) == []          # a url the run handles itself stays
    [res] = drain.prune(expected)
    assert res["url"] == alias and res["removed"] and res["drained"], res
    assert sorted(drain.workers(spec)) == sorted(spec["workers"].values())
