"""sglang_ddtree_tools.hostload: what the host's CPUs and a server's processes did over a bench level. Parsers on captured
/proc text (fixtures/proc_stat_*.txt: this CI machine's, one second apart with one CPU kept busy; pid_stat_cat.txt:
a real /proc/PID/stat), readers on real processes; the CPU-speed probe pinned for real, its summary on a real
H200 host's reading (fixtures/cpuspeed_h200.txt: device.sh's `cpuspeed` output, 16 vCPUs)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_ddtree_tools import hostload
from sglang_ddtree_tools.servers import Server

FIX = Path(__file__).parent / "fixtures"


def test_proc_stat_capture_parses_into_the_whole_and_each_cpu():
    before = hostload.parse_proc_stat((FIX / "proc_stat_before.txt").read_text())
    after = hostload.parse_proc_stat((FIX / "proc_stat_after.txt").read_text())
    assert set(before) == set(after) == {"cpu", "cpu0", "cpu1"}  # intr, ctxt, ... are not cpu lines
    assert before["cpu"]["steal"] == 21628 and before["cpu1"]["user"] == 961573
    s = hostload.cpu_shares(before, after)
    # over that second 101 + 1 jiffies ran and 139 idled (one of the two CPUs spun): 42.3% busy, nothing stolen
    assert s == {"busy_pct": 42.3, "steal_pct": 0.0, "steal_max_pct": 0.0, "steal_max_cpu": 0}


def test_cpu_shares_count_steal_and_find_the_cpu_it_was_taken_from():
    a = hostload.parse_proc_stat("cpu 100 0 0 100 0 0 0 0\ncpu0 50 0 0 50 0 0 0 0\ncpu1 50 0 0 50 0 0 0 0\n")
    b = hostload.parse_proc_stat("cpu 150 0 10 220 10 0 0 10\ncpu0 60 0 5 120 5 0 0 10\ncpu1 90 0 5 100 5 0 0 0\n")
    s = hostload.cpu_shares(a, b)
    # 200 jiffies: 50 user + 10 system + 10 steal busy, 120 idle + 10 iowait
    assert s == {"busy_pct": 35.0, "steal_pct": 5.0, "steal_max_pct": 10.0, "steal_max_cpu": 0}
    assert hostload.cpu_shares(a, a) is None and hostload.cpu_shares({}, b) is None
    # an old kernel's shorter line, and junk, do not break the parse
    old = hostload.parse_proc_stat("cpu 1 2 3 4\ncpufreq x\ncpuX 1 2\ncpu2 a b c\n")
    assert old == {"cpu": {"user": 1, "nice": 2, "system": 3, "idle": 4, "iowait": 0, "irq": 0, "softirq": 0,
                           "steal": 0}}


def test_pid_stat_is_parsed_past_a_hostile_command_name():
    cat = hostload.parse_pid_stat((FIX / "pid_stat_cat.txt").read_text())
    assert cat["comm"] == "cat" and cat["state"] == "R" and cat["processor"] == 0 and cat["utime"] == 0 and cat["pgrp"] > 0
    line = (FIX / "pid_stat_cat.txt").read_text().replace("(cat)", "(a) R 1 2 3 (b c)")
    evil = hostload.parse_pid_stat(line)
    assert evil["comm"] == "a) R 1 2 3 (b c" and evil["pgrp"] == cat["pgrp"] and evil["processor"] == 0
    assert hostload.parse_pid_stat("") is None and hostload.parse_pid_stat("12 (x) R 1") is None


def test_busiest_processes_over_a_level():
    st = lambda ut, stime, cpu, comm="p": {"comm": comm, "state": "S", "pgrp": 1, "utime": ut,  # noqa: E731
                                           "stime": stime, "processor": cpu}
    before = {10: st(100, 0, 0, "scheduler"), 11: st(5, 5, 1, "tokenizer"), 12: st(7, 0, 2, "idle")}
    after = {10: st(280, 20, 3, "scheduler"), 11: st(10, 10, 1, "tokenizer"), 12: st(7, 0, 2, "idle"),
             13: st(30, 0, 5, "new")}
    got = hostload.busiest(before, after, wall_s=2.0, hz=100)
    assert [(r["comm"], r["cpu_s"], r["cpu_pct"], r["last_cpu"]) for r in got] == [
        ("scheduler", 2.0, 100.0, 3), ("new", 0.3, 15.0, 5), ("tokenizer", 0.1, 5.0, 1)]  # idle used nothing
    assert len(hostload.busiest(before, after, 2.0, 100, top=1)) == 1


def _spinning_group():
    """A real process group: a leader that forks a child which spins for a while, both sleeping after."""
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    t = time.time()\n"
            "    while time.time() - t < 0.6: pass\n"
            "    time.sleep(30)\n"
            "else:\n"
            "    time.sleep(30)\n")
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_level_watch_on_a_real_process_group():
    p = _spinning_group()
    try:
        deadline = time.time() + 10
        while len(hostload.group_pids(p.pid)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        pids = hostload.group_pids(p.pid)
        assert p.pid in pids and len(pids) == 2
        w = hostload.LevelWatch(lambda: hostload.group_pids(p.pid))
        time.sleep(0.8)
        h = w.done(0.8)
        assert h is not None and 0 <= h["steal_pct"] <= h["busy_pct"] <= 100
        top = h["procs"][0]
        assert top["pid"] != p.pid and top["cpu_s"] > 0.1 and top["comm"] and top["last_cpu"] >= 0
        assert "host: busy" in hostload.host_line(h) and f"on CPU {top['last_cpu']}" in hostload.host_line(h)
    finally:
        os.killpg(p.pid, 9)
        p.wait()
    assert hostload.read_pids([p.pid]) == {}  # gone: left out
    assert hostload.host_line(None) == ""

    def broken():
        raise TimeoutError("systemctl show timed out")
    w = hostload.LevelWatch(broken)
    time.sleep(0.2)
    assert w.done(0.2)["procs"] == []  # the figures are informative: never a failure


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_a_process_servers_pids_are_its_session(tmp_path):
    code = "import os, time\nos.fork()\ntime.sleep(30)\n"
    srv = Server([sys.executable, "-c", code], dict(os.environ), str(tmp_path / "s.log"), launcher="process")
    srv.start()
    try:
        deadline = time.time() + 10
        while len(srv.pids()) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert srv.proc.pid in srv.pids() and len(srv.pids()) == 2
    finally:
        srv.stop()
    assert srv.pids() == []  # a zombie left behind (this host's init may not reap) is not the server
    assert Server(["true"], {}, str(tmp_path / "n.log"), launcher="process").pids() == []


FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _cpuspeed_pass(line: str) -> dict:
    """One line of device.sh's `cpuspeed` ("cpuspeed pass N ms: CPU=ms ...") as {cpu: ms}."""
    return {int(c): float(v) for c, v in (w.split("=") for w in line.split(":", 1)[1].split())}


