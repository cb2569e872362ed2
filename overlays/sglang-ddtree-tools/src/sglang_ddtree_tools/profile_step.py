"""Where a speculative decode step's time goes, from a torch-profiler trace of a real SGLang server.

``summarize_trace(trace)`` is pure (tests/plugin/test_profile_step.py, on a trace in the Chrome-trace form
torch.profiler writes);
``profile_server(base, out_dir, steps, ...)`` asks a running SGLang 0.5.17 server to profile ``steps``
scheduler steps (its own ``/start_profile`` endpoint: torch.profiler with CPU and CUDA activities) while a
request decodes, then summarizes the trace it wrote.

The DDTREE worker names its phases with ``torch.profiler.record_function`` (``ddtree.draft``,
``ddtree.tree_verify``, ``ddtree.accept``, ``ddtree.commit`` and finer ``ddtree.*`` ranges inside them).
Per range the summary gives, per step: host wall time (the range's CPU duration), CUDA launches
(kernel launches, memcpys/memsets and graph launches), host syncs (``cudaStreamSynchronize`` /
``cudaDeviceSynchronize`` / ``cudaEventSynchronize`` / blocking ``cudaMemcpy``, and ``aten::item`` /
``aten::_local_scalar_dense`` calls) and the GPU time of the kernels those launches ran (matched by the
trace's correlation ids; a graph launch's kernels count for the range that launched the graph).  A
runtime call is attributed to the innermost range that encloses it on the same thread.

``syncs`` adds every runtime wait and every scalar read, so a device ``.item()`` (an ``aten::item`` around
``aten::_local_scalar_dense`` around a copy and a ``cudaStreamSynchronize``) counts two or three times and a
host tensor's ``.item()`` (no GPU wait at all) once; it is kept as it was, comparable with earlier runs.
Apart from it: ``runtime_syncs`` (the runtime's waits: what stalls the host on the GPU), ``item_calls``
(scalar reads, an ``aten::item`` and its inner ``_local_scalar_dense`` once) and ``host_items`` (those of them
with no runtime wait inside: host tensors, Python overhead only).

``wait_sites`` says where each GPU wait and scalar read came from, inside the plugin's ranges or not (SGLang's
scheduler around the step): the innermost Python frame of the caller, from the stacks SGLang's profiler records.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import threading
import time
from typing import Dict, List, Optional

SYNC_RUNTIME = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SYNC_OPS = ("aten::item", "aten::_local_scalar_dense")
LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch",
                   "cudaLaunchKernelExC", "cuLaunchKernelEx")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


COUNTS = ("launches", "graph_launches", "syncs", "runtime_syncs", "item_calls", "host_items")


def _is_wait(e: dict) -> bool:
    """A runtime call that blocks the host on the GPU (an async copy does not)."""
    name = str(e.get("name", ""))
    return name.startswith(SYNC_RUNTIME) and not name.startswith("cudaMemcpyAsync")


def _scalar_reads(ops: List[dict], runtime: List[dict]):
    """The ids of the scalar-read events that are calls (an ``aten::item`` or a ``_local_scalar_dense`` outside
    one: one per ``.item()``), and of those with no runtime wait inside them on their thread (host tensors)."""
    def inside(e, outer):
        return (e.get("pid"), e.get("tid")) == (outer.get("pid"), outer.get("tid")) and \
            float(outer["ts"]) <= float(e.get("ts", 0)) <= float(outer["ts"]) + float(outer.get("dur", 0))

    items = [e for e in ops if e.get("name") == "aten::item"]
    calls = items + [e for e in ops if e.get("name") != "aten::item" and not any(inside(e, i) for i in items)]
    waits = [e for e in runtime if _is_wait(e)]
    host = {id(c) for c in calls if not any(inside(w, c) for w in waits)}
    return {id(c) for c in calls}, host


def _events(trace) -> List[dict]:
    ev = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    return [e for e in ev if isinstance(e, dict) and e.get("ph") == "X"]


def summarize_trace(trace, prefix: str = "ddtree.", steps_hint: int = 0, top: int = 25) -> Dict:
    """Per ``prefix*`` range: calls, host ms, launches, syncs and GPU ms - totals and per step (a step is one
    call of the first top-level range, ``ddtree.draft``, when present; else ``steps_hint``, the steps asked
    of the profiler). Also, for the whole trace (every thread, so a server without the ranges - plain or
    SGLang's DFLASH - is measured the same way): ``totals`` (launches, graph launches, syncs, GPU ms, and
    ``span_ms``, first to last GPU activity) and ``kernels``, the ``top`` kernel names by GPU time (a graph's
    kernels by their own names). Each range also gets its own ``top_kernels`` (inclusive, 8 names)."""
    ev = _events(trace)
    ranges = [e for e in ev if e.get("cat") in ("user_annotation", "cpu_op") and str(e.get("name", "")).startswith(prefix)]
    runtime = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    ops = [e for e in ev if e.get("cat") == "cpu_op" and e.get("name") in SYNC_OPS]
    items, host_items = _scalar_reads(ops, runtime)
    gpu = {}
    gpu_names: Dict[object, Dict[str, float]] = {}
    kernels: Dict[str, List[float]] = {}
    gpu_total = 0.0
    first, last = None, None
    for e in ev:
        if e.get("cat") in GPU_CATS:
            c = (e.get("args") or {}).get("correlation")
            d = float(e.get("dur", 0))
            t = float(e.get("ts", 0))
            first = t if first is None else min(first, t)
            last = t + d if last is None else max(last, t + d)
            gpu_total += d
            k = kernels.setdefault(_kernel_name(e), [0, 0.0])
            k[0] += 1
            k[1] += d
            if c is not None:
                gpu[c] = gpu.get(c, 0.0) + d
                by = gpu_names.setdefault(c, {})
                by[_kernel_name(e)] = by.get(_kernel_name(e), 0.0) + d
    by_thread: Dict[tuple, List[dict]] = {}
    for r in ranges:
        by_thread.setdefault((r.get("pid"), r.get("tid")), []).append(r)

    def innermost(e) -> Optional[dict]:
        return _innermost(e, by_thread)

    stats: Dict[str, Dict] = {}

    def slot(name):
        return stats.setdefault(name, {"calls": 0, "host_ms": 0.0, "launches": 0, "graph_launches": 0,
                                       "syncs": 0, "runtime_syncs": 0, "item_calls": 0, "host_items": 0,
                                       "gpu_ms": 0.0})

    for r in ranges:
        s = slot(r["name"])
        s["calls"] += 1
        s["host_ms"] += float(r.get("dur", 0)) / 1000.0
    # self attribution first, then roll children up into their enclosing ranges (inclusive figures)
    self_stats: Dict[int, Dict] = {}
    for e in runtime + ops:
        r = innermost(e)
        if r is None:
            continue
        st = self_stats.setdefault(id(r), {"r": r, "launches": 0, "graph_launches": 0, "syncs": 0,
                                           "runtime_syncs": 0, "item_calls": 0, "host_items": 0, "gpu_ms": 0.0,
                                           "kernels": {}})
        name = str(e.get("name", ""))
        if e.get("cat") == "cpu_op":
            st["syncs"] += 1
            st["item_calls"] += id(e) in items
            st["host_items"] += id(e) in host_items
            continue
        if name.startswith(LAUNCH_PREFIXES):
            st["launches"] += 1
            if name.startswith("cudaGraphLaunch"):
                st["graph_launches"] += 1
        if _is_wait(e):
            st["syncs"] += 1
            st["runtime_syncs"] += 1
        c = (e.get("args") or {}).get("correlation")
        if c is not None:
            st["gpu_ms"] += gpu.get(c, 0.0) / 1000.0
            for kn, d in gpu_names.get(c, {}).items():
                st["kernels"][kn] = st["kernels"].get(kn, 0.0) + d
    for st in self_stats.values():
        r = st["r"]
        t0, t1 = float(r["ts"]), float(r["ts"]) + float(r.get("dur", 0))
        for a in by_thread.get((r.get("pid"), r.get("tid")), ()):  # r itself and every range enclosing it
            if float(a["ts"]) <= t0 and t1 <= float(a["ts"]) + float(a.get("dur", 0)):
                s = slot(a["name"])
                for k in COUNTS:
                    s[k] += st[k]
                s["gpu_ms"] += st["gpu_ms"]
                kk = s.setdefault("_kernels", {})
                for kn, d in st["kernels"].items():
                    kk[kn] = kk.get(kn, 0.0) + d
    steps = stats.get(prefix + "draft", {}).get("calls") or 0
    per = steps or steps_hint
    launches = sum(1 for e in runtime if str(e.get("name", "")).startswith(LAUNCH_PREFIXES))
    graphs = sum(1 for e in runtime if str(e.get("name", "")).startswith("cudaGraphLaunch"))
    runtime_syncs = sum(1 for e in runtime if _is_wait(e))
    totals = {"launches": launches, "graph_launches": graphs, "syncs": runtime_syncs + len(ops),
              "runtime_syncs": runtime_syncs, "item_calls": len(items), "host_items": len(host_items),
              "gpu_ms": gpu_total / 1000.0, "span_ms": ((last - first) / 1000.0) if first is not None else 0.0}
    out = {"steps": steps, "gpu_ms_total": round(gpu_total / 1000.0, 3), "ranges": {},
           "totals": {k: round(v, 3) for k, v in totals.items()}}
    if per:
        out["totals_per_step"] = {k: round(v / per, 4) for k, v in totals.items()}
        out["steps_for_per_step"] = per
    out["kernels"] = [{"name": n, "calls": c, "gpu_ms": round(d / 1000.0, 4),
                       **({"per_step_us": round(d / per, 2), "calls_per_step": round(c / per, 2)} if per else {})}
                      for n, (c, d) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]]
    out["host_frames"] = [{"frame": n, "calls": c, "self_ms": round(t / 1000.0, 3),
                           **({"per_step_ms": round(t / 1000.0 / per, 4)} if per else {})}
                          for n, c, t in host_frames(ev)[:12]]
    sites = wait_sites(ev, [e for e in runtime if _is_wait(e)] + [e for e in ops if id(e) in items])
    out["wait_sites"] = [{"site": n, "waits": c, **({"per_step": round(c / per, 2)} if per else {})}
                         for n, c in sites[:8]]
    for name in sorted(stats):
        s = stats[name]
        kk = s.pop("_kernels", {})
        row = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}
        row["top_kernels"] = [[n, round(d / (steps or 1), 2)] for n, d in sorted(kk.items(), key=lambda kv: -kv[1])[:8]]
        if steps:
            row["per_step"] = {k: round(s[k] / steps, 4) for k in ("host_ms",) + COUNTS + ("gpu_ms",)}
        out["ranges"][name] = row
    return out


def _innermost(e: dict, by_thread: Dict[tuple, List[dict]]) -> Optional[dict]:
    """The shortest of ``by_thread``'s events on ``e``'s thread that encloses ``e``'s start (None: none does)."""
    best = None
    t = float(e.get("ts", 0))
    for r in by_thread.get((e.get("pid"), e.get("tid")), ()):
        s = float(r["ts"])
        if s <= t <= s + float(r.get("dur", 0)) and (best is None or float(r.get("dur", 0)) < float(best.get("dur", 0))):
            best = r
    return best


