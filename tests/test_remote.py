"""The agent runtime itself: one envelope, a deterministic zipapp, deadlines that kill whole process groups, the
op registry, and a hung command reported once within one deadline -- all run for real on this machine."""
from __future__ import annotations

import os
import io
import time
from pathlib import Path

import pytest

from agenthelpers import call, result
from deploy.remote import zipapp
from deploy.remote.host import envelope, main, proc


CAPTURES = Path(__file__).resolve().parent / "captures"


def test_envelope_round_trip_ignores_noise():
    text = "noise\n" + envelope.encode({"type": "event", "event": "x"}) + "more noise" + \
        envelope.encode({"type": "result", "result": {"a": 1}})
    objs = envelope.parse_output(text)
    assert [o["type"] for o in objs] == ["event", "result"]
    assert envelope.final(objs) == {"type": "result", "result": {"a": 1}}
    assert envelope.parse_line("@@DDTREE@@ {not json") is None


def test_zipapp_is_deterministic_and_holds_only_the_host_package():
    a = zipapp.build_from(zipapp.sources())
    b = zipapp.build_from(zipapp.sources())
    assert a.sha256 == b.sha256 and a.data == b.data
    import io
    import zipfile
    names = zipfile.ZipFile(io.BytesIO(a.data)).namelist()
    assert all(n.startswith("ddtree_agent/") and n.endswith(".py") for n in names)
    assert "ddtree_agent/main.py" in names and "ddtree_agent/loader.py" in names
    # every module of the host package travels (a step split into a new module is carried without a list to edit)
    own = {n.removeprefix("ddtree_agent/") for n in names if not n.startswith("ddtree_agent/vendor/")}
    assert own == {p.name for p in zipapp.HOST_DIR.glob("*.py")}
    assert {"release.py", "releasehost.py", "releasedir.py", "activation.py", "unitfiles.py", "routerunit.py",
            "services.py", "rollback.py", "secretcheck.py"} <= own


def test_zipapp_is_built_once_when_every_host_thread_asks_at_once(monkeypatch):
    """The host pool's threads all ask for the zipapp on their first call; one builds, the others wait for it
    (with a bare lru_cache each thread built its own copy, ~4 ms of CPU each under the GIL)."""
    import threading
    built = []
    real = zipapp.build_from

    def slow_build(files):
        built.append(1)
        time.sleep(0.2)  # widen the window in which a second thread could start its own build
        return real(files)
    monkeypatch.setattr(zipapp, "build_from", slow_build)
    cached = getattr(zipapp, "_build", zipapp.build)  # the lru_cache'd builder
    cached.cache_clear()
    try:
        start = threading.Barrier(8)
        got = []

        def ask():
            start.wait()
            got.append(zipapp.build())
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(built) == 1 and len(got) == 8 and all(a is got[0] for a in got)
    finally:
        cached.cache_clear()


def test_every_op_area_has_its_module_and_host_code_is_stdlib_only():
    """One line in main.OP_MODULES adds an area; the host package imports nothing outside the standard library
    (it runs on the hosts' system python3) but what the zipapp itself carries (zipapp.VENDORED)."""
    import ast
    import sys
    ops = main.load_ops()
    assert {o.split(".")[0] for o in ops} == set(main.OP_MODULES)
    for f in zipapp.HOST_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for m in mods:
                assert m.split(".")[0] in sys.stdlib_module_names or m.split(".")[0] in zipapp.VENDORED, (f.name, m)


