"""TEST STAND-IN for ``python -m sglang.launch_server`` (a CPU test host serves no model).

Run by tests/plugin/test_bench.py through a fake interpreter (``--python``), so that the benchmark's whole run
(servers one after another, health, warm-up, levels, teardown, a server that refuses to start) is exercised on
CPU.  It reads the flags SGLang would (``--port``, ``--speculative-algorithm``, ``--speculative-num-draft-tokens``,
``--cuda-graph-backend-decode``), refuses tree-verify with decode CUDA graphs as the plugin does today, and
streams ``/generate`` in SGLang 0.5.17's shape (cumulative ``output_ids``, ``meta_info.completion_tokens`` and
``spec_verify_ct``): an accept length of 1 (plain), 2 (DFLASH) or 3 (DDTREE) tokens a step, one step per 5 ms
whatever the concurrency (1 ms busy and 4 asleep, in functions named after SGLang's scheduler loop, ``event_loop_normal`` ->
``run_batch``, so a py-spy capture of it reads like a server's).  Each server holds ``$STANDIN_DIR/running`` while it lives: a second server started
while one runs exits at once with "two servers at once" (the benchmark must start them one at a time).
``/start_profile`` writes, a moment later, a small trace in torch.profiler's Chrome-trace form into the
``output_dir`` asked for (one kernel launch and its kernel a step, and the plugin's ``ddtree.draft`` range under
DDTREE): what ``--profile-steps`` reads, without a profiler.  ``/server_info`` says the scheduler as the plugin
would decide it (``disable_overlap_schedule``: DDTREE only where ``SGLANG_DDTREE_OVERLAP=1`` reached it; plain and
DFLASH never) and each start appends that switch to ``$STANDIN_DIR/overlap_env.jsonl``."""
import argparse
import http.server
import json
import os
import signal
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("-m")
ap.add_argument("--port", type=int)
ap.add_argument("--speculative-algorithm")
ap.add_argument("--speculative-num-draft-tokens", type=int)
ap.add_argument("--cuda-graph-backend-decode")
a, _ = ap.parse_known_args()
d = os.environ["STANDIN_DIR"]
with open(os.path.join(d, "argv.jsonl"), "a") as fh:
    fh.write(json.dumps(sys.argv[1:]) + "\n")
with open(os.path.join(d, "overlap_env.jsonl"), "a") as fh:  # what reached this server (bench --overlap)
    fh.write(json.dumps(os.environ.get("SGLANG_DDTREE_OVERLAP")) + "\n")
with open(os.path.join(d, "affinity.jsonl"), "a") as fh:  # the CPUs this server may run on (bench --cpus)
    fh.write(json.dumps(sorted(os.sched_getaffinity(0))) + "\n")
if os.environ.get("SGLANG_DDTREE_MODE") == "tree-verify" and a.cuda_graph_backend_decode != "disabled":
    print("ValueError: DDTREE tree-verify needs --cuda-graph-backend-decode disabled", flush=True)
    sys.exit(1)
lock = os.path.join(d, "running")
try:
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
except FileExistsError:
    print("two servers at once", flush=True)
    open(os.path.join(d, "overlap"), "w").close()
    sys.exit(1)


def bye(*_):
    os.unlink(lock)
    os._exit(0)


signal.signal(signal.SIGTERM, bye)
step = {None: 1, "DFLASH": 2, "DDTREE": 3}[a.speculative_algorithm]


class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *x):
        pass

    def _json(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_GET(self):
        if self.path == "/health":
            return self._json({})
        if self.path == "/server_info":
            overlap = a.speculative_algorithm != "DDTREE" or os.environ.get("SGLANG_DDTREE_OVERLAP") == "1"
            return self._json({"speculative_algorithm": a.speculative_algorithm,
                               "disable_overlap_schedule": not overlap})
        self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/start_profile":
            steps, out = int(body["num_steps"]), body["output_dir"]
            ev = []
            for s in range(steps):
                t = 1000.0 * s
                if a.speculative_algorithm == "DDTREE":
                    ev.append({"ph": "X", "name": "ddtree.draft", "cat": "user_annotation", "ts": t, "dur": 50,
                               "pid": 1, "tid": 1})
                ev += [{"ph": "X", "name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": t + 1, "dur": 5,
                        "pid": 1, "tid": 1, "args": {"correlation": s + 1}},
                       {"ph": "X", "name": "standin_kernel", "cat": "kernel", "ts": t + 10, "dur": 100, "pid": 1,
                        "tid": 9, "args": {"correlation": s + 1}}]

            def write():
                time.sleep(0.2)
                os.makedirs(out, exist_ok=True)
                with open(os.path.join(out, "standin.partial"), "w") as f:
                    json.dump({"traceEvents": ev}, f)
                os.replace(os.path.join(out, "standin.partial"), os.path.join(out, "standin.trace.json"))

            import threading
            threading.Thread(target=write, daemon=True).start()
            return self._json({"ok": True})
        n = body["sampling_params"]["max_new_tokens"]
        if not body.get("stream"):
            time.sleep(0.005 * -(-n // step))
            return self._json({"output_ids": [7] * n, "meta_info": {"completion_tokens": n}})
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def chunk(b):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(b), b))
            self.wfile.flush()

        k = verify = 0
        while k < n:
            event_loop_normal()
            k, verify = min(n, k + step), verify + 1
            meta = {"completion_tokens": k}
            if a.speculative_algorithm:
                meta.update(spec_verify_ct=verify, spec_accept_length=k / verify)
            chunk(b"data: " + json.dumps({"output_ids": [7] * k, "meta_info": meta}).encode() + b"\n\n")
        chunk(b"data: [DONE]\n\n")
        chunk(b"")


def run_batch():  # a step's host work: 1 ms on the CPU (a sampler such as py-spy sees it busy), 4 ms asleep
    t = time.perf_counter()
    while time.perf_counter() - t < 0.001:
        sum(range(200))
    time.sleep(0.004)


def event_loop_normal():  # named after SGLang's scheduler loop, which bench --spy's summary looks for
    run_batch()


time.sleep(0.3)  # a server takes a moment to come up
http.server.ThreadingHTTPServer(("127.0.0.1", a.port), H).serve_forever()