def _own_frame(name: str) -> bool:
    """A Python frame of the code that asked for the wait: not torch's, not a built-in, not the interpreter's."""
    return ".py(" in name and not name.startswith(("torch/", "<")) and "/torch/" not in name \
        and not name.startswith(("threading.py", "contextlib.py"))


def _own_frames_by_thread(ev: List[dict]) -> Dict[tuple, List[dict]]:
    """The trace's own Python frames (:func:`_own_frame`), by (pid, tid)."""
    frames: Dict[tuple, List[dict]] = {}
    for e in ev:
        if e.get("cat") == "python_function" and _own_frame(str(e.get("name", ""))):
            frames.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    return frames


def wait_sites(ev: List[dict], waits: List[dict]) -> List[tuple]:
    """[(site, count)], most first: for each GPU wait and each scalar read, the innermost Python frame that
    encloses it on its thread and is not torch's own (``file.py(line): function`` as torch.profiler's
    ``with_stack`` names it - SGLang's /start_profile records stacks unless SGLANG_PROFILE_WITH_STACK=false).
    A trace without Python frames gives ``"(no Python stack in the trace)"``."""
    frames = _own_frames_by_thread(ev)
    counts: Dict[str, int] = {}
    for w in waits:
        best = _innermost(w, frames)
        site = str(best["name"]) if best is not None else "(no Python stack in the trace)"
        counts[site] = counts.get(site, 0) + 1
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