def test_the_zipapp_carries_prometheus_client_and_the_unpacked_agent_parses_with_it(tmp_path):
    """The drain parses /metrics on the host with prometheus_client's own parser: the zipapp carries the package
    (vendor/), the loader unpacks it (and nothing outside plain identifiers), and the agent run the way the loader
    runs it (-I -S: no site-packages) imports it from there."""
    import subprocess
    import sys
    import zipfile
    from deploy.remote.host import loader
    z = zipapp.build()
    names = zipfile.ZipFile(io.BytesIO(z.data)).namelist()
    assert "ddtree_agent/vendor/prometheus_client/parser.py" in names and "ddtree_agent/metrics.py" in names
    assert not [n for n in names if "/twisted/" in n or "/django/" in n]
    up = tmp_path / "agent"
    loader.unpack(z.data, str(up))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from ddtree_agent import metrics; "
            "print(metrics.text_string_to_metric_families.__module__); "
            "print(metrics.serving(open(sys.argv[2]).read()))")
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(up), str(CAPTURES / "labserver-metrics-busy.txt")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "ddtree_agent.vendor.prometheus_client.parser"
    assert "'running': 3.0" in r.stdout
    bad = io.BytesIO()
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("ddtree_agent/vendor/x/../../evil.py", b"")
    with pytest.raises(Exception, match="zipapp member"):
        loader.unpack(bad.getvalue(), str(tmp_path / "bad"))


def test_a_deadline_kills_the_whole_process_group(tmp_path):
    """A command past its deadline is killed with its children (a hung nvidia-smi that forked helpers)."""
    marker = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {marker}; sleep 300"
    t = time.monotonic()
    r = proc.run(["sh", "-c", script], timeout=1.0)
    assert time.monotonic() - t < 5 and r["timed_out"] and r["rc"] is None
    child = int(marker.read_text())
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]


def test_a_hung_command_costs_the_probe_one_deadline(tmp_path):
    """Issue 9: with a hung nvidia-smi the probe took two 30 s timeouts and reported success. Now every command
    shares one deadline, the hung one (and its children) is killed, and the facts say what is missing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    n = 3000 + os.getpid() % 5000  # a sleep no one else runs: its survivors would be ours
    smi.write_text(f"#!/bin/sh\nsleep {n} &\nsleep {n}\n")
    smi.chmod(0o755)
    t = time.monotonic()
    raw = result("facts.probe", {"budget": 2}, tmp_path / "state", env={"PATH": f"{bindir}:/usr/bin:/bin"})
    took = time.monotonic() - t
    assert took < 6, took
    whats = {i["what"] for i in raw["incomplete"]}
    assert whats == {"nvidia_smi_query", "nvidia_smi_topo", "nvidia_smi"}, raw["incomplete"]
    assert raw["hostname"] and raw["os_release"]          # everything else still came back
    time.sleep(0.3)
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p) == f"sleep {n}"]


def _cmdline(p: Path) -> str:
    try:
        return p.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_unknown_op_and_errors_come_back_in_the_envelope(tmp_path):
    fin, _r, _p = call("no.such", {}, tmp_path / "state")
    assert fin["type"] == "error" and fin["kind"] == "unknown-op" and "facts.probe" in fin["error"]
    fin, _r, _p = call("provision.scan", {}, tmp_path / "state")
    assert fin["type"] == "error" and fin["kind"] == "exception" and "KeyError" in fin["error"]


def test_a_read_only_op_ends_at_its_deadline(tmp_path):
    """Whatever a read-only op waits on, the agent answers 'timeout' at the call's deadline and exits."""
    import time
    n = 9000 + os.getpid() % 900
    t = time.monotonic()
    fin, _r, _p = call("release.logs", {"instances": ["gpu0"], "n": 5}, tmp_path / "state", deadline=1,
                       env={"PATH": f"{_slow_bin(tmp_path, n)}:/usr/bin:/bin"})
    assert fin["type"] == "error" and fin["kind"] == "timeout" and time.monotonic() - t < 10
    time.sleep(0.3)
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cmdline(p) == f"sleep {n}"]   # killed, not left


def _slow_bin(tmp_path: Path, n: int) -> Path:
    d = tmp_path / "slowbin"
    d.mkdir()
    j = d / "journalctl"
    j.write_text(f"#!/bin/sh\nexec sleep {n}\n")
    j.chmod(0o755)
    return d
