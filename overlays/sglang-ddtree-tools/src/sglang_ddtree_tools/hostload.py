"""What the host's CPUs did while a bench level ran: the machine's busy and stolen time, and the server's processes.

On the H200's host (a virtual machine: 16 vCPUs, "Intel(R) Xeon(R) Processor") one server instance of the same code
ran 1511 tok/s and the next 2292, prefill included: a whole instance is slow or fast. Whether that is time the
hypervisor took (``steal`` in /proc/stat), other load on the machine, or where the server's scheduler process ran,
these figures say per level, next to its tok/s:

* ``busy_pct`` / ``steal_pct``: of all CPUs' time over the level (/proc/stat's ``cpu`` line, before and after);
* ``steal_max_pct``: the most stolen from one CPU over the level, and on which;
* ``procs``: the server's busiest processes over the level (by CPU time: /proc/PID/stat's utime + stime), each
  with its command name, CPU seconds and share of the level's wall time, and the CPU it last ran on.

Pure parsers (tested on captured text) and two small readers of /proc; on a host without /proc every reader
returns None and the level has no ``host`` figures.

And each CPU's speed right before a server starts and right after it stops (:func:`cpu_speeds`: one short Python
loop pinned to each CPU in turn, nothing of the bench's running). Why: on the H200's host the same pinned loop took
198-470 ms from one vCPU to another and, on one vCPU, 220 then 411 ms minutes apart (benchmarks/results/h200_b127_overlap_cpu_speed,
``cpuspeed``), with no steal in /proc/stat: a vCPU shares its physical core with load this machine cannot see. A
host-bound decode step is as slow as the CPU its scheduler lands on, so a level's figures are read against that
CPU's speed (``sched_cpu_ms``: the before-start speed of the CPU the busiest server process last ran on).
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Dict, Iterable, List, Optional, Tuple

# /proc/stat's cpu columns, in order (proc(5)); guest time is already inside user/nice
COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
IDLE = ("idle", "iowait")


def parse_proc_stat(text: str) -> Dict[str, Dict[str, int]]:
    """/proc/stat -> {"cpu": {...}, "cpu0": {...}, ...}: the jiffies of each column of COLUMNS (a missing column,
    as on old kernels, is 0). Lines that are not cpu lines, or not numbers, are left out."""
    out: Dict[str, Dict[str, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or not (parts[0] == "cpu" or parts[0][3:].isdigit()):
            continue
        try:
            vals = [int(x) for x in parts[1:1 + len(COLUMNS)]]
        except ValueError:
            continue
        vals += [0] * (len(COLUMNS) - len(vals))
        out[parts[0]] = dict(zip(COLUMNS, vals))
    return out


def cpu_shares(before: Dict[str, Dict[str, int]], after: Dict[str, Dict[str, int]]) -> Optional[dict]:
    """Busy and stolen shares of the CPUs' time between two /proc/stat readings (percent, one decimal); None where
    the readings have no common ``cpu`` line or no time passed."""
    def share(name: str) -> Optional[Tuple[float, float]]:
        a, b = before.get(name), after.get(name)
        if not a or not b:
            return None
        d = {k: max(0, b[k] - a[k]) for k in COLUMNS}
        total = sum(d.values())
        if total <= 0:
            return None
        busy = total - sum(d[k] for k in IDLE)
        return 100.0 * busy / total, 100.0 * d["steal"] / total

    whole = share("cpu")
    if whole is None:
        return None
    per = {n: share(n) for n in after if n != "cpu"}
    per = {n: s for n, s in per.items() if s is not None}
    worst = max(per.items(), key=lambda kv: kv[1][1], default=None)
    return {"busy_pct": round(whole[0], 1), "steal_pct": round(whole[1], 1),
            "steal_max_pct": round(worst[1][1], 1) if worst else None,
            "steal_max_cpu": int(worst[0][3:]) if worst else None}


def stat_fields(text: str) -> Optional[List[str]]:
    """/proc/PID/stat's fields after the command (state, ppid, pgrp, ...: field N is item N - 3). The command sits
    in parentheses and may hold spaces and parentheses itself: it ends at the last ``)``. None where there is none."""
    head, sep, rest = text.rpartition(")")
    return rest.split() if sep and "(" in head else None


def parse_pid_stat(text: str) -> Optional[dict]:
    """/proc/PID/stat -> {"comm", "state", "pgrp", "utime", "stime", "processor"} (clock ticks; ``processor``: the
    CPU it last ran on; the command as :func:`stat_fields` bounds it). None where the text is not such a line."""
    f = stat_fields(text)
    if f is None:
        return None
    comm = text.rpartition(")")[0].split("(", 1)[1]
    try:  # field N is f[N - 3]
        return {"comm": comm[:32], "state": f[0][:1], "pgrp": int(f[2]), "utime": int(f[11]), "stime": int(f[12]),
                "processor": int(f[36])}
    except (IndexError, ValueError):
        return None


def busiest(before: Dict[int, dict], after: Dict[int, dict], wall_s: float, hz: int, top: int = 4) -> List[dict]:
    """The processes that used the most CPU between two readings ({pid: parse_pid_stat}), busiest first: command,
    CPU seconds, share of the wall time (percent of one CPU), the CPU each last ran on. A process that started
    during the level counts from 0; one that ended is not seen."""
    rows = []
    for pid, b in after.items():
        a = before.get(pid)
        used = (b["utime"] + b["stime"]) - ((a["utime"] + a["stime"]) if a else 0)
        if used <= 0:
            continue
        cpu_s = used / hz
        rows.append({"pid": pid, "comm": b["comm"], "cpu_s": round(cpu_s, 3),
                     "cpu_pct": round(100.0 * cpu_s / wall_s, 1) if wall_s > 0 else None,
                     "last_cpu": b["processor"]})
    rows.sort(key=lambda r: (-r["cpu_s"], r["pid"]))
    return rows[:top]


def read_proc_stat(path: str = "/proc/stat") -> Optional[Dict[str, Dict[str, int]]]:
    try:
        with open(path) as fh:
            return parse_proc_stat(fh.read())
    except OSError:
        return None


def read_pids(pids: Iterable[int], proc: str = "/proc") -> Dict[int, dict]:
    """parse_pid_stat of each pid still there (a pid that is gone, or unreadable, is left out)."""
    out = {}
    for pid in pids:
        try:
            with open(os.path.join(proc, str(int(pid)), "stat")) as fh:
                st = parse_pid_stat(fh.read())
        except (OSError, ValueError):
            continue
        if st:
            out[int(pid)] = st
    return out


def group_pids(pgid: int, proc: str = "/proc") -> List[int]:
    """The live pids of process group ``pgid`` (a server started in its own session: every process it forked); a
    zombie is not live (in a container whose init does not reap, an exited process stays one)."""
    found = []
    try:
        names = os.listdir(proc)
    except OSError:
        return []
    for d in names:
        if d.isdigit():
            st = read_pids([int(d)], proc).get(int(d))
            if st and st["pgrp"] == pgid and st["state"] != "Z":
                found.append(int(d))
    return sorted(found)


def clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


SPIN_N = 400_000  # ~10-25 ms a CPU: 16 CPUs in well under a second


def spin_ms(n: int = SPIN_N) -> float:
    """Wall ms of one Python loop of ``n`` additions: the interpreter's speed where it runs (a decode step's host
    time is this kind of work)."""
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i
    return (time.perf_counter() - t) * 1000.0


def cpu_speeds(cpus: Optional[Iterable[int]] = None, n: int = SPIN_N, spin=spin_ms) -> Optional[Dict[int, float]]:
    """{cpu: ms of :func:`spin_ms`} with this thread pinned to each CPU in turn (default: every CPU of the machine
    this thread may be moved to; one it may not is left out), its own affinity restored after. None where the
    platform cannot pin a thread."""
    if not (hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")):
        return None
    allowed = os.sched_getaffinity(0)
    todo = sorted(range(os.cpu_count() or 0) if cpus is None else {int(c) for c in cpus})
    out: Dict[int, float] = {}
    try:
        for c in todo:
            try:
                os.sched_setaffinity(0, {c})
            except (OSError, ValueError):  # offline, outside this cgroup's cpuset
                continue
            out[c] = round(spin(n), 2)
    finally:
        os.sched_setaffinity(0, allowed)
    return out


def speed_summary(speeds: Optional[Dict]) -> Optional[dict]:
    """A CPU-speed reading's median and extremes: {"median_ms", "fastest_ms", "fastest_cpu", "slowest_ms",
    "slowest_cpu"} (keys may be ints or, from JSON, digit strings); None where it is empty."""
    if not speeds:
        return None
    items = sorted(((float(v), int(k)) for k, v in speeds.items()), key=lambda kv: (kv[0], kv[1]))
    return {"median_ms": round(statistics.median(v for v, _ in items), 2), "fastest_ms": items[0][0],
            "fastest_cpu": items[0][1], "slowest_ms": items[-1][0], "slowest_cpu": items[-1][1]}


def sched_cpu_ms(host: Optional[dict], speeds: Optional[Dict]) -> Optional[float]:
    """The speed (:func:`cpu_speeds`) of the CPU the level's busiest server process last ran on (the scheduler:
    it is ~100% busy while a server decodes); None where either is unknown."""
    procs = (host or {}).get("procs") or []
    if not procs or not speeds:
        return None
    cpu = procs[0].get("last_cpu")
    v = speeds.get(cpu, speeds.get(str(cpu)))
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def speed_line(speeds: Optional[Dict], when: str) -> str:
    """The log's line for one CPU-speed reading."""
    s = speed_summary(speeds)
    if not s:
        return f"cpus {when}: no reading"
    return (f"cpus {when}: loop median {s['median_ms']} ms (fastest {s['fastest_ms']} on CPU {s['fastest_cpu']}, "
            f"slowest {s['slowest_ms']} on CPU {s['slowest_cpu']})")