def host_frames(ev: List[dict]) -> List[tuple]:
    """[(frame, calls, self us)], most host time first: each Python frame's own time, that of torch's frames,
    built-ins and operators inside it included (the code that spent it), its own callees' excluded - where the
    host's time goes, inside the plugin's ranges and outside them (SGLang's scheduler loop, its per-request
    bookkeeping). From the frames torch.profiler's ``with_stack`` records (``file.py(line): function``); a trace
    without them gives ``[]``."""
    own: Dict[str, List[float]] = {}
    for frames in _own_frames_by_thread(ev).values():
        frames.sort(key=lambda e: (float(e.get("ts", 0)), -float(e.get("dur", 0))))
        stack: List[list] = []  # [end, name, self]

        def close(entry):
            slot = own.setdefault(entry[1], [0, 0.0])
            slot[0] += 1
            slot[1] += max(entry[2], 0.0)

        for e in frames:
            t, d = float(e.get("ts", 0)), float(e.get("dur", 0))
            while stack and stack[-1][0] <= t:
                close(stack.pop())
            if stack:
                stack[-1][2] -= min(d, stack[-1][0] - t)  # the parent's own time loses its callee's
            stack.append([t + d, str(e["name"]), d])
        while stack:
            close(stack.pop())
    return sorted(((n, int(c), t) for n, (c, t) in own.items()), key=lambda x: (-x[2], x[0]))


