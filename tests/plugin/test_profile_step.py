"""sglang_ddtree_tools.profile_step.summarize_trace on a trace in the Chrome-trace form torch.profiler writes (the
event categories, names and correlation links of a real SGLang 0.5.17 trace on the H200): nested ranges,
kernel launches, a CUDA-graph launch, a blocking copy and an aten::item sync."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "overlays" / "sglang-ddtree" / "gpu_checks"))

from sglang_ddtree_tools.profile_step import summarize_trace  # noqa: E402


def _x(name, cat, ts, dur, tid=1, corr=None, pid=7):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def trace(steps=2):
    ev = []
    for s in range(steps):
        t = s * 1000.0
        ev += [_x("ddtree.draft", "user_annotation", t, 300),
               _x("ddtree.draft_forward", "user_annotation", t + 10, 100),
               _x("cudaLaunchKernel", "cuda_runtime", t + 20, 5, corr=s * 10 + 1),
               _x("cudaLaunchKernel", "cuda_runtime", t + 150, 5, corr=s * 10 + 2),   # draft, outside draft_forward
               _x("aten::item", "cpu_op", t + 200, 30),
               _x("cudaStreamSynchronize", "cuda_runtime", t + 210, 15),
               _x("ddtree.tree_verify", "user_annotation", t + 400, 400),
               _x("cudaGraphLaunch", "cuda_runtime", t + 410, 8, corr=s * 10 + 3),
               _x("cudaMemcpyAsync", "cuda_runtime", t + 500, 3, corr=s * 10 + 4),
               _x("cudaLaunchKernel", "cuda_runtime", t + 2000, 5, tid=2, corr=s * 10 + 5),  # other thread
               _x("k1", "kernel", t + 30, 40, tid=99, corr=s * 10 + 1),
               _x("k2", "kernel", t + 160, 10, tid=99, corr=s * 10 + 2),
               _x("graph_kernel_a", "kernel", t + 420, 200, tid=99, corr=s * 10 + 3),
               _x("graph_kernel_b", "kernel", t + 620, 100, tid=99, corr=s * 10 + 3),
               _x("Memcpy HtoD", "gpu_memcpy", t + 505, 2, tid=99, corr=s * 10 + 4),
               _x("k_other", "kernel", t + 2010, 50, tid=99, corr=s * 10 + 5)]
    ev.append({"ph": "M", "name": "process_name", "pid": 7})  # metadata events are ignored
    return {"traceEvents": ev}


def test_per_step_figures_by_range():
    out = summarize_trace(trace(steps=2))
    assert out["steps"] == 2
    r = out["ranges"]
    d, df, tv = r["ddtree.draft"], r["ddtree.draft_forward"], r["ddtree.tree_verify"]
    assert df["per_step"] == {"host_ms": 0.1, "launches": 1, "graph_launches": 0, "syncs": 0, "runtime_syncs": 0,
                              "item_calls": 0, "host_items": 0, "gpu_ms": 0.04}
    # inclusive: the draft range holds its child's launch, its own launch and both host syncs
    assert d["per_step"]["launches"] == 2 and d["per_step"]["syncs"] == 2
    assert abs(d["per_step"]["gpu_ms"] - 0.05) < 1e-9
    # a graph launch counts once, its kernels' GPU time all goes to the range that launched it
    assert tv["per_step"]["graph_launches"] == 1 and tv["per_step"]["launches"] == 2
    assert abs(tv["per_step"]["gpu_ms"] - 0.302) < 1e-9
    # work on another thread belongs to no range, but the trace's GPU total has it
    assert abs(out["gpu_ms_total"] - 2 * (0.04 + 0.01 + 0.3 + 0.002 + 0.05)) < 1e-9


def test_scalar_reads_are_told_apart_from_the_gpu_waits():
    """A device .item() (item > _local_scalar_dense > copy + stream sync) is one GPU wait and one scalar read,
    though the combined ``syncs`` counts it three times; a host tensor's .item() has no wait inside it."""
    ev = [_x("ddtree.draft", "user_annotation", 0, 1000),
          _x("aten::item", "cpu_op", 100, 50), _x("aten::_local_scalar_dense", "cpu_op", 105, 40),
          _x("cudaMemcpyAsync", "cuda_runtime", 110, 5, corr=1), _x("cudaStreamSynchronize", "cuda_runtime", 120, 10),
          _x("aten::item", "cpu_op", 300, 10), _x("aten::_local_scalar_dense", "cpu_op", 302, 5),  # host tensor
          _x("aten::_local_scalar_dense", "cpu_op", 500, 5),  # called alone: still one read
          _x("cudaStreamSynchronize", "cuda_runtime", 700, 10)]  # a wait of its own (e.g. .tolist())
    out = summarize_trace({"traceEvents": ev})
    d = out["ranges"]["ddtree.draft"]["per_step"]
    assert (d["syncs"], d["runtime_syncs"], d["item_calls"], d["host_items"]) == (7, 2, 3, 2)
    t = out["totals_per_step"]
    assert (t["syncs"], t["runtime_syncs"], t["item_calls"], t["host_items"]) == (7, 2, 3, 2)


def test_a_trace_without_ranges_is_an_empty_summary():
    out = summarize_trace({"traceEvents": [_x("k", "kernel", 0, 10, corr=1)]})
    assert out["steps"] == 0 and out["ranges"] == {} and out["gpu_ms_total"] == 0.01