class LevelWatch:
    """Reads the host before a level and, with :meth:`done`, after it: the level's ``host`` figures (None where
    the host has no /proc). ``pids``: a callable giving the server's pids (asked at both ends)."""

    def __init__(self, pids=lambda: []):
        self._pids = pids
        self._stat = read_proc_stat()
        self._procs = read_pids(self._safe_pids())

    def _safe_pids(self) -> List[int]:
        try:
            return list(self._pids())
        except Exception:  # noqa: BLE001 - informative figures: a systemctl that timed out never fails a level
            return []

    def done(self, wall_s: float) -> Optional[dict]:
        after = read_proc_stat()
        if self._stat is None or after is None:
            return None
        shares = cpu_shares(self._stat, after)
        if shares is None:
            return None
        procs = busiest(self._procs, read_pids(self._safe_pids()), wall_s, clock_ticks())
        return dict(shares, procs=procs)


def host_line(h: Optional[dict]) -> str:
    """The per-level log line's host part."""
    if not h:
        return ""
    top = ", ".join(f"{p['comm']} {p['cpu_pct']}% on CPU {p['last_cpu']}" for p in h.get("procs") or [])
    steal = f"steal {h['steal_pct']}%"
    if h.get("steal_max_pct"):
        steal += f" (CPU {h['steal_max_cpu']}: {h['steal_max_pct']}%)"
    speed = f"; that CPU's loop {h['sched_cpu_ms']} ms before start" if h.get("sched_cpu_ms") is not None else ""
    return f"host: busy {h['busy_pct']}%, {steal}" + (f"; server: {top}" if top else "") + speed