def _kernel_name(e) -> str:
    """A kernel's name, shortened: Triton/CUDA names can be kilobytes of template arguments."""
    n = str(e.get("name", "?"))
    return n if len(n) <= 120 else n[:117] + "..."


def load_trace(path: str):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rt") as f:
        return json.load(f)


def profile_server(base: str, out_dir: str, steps: int, prompt: List[int], max_new: int = 256,
                   concurrency: int = 1, timeout: float = 180.0) -> Dict:
    """Profile ``steps`` scheduler steps of the server at ``base`` while ``concurrency`` clients decode.

    Each client sends ``prompt`` again and again (``max_new`` tokens each) until the trace is written: a
    speculative server with a good drafter finishes a short request in fewer steps than asked for, and the
    profiler only stops after ``steps`` steps. A few prefill steps fall inside the trace (one a request)."""
    from sglang_ddtree_tools.smoke import _post

    os.makedirs(out_dir, exist_ok=True)
    before = set(glob.glob(os.path.join(out_dir, "**", "*.json*"), recursive=True))
    stop = threading.Event()
    errors: List[str] = []

    def client():
        while not stop.is_set():
            try:
                _post(base + "/generate", {"input_ids": prompt, "sampling_params": {
                    "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - reported if no trace comes
                errors.append(f"{type(e).__name__}: {e}")
                return

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    [t.start() for t in threads]
    try:
        time.sleep(0.3)  # the first prefill done: profile decode steps
        _post_raw(base + "/start_profile", {"output_dir": out_dir, "num_steps": steps, "activities": ["CPU", "GPU"]})
        t0 = time.time()
        new = []
        while time.time() - t0 < timeout:
            new = sorted(set(glob.glob(os.path.join(out_dir, "**", "*.json*"), recursive=True)) - before)
            if new and all(_stable(p) for p in new):
                break
            time.sleep(1)
    finally:
        stop.set()
        [t.join(timeout) for t in threads]
    if not new:
        raise RuntimeError(f"no trace appeared in {out_dir}" + (f" (client: {errors[0]})" if errors else ""))
    summary = summarize_trace(load_trace(new[-1]), steps_hint=steps)
    summary["trace"] = os.path.basename(new[-1])
    return summary


def _stable(path: str) -> bool:
    a = os.path.getsize(path)
    time.sleep(0.5)
    return a == os.path.getsize(path) and a > 0


def _post_raw(url: str, body: dict) -> str:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read().decode()