def test_whole_trace_totals_and_kernels_without_ranges():
    """A server without the plugin's ranges (plain, SGLang's DFLASH) is measured the same way, per requested step."""
    ev = [e for e in trace(steps=2)["traceEvents"] if not str(e.get("name", "")).startswith("ddtree.")]
    out = summarize_trace({"traceEvents": ev}, steps_hint=2)
    assert out["steps"] == 0 and out["steps_for_per_step"] == 2
    t = out["totals_per_step"]
    # per step: 3 kernel launches, 1 graph launch, 1 async copy; a blocking sync and an aten::item
    assert t["launches"] == 5 and t["graph_launches"] == 1 and t["syncs"] == 2
    assert abs(t["gpu_ms"] - (0.04 + 0.01 + 0.3 + 0.002 + 0.05)) < 1e-9
    names = [k["name"] for k in out["kernels"]]
    assert names[0] == "graph_kernel_a" and names[1] == "graph_kernel_b"  # a graph's kernels by their own names
    assert out["kernels"][0]["per_step_us"] == 200.0 and out["kernels"][0]["calls_per_step"] == 1


def test_range_top_kernels_are_inclusive():
    r = summarize_trace(trace(steps=2))["ranges"]
    assert r["ddtree.tree_verify"]["top_kernels"][0] == ["graph_kernel_a", 200.0]
    assert [n for n, _ in r["ddtree.draft"]["top_kernels"]] == ["k1", "k2"]  # the child's kernel rolls up


def test_long_kernel_names_are_cut():
    ev = [_x("x" * 500, "kernel", 0, 10, corr=1)]
    assert len(summarize_trace({"traceEvents": ev})["kernels"][0]["name"]) == 120


def test_each_gpu_wait_is_named_by_the_python_frame_that_asked_for_it():
    """Where the step waits on the GPU: the innermost enclosing Python frame (torch.profiler's with_stack) that is
    not torch's own nor a built-in, counted per step; a device .item() counts once for its read and once for its
    wait, both at the caller's line; a trace without frames says so."""
    ev = []
    for s in range(2):
        t = s * 1000.0
        ev += [_x("ddtree.draft", "user_annotation", t, 900),
               _x("sglang/srt/managers/scheduler.py(3670): run_batch", "python_function", t, 900),
               _x("sglang_ddtree/adapters/worker.py(380): _forward_tree_verify", "python_function", t + 10, 300),
               _x("torch/_tensor.py(1100): tolist", "python_function", t + 20, 50),  # torch's own: skipped
               _x("<built-in method tolist of Tensor object at 0x7f>", "python_function", t + 25, 40),
               _x("cudaStreamSynchronize", "cuda_runtime", t + 30, 10),  # at worker.py(380)
               _x("cudaStreamSynchronize", "cuda_runtime", t + 500, 10),  # at scheduler.py(3670)
               _x("aten::item", "cpu_op", t + 600, 30), _x("cudaStreamSynchronize", "cuda_runtime", t + 610, 5),
               _x("cudaStreamSynchronize", "cuda_runtime", t + 700, 5, tid=2)]  # another thread: no frame
    out = summarize_trace({"traceEvents": ev})
    sites = {w["site"]: w["per_step"] for w in out["wait_sites"]}
    assert sites == {"sglang/srt/managers/scheduler.py(3670): run_batch": 3,
                     "sglang_ddtree/adapters/worker.py(380): _forward_tree_verify": 1,
                     "(no Python stack in the trace)": 1}, out["wait_sites"]
    assert out["wait_sites"][0]["site"].startswith("sglang/srt/managers/scheduler.py")  # most first
    from sglang_ddtree_tools.bench import profile_line
    assert "waits at: sglang/srt/managers/scheduler.py(3670): run_batch x3" in profile_line(out)


def test_host_time_goes_to_the_python_frame_that_spent_it():
    """Each own Python frame's self time, per step: a callee's own time is its own, torch's frames and built-ins
    inside a frame count for it, frames on another thread are their thread's; most first, and bench's log line
    names the heaviest."""
    ev = []
    for s in range(2):
        t = s * 10000.0
        ev += [_x("ddtree.draft", "user_annotation", t, 100),
               _x("sglang/srt/managers/scheduler.py(3600): event_loop_normal", "python_function", t, 9000),
               _x("sglang/srt/managers/scheduler.py(3670): run_batch", "python_function", t + 100, 3000),
               _x("sglang_ddtree/adapters/worker.py(380): _forward_tree_verify", "python_function", t + 200, 2000),
               _x("torch/_tensor.py(1100): tolist", "python_function", t + 300, 500),  # torch's: the caller's
               _x("sglang/srt/managers/batch_result_processor.py(802): process_batch_result_decode",
                  "python_function", t + 4000, 4000),
               _x("<built-in method item of Tensor object at 0x7f>", "python_function", t + 4100, 1000),
               _x("sglang/srt/utils.py(10): watchdog", "python_function", t + 500, 700, tid=2)]
    out = summarize_trace({"traceEvents": ev})
    got = {f["frame"].split(": ")[1]: f["per_step_ms"] for f in out["host_frames"]}
    assert got == {"process_batch_result_decode": 4.0, "_forward_tree_verify": 2.0, "event_loop_normal": 2.0,
                   "run_batch": 1.0, "watchdog": 0.7}, out["host_frames"]
    assert out["host_frames"][0]["frame"].endswith("process_batch_result_decode") and out["host_frames"][0]["calls"] == 2
    from sglang_ddtree_tools.bench import profile_line
    assert "host: " in profile_line(out) and "process_batch_result_decode 4.00 ms" in profile_line(out)
    assert summarize_trace(trace())["host_frames"] == []  # no Python frames in the trace