def test_speed_summary_of_a_real_hosts_reading():
    """The summary of a reading is its median and its extremes with their CPUs, whatever the figures; the same
    from a report's JSON (CPU numbers as strings); the line names them."""
    import statistics

    lines = (FIXTURES / "cpuspeed_h200.txt").read_text().splitlines()
    for line in lines:
        speeds = _cpuspeed_pass(line)
        assert sorted(speeds) == list(range(16))
        s = hostload.speed_summary(speeds)
        fast = min(speeds, key=lambda c: (speeds[c], c))
        slow = max(speeds, key=lambda c: (speeds[c], -c))
        assert s == {"median_ms": round(statistics.median(speeds.values()), 2), "fastest_ms": speeds[fast],
                     "fastest_cpu": fast, "slowest_ms": speeds[slow], "slowest_cpu": slow}
        assert s["fastest_ms"] <= s["median_ms"] <= s["slowest_ms"]
        assert hostload.speed_summary({str(c): v for c, v in speeds.items()}) == s
        assert (f"fastest {speeds[fast]} on CPU {fast}, slowest {speeds[slow]} on CPU {slow}"
                in hostload.speed_line(speeds, "before start"))
    assert hostload.speed_summary({}) is None and hostload.speed_summary(None) is None
    assert hostload.speed_line(None, "after stop") == "cpus after stop: no reading"


def test_sched_cpu_ms_is_the_speed_of_the_busiest_processs_cpu():
    host = {"busy_pct": 8.0, "steal_pct": 0.0, "procs": [
        {"comm": "sglang::schedul", "cpu_pct": 101.7, "last_cpu": 15}, {"comm": "python3", "cpu_pct": 13.8, "last_cpu": 2}]}
    assert hostload.sched_cpu_ms(host, {15: 347.2, 2: 274.1}) == 347.2
    assert hostload.sched_cpu_ms(host, {"15": 226.2}) == 226.2
    assert hostload.sched_cpu_ms(host, {2: 1.0}) is None  # that CPU was not read
    assert hostload.sched_cpu_ms({"procs": []}, {15: 1.0}) is None and hostload.sched_cpu_ms(host, None) is None
    assert hostload.host_line(dict(host, sched_cpu_ms=347.2)).endswith("; that CPU's loop 347.2 ms before start")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity (Linux)")
def test_cpu_speeds_pins_to_each_cpu_in_turn_and_restores_the_affinity():
    before = os.sched_getaffinity(0)
    seen = []

    def spin(n):  # where the probe runs while it measures
        seen.append(os.sched_getaffinity(0))
        return 1.5
    got = hostload.cpu_speeds(spin=spin)
    assert got == {c: 1.5 for c in sorted(before)} and seen == [{c} for c in sorted(before)]
    assert os.sched_getaffinity(0) == before
    # a CPU this machine does not have is left out, not an error; the real loop takes time
    real = hostload.cpu_speeds(cpus=[min(before), 4095], n=20000)
    assert list(real) == [min(before)] and real[min(before)] > 0 and os.sched_getaffinity(0) == before

    def broken(n):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        hostload.cpu_speeds(spin=broken)
    assert os.sched_getaffinity(0) == before  # restored even when the probe is interrupted
