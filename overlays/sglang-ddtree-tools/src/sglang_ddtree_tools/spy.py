"""Where a server's host time goes, without a profiler inside it: py-spy samples its processes from outside.

The torch profiler (``--profile-steps``) counts launches and GPU time well but inflates host time ~2.5x, and a
step here is host-bound, so it cannot say where the host's milliseconds go or compare two servers' host time.
``bench --spy PY_SPY`` starts each server under ``py-spy record --nonblocking --subprocesses --format raw`` (the
sampler reads the processes' memory from another CPU and never stops them) and :func:`summarize` turns the raw
capture into the scheduler's time per function: at ``--rate 1000`` one sample is ~1 ms of wall time, and only
samples where the scheduler's event loop is running count (start-up, graph capture and idle waits do not).

Pure functions (argv in, text in -> dict out); the bench runs them. py-spy's raw format: one line per distinct
stack, ``frame;frame;...;frame COUNT``, each frame ``function (file:line)``, the first frames
``process PID:"cmdline"`` with ``--subprocesses`` (a child's stack starts with its parents' and its own).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")
_PROCESS = re.compile(r'^process (?P<pid>\d+):"(?P<cmd>.*)"$', re.S)  # a command line may hold newlines

# a sample counts for the scheduler when one of these is on its stack (SGLang's scheduler loops)
EVENT_LOOPS = ("event_loop_normal", "event_loop_overlap", "event_loop_pp", "event_loop_normal_disagg")
# ... and not one of these: Triton's JIT compiling a kernel at its first use (the warm-up's, not a step's) and
# the loop's idle work between requests (SGLang 0.5.17's on_idle publishes its load snapshot)
EXCLUDE = ("_do_compile", "on_idle")


def spy_argv(py_spy: str, output: str, rate: int = 1000, cpus: Optional[Sequence[int]] = None,
             taskset: str = "taskset") -> List[str]:
    """The prefix that starts a server under py-spy (the server's own argv follows). ``cpus``: the CPUs the
    server (not the sampler) is pinned to, by ``taskset`` - not a Python wrapper: py-spy reads the first Python
    it sees in the process and would lose it at the exec - so the sampler stays on the clients' CPUs."""
    if not 1 <= int(rate) <= 10000:
        raise ValueError(f"py-spy rate {rate}: expected 1..10000 samples a second")
    argv = [py_spy, "record", "--rate", str(int(rate)), "--nonblocking", "--subprocesses", "--format", "raw",
            "--output", output, "--"]
    if cpus:
        argv += [taskset, "--cpu-list", ",".join(str(int(c)) for c in sorted(set(cpus)))]
    return argv


_RECORD_START = re.compile(r'^process \d+:"', re.M)


def _records(text: str) -> List[str]:
    """One string a stack. With ``--subprocesses`` every stack starts with ``process PID:"cmdline"``, and a
    command line may hold newlines (multiprocessing's spawn: ``-c from multiprocessing.spawn import ...\n...``),
    so a record runs from one such start to the next; without them, one a line."""
    starts = [m.start() for m in _RECORD_START.finditer(text)]
    if not starts:
        return text.splitlines()
    head = text[:starts[0]].splitlines()  # lines before the first process frame (none in py-spy's output)
    return head + [text[a:b].rstrip("\n") for a, b in zip(starts, starts[1:] + [len(text)])]


def _split_frames(stack: str) -> List[str]:
    """``;``-separated frames, where a quoted command line (a process frame) may itself hold ``;``."""
    frames, cur, quoted = [], [], False
    for ch in stack:
        if ch == '"':
            quoted = not quoted
        if ch == ";" and not quoted:
            frames.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    frames.append("".join(cur))
    return frames


def parse_raw(text: str) -> List[Tuple[List[str], int]]:
    """py-spy's raw (collapsed) output -> [(frames, count)]; records that are not ``stack COUNT`` are skipped."""
    out = []
    for rec in _records(text):
        stack, sep, count = rec.rstrip().rpartition(" ")
        if not sep or not count.isdigit() or not stack:
            continue
        out.append((_split_frames(stack), int(count)))
    return out


def frame_key(frame: str) -> str:
    """``func (path/to/file.py:123)`` -> ``func (file.py)``: one key per function, whatever line it was on."""
    m = _FRAME.match(frame)
    if not m:
        return frame
    return f"{m.group('func')} ({m.group('file').rsplit('/', 1)[-1]})"


def _process_of(frames: Sequence[str]) -> Optional[str]:
    """The sampled process: the last ``process`` frame (a child's stacks start with its parents' frames)."""
    pid = None
    for f in frames:
        m = _PROCESS.match(f)
        if not m:
            break
        pid = m.group("pid")
    return pid


def short_name(key_or_frame: str) -> str:
    """``Scheduler.run_batch (scheduler.py)`` -> ``run_batch``: what a mark or a loop name matches (py-spy names
    methods by their qualified name)."""
    return key_or_frame.split(" (", 1)[0].rsplit(".", 1)[-1]


def _in_loop(frames: Sequence[str]) -> bool:
    return any(short_name(f) in EVENT_LOOPS for f in frames)


def summarize(text: str, top: int = 40, steps: Optional[float] = None,
              marks: Iterable[str] = (), exclude: Sequence[str] = EXCLUDE) -> Dict[str, object]:
    """The scheduler's busy samples of one server: total, per function inclusive (each function once a stack)
    and self (the leaf), the heaviest ``top`` of each; ``per_step`` in samples (ms at 1 kHz) where ``steps``
    (decode steps while sampled) is given. ``marks``: function names whose inclusive samples are reported even
    when they are not among the heaviest (e.g. the plugin's phases). Stacks through a function of ``exclude``
    are left out (counted in ``excluded``)."""
    # one pass: the scheduler loop's stacks, by process (the others never count)
    loop = [(_process_of(frames), frames, n) for frames, n in parse_raw(text) if _in_loop(frames)]
    by_proc: Counter = Counter()
    for pid, _, n in loop:
        by_proc[pid] += n
    if not by_proc:
        return {"samples": 0, "process": None, "excluded": {}, "inclusive": [], "self": [], "marks": {}}
    proc = by_proc.most_common(1)[0][0]  # the scheduler (TP rank 0: the busiest loop)
    incl: Counter = Counter()
    leaf: Counter = Counter()
    excluded: Counter = Counter()
    total = 0
    for pid, frames, n in loop:
        if pid != proc:
            continue
        keys = [frame_key(f) for f in frames if not _PROCESS.match(f)]
        names = {short_name(k) for k in keys}
        hit = next((x for x in exclude if x in names), None)
        if hit:
            excluded[hit] += n
            continue
        total += n
        for k in set(keys):
            incl[k] += n
        if keys:
            leaf[keys[-1]] += n

    def per_step(v: int) -> Dict[str, float]:
        return {"per_step": round(v / steps, 3)} if steps else {}

    def rows(counter: Counter) -> List[Dict[str, object]]:
        return [{"function": k, "samples": v, "share": round(v / total, 4), **per_step(v)}
                for k, v in counter.most_common(top)]

    marks_out = {}
    for m in sorted(set(marks)):
        v = sum(c for k, c in incl.items() if short_name(k) == m)
        marks_out[m] = {"samples": v, **per_step(v)}
    return {"samples": total, "process": proc, "steps": steps, "excluded": dict(excluded),
            "per_step": round(total / steps, 3) if steps else None,
            "inclusive": rows(incl), "self": rows(leaf), "marks": marks_out}


def format_summary(s: Dict[str, object], n: int = 25) -> str:
    """A few lines for a log: the heaviest inclusive functions of the scheduler, in samples (and per step)."""
    if not s.get("samples"):
        return "spy: no scheduler samples"
    head = f"spy: {s['samples']} scheduler samples" + (f", {s['per_step']} a step" if s.get("per_step") else "") \
        + "".join(f", {v} in {k} left out" for k, v in (s.get("excluded") or {}).items())
    lines = [head]
    for r in s["inclusive"][:n]:
        lines.append(f"    {r['samples']:7d} {100 * r['share']:5.1f}%"
                     + (f" {r['per_step']:7.3f}/step" if "per_step" in r else "") + f"  {r['function']}")
    for m, v in (s.get("marks") or {}).items():
        lines.append(f"    mark {m}: {v['samples']}" + (f" ({v['per_step']}/step)" if "per_step" in v else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m sglang_ddtree_tools.spy CAPTURE``: a kept raw capture (bench's ``OUT/spy/*.txt``) read again."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m sglang_ddtree_tools.spy", description=main.__doc__.split(": ", 1)[1])
    ap.add_argument("capture", help="py-spy raw output (record --format raw --subprocesses)")
    ap.add_argument("--steps", type=float,
                    help="decode steps while it was sampled (bench reports them): per-step figures")
    ap.add_argument("--top", type=int, default=40, help="functions listed (default 40)")
    ap.add_argument("--mark", action="append", default=[], help="a function name always reported (repeatable)")
    ap.add_argument("--keep", action="append", default=[], choices=EXCLUDE,
                    help="count this otherwise left-out part too (repeatable)")
    ap.add_argument("--json", action="store_true", help="the summary as JSON")
    a = ap.parse_args(argv)
    if a.steps is not None and a.steps <= 0:
        ap.error("--steps must be positive")
    if a.top < 1:
        ap.error("--top must be at least 1")
    try:
        with open(a.capture, errors="replace") as fh:
            text = fh.read()
    except OSError as e:
        print(f"spy: cannot read {a.capture}: {e.strerror}", file=sys.stderr)
        return 2
    s = summarize(text, top=a.top, steps=a.steps, marks=a.mark,
                  exclude=tuple(x for x in EXCLUDE if x not in a.keep))
    print(json.dumps(s, indent=1) if a.json else format_summary(s, a.top))
    return 0 if s["samples"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
