#!/usr/bin/python3
"""LAB STAND-IN for `python -m sglang.launch_server` -- NOT SGLang. Lab hosts have no GPU and cannot run SGLang,
so on them the unit's ExecStart runs this small server instead. It is a test double, for the lab only.

It takes SGLang 0.5.23's command line (parsed with SGLang's own ServerArgs parser when `sglang` is importable,
otherwise with the documented subset in SUBSET_FLAGS; other `--flags` are accepted and listed in the log) and
answers the endpoints the deploy gate uses, with the JSON shapes of SGLang 0.5.23's http_server:

    GET  /health, /health_generate, /ready      200 when ready, 503 while "loading"
    GET  /v1/models, /v1/models/{name}          ModelList / ModelCard (id = served model name)
    POST /generate                              {"text", "output_ids", "meta_info": {..., "spec_accept_length"}}
    POST /v1/completions                        OpenAI completion object
    GET  /server_info, /get_server_info         resolved args incl. speculative_algorithm, internal_states,
                                                version "0.5.23"
    GET  /model_info, /get_model_info
    GET  /get_load                              [{"dp_rank": 0, "num_reqs": N, "num_waiting_reqs": Q, ...}]
    GET  /metrics                               Prometheus text (only with --enable-metrics, as SGLang), below
    POST /generate, /v1/completions with "stream": true   server-sent events as SGLang streams them
                                                (cumulative text per chunk for /generate, deltas for
                                                /v1/completions, then `data: [DONE]`)

Generation takes real time (LABSERVER_TOKEN_SECONDS per token, default 0.02: 50 tokens/s per request), so
requests are really in flight while a deploy drains a GPU, and the counters below count them as they run.

/metrics, with --enable-metrics, carries the names SGLang 0.5.17 exports (taken from its
sglang/srt/observability/metrics_collector.py: SchedulerMetricsCollector labels model_name, engine_type,
tp_rank, pp_rank, moe_ep_rank; TokenizerMetricsCollector labels model_name, engine_type, and is_streaming on the
token counters):

    sglang:num_running_reqs, sglang:num_queue_reqs       gauges: requests generating now / waiting for a slot
                                                          (--max-running-requests, default 64, bounds the first)
    sglang:gen_throughput                                gauge: generated tokens/s over the last 5 s
    sglang:spec_accept_length                            gauge: mean accept length of the last requests
    sglang:prompt_tokens_total, sglang:generation_tokens_total   counters (by is_streaming)
    sglang:num_requests_total                            counter: finished requests

The real sglang-router (PyPI sglang-router 0.3.2) runs against it on the lab: it asks a worker for /health,
/server_info (or /get_server_info), /model_info (or /get_model_info) and /get_load, probes HTTP/2 prior
knowledge first (answered 505, as http.server does) and then routes /generate and /v1/* to it.

Like SGLang it listens on --host (the inventory's listen_address) and, given an API key (`--api-key`, or
`api-key:` in the YAML file of `--config FILE`, which is how the unit passes it), answers every endpoint but
/health*, /ready* and /metrics* with 401 {"error": "Unauthorized"} unless the request carries
`Authorization: Bearer KEY` -- SGLang 0.5.23's decide_request_auth for normal endpoints, re-implemented here
(compare_digest, case-insensitive "Bearer"). `--config` is merged as SGLang's ConfigArgumentMerger does (config
arguments first, so the command line wins; .yaml/.yml only; one --config); without PyYAML the file is read as
flat `key: value` lines. Like SGLang 0.5.23 (engine.py) it logs `server_args={...}` at INFO at start-up,
api_key included, so the lab shows whether the unit keeps the key out of the journal. Unlike SGLang, its
/server_info never echoes the API keys.

Misbehaviour on request, from the unit's EnvironmentFile (so gates and automatic rollback are tested for real):

    LABSERVER_FAIL_AT_START=1        exit 1 before listening ("model failed to load")
    LABSERVER_NEVER_READY=1          listen, but /health stays 503 forever
    LABSERVER_LOAD_SECONDS=S         /health is 503 for the first S seconds (model loading)
    LABSERVER_CRASH_AFTER=N          the process dies (exit 70) on the N-th request after /health first succeeds
    LABSERVER_WRONG_ALGORITHM=NAME   /server_info reports NAME as speculative_algorithm
    LABSERVER_TOKEN_SECONDS=S        seconds per generated token (default 0.02)
    LABSERVER_NEVER_DRAINS=1         /metrics always counts one more running request than there is (a stuck
                                     request: the drain never sees 0 and must give up at its deadline)
    LABSERVER_OFF_ARGMAX=N           greedy generation emits, at generated position N, the runner-up token: 2.95
                                     nats below the argmax of the stand-in's own distribution (a lossy server:
                                     the gate's canary must refuse it)
    LABSERVER_ACCEPT_LENGTH=X        every request, /server_info and /metrics report accept length X (X=1: the
                                     acceptance collapsed; the canary's accept floor must refuse it)

Its "model" is a deterministic function of the token ids (`next_token`; text is one id per word): greedy
/generate (by `text` or `input_ids`) emits its argmax at every position, and a prefill-only request
(`max_new_tokens: 0` with `return_logprob`, `logprob_start_len`, `top_logprobs_num`) returns SGLang's
`input_token_logprobs` / `input_top_logprobs` of that same distribution, so a server re-scoring its own greedy
output finds every token on the argmax. Like SGLang's DFLASH, a speculative server answers `return_logprob` with
400, except the prefill-only request where the DDTREE plugin is loaded (SGLANG_PLUGINS set), which admits it.

Stdlib only: it runs with the lab host's /usr/bin/python3.
"""
import argparse
import hmac
import json
import os
import socket
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VERSION = "0.5.23"
SUBSET_FLAGS = {  # flag -> type; the subset of SGLang 0.5.23's ServerArgs this stand-in understands
    "--model-path": str, "--served-model-name": str, "--host": str, "--port": int, "--tokenizer-path": str,
    "--speculative-algorithm": str, "--speculative-draft-model-path": str, "--speculative-num-steps": int,
    "--speculative-eagle-topk": int, "--speculative-num-draft-tokens": int, "--speculative-dflash-block-size": int,
    "--tp-size": int, "--dp-size": int, "--mem-fraction-static": float, "--context-length": int,
    "--max-running-requests": int, "--log-level": str, "--page-size": int, "--attention-backend": str,
    "--dtype": str, "--trust-remote-code": None, "--enable-metrics": None,
    "--config": str, "--api-key": str, "--admin-api-key": str, "--dist-init-addr": str, "--nccl-port": int,
}
SECRET_ARGS = ("api_key", "admin_api_key")


def _yaml_scalar(v):
    """A flat YAML scalar as PyYAML's safe_load reads the values the deploy tool allows (quoted strings, words)."""
    if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
        return v[1:-1]
    return {"true": True, "false": False}.get(v.lower(), v)


def _read_config(path):
    if os.path.splitext(path)[1].lower() not in (".yaml", ".yml"):
        raise ValueError("Config file must be YAML format, got: %s" % os.path.splitext(path)[1])
    if not os.path.exists(path):
        raise ValueError("Config file not found: %s" % path)
    with open(path) as f:
        text = f.read()
    try:
        import yaml
        data = yaml.safe_load(text) or {}
    except ImportError:
        data = {}
        for line in text.splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                k, sep, v = line.partition(":")
                if not sep:
                    raise ValueError("Config file must contain a dictionary at root level")
                data[k.strip()] = _yaml_scalar(v.strip())
    if not isinstance(data, dict):
        raise ValueError("Config file must contain a dictionary at root level")
    return data


def merge_config(argv):
    """SGLang's ConfigArgumentMerger: `--config FILE` replaced by the file's arguments, placed first."""
    idx = [i for i, a in enumerate(argv) if a == "--config"]
    if not idx:
        return argv
    if len(idx) > 1:
        raise ValueError("Multiple config files specified! Only one allowed.")
    i = idx[0]
    if i == len(argv) - 1:
        raise ValueError("No config file specified after --config flag!")
    args = []
    for k, v in _read_config(argv[i + 1]).items():
        if isinstance(v, bool):
            args += ["--%s" % k] if v else []
        else:
            args += ["--%s" % k, str(v)]
    return args + argv[:i] + argv[i + 2:]


def authorized(path, header, api_key):
    """SGLang 0.5.23 decide_request_auth for normal endpoints (all the stand-in has)."""
    if path.startswith(("/health", "/ready", "/metrics")) or not api_key:
        return True
    parts = (header or "").split(" ", 1)
    return len(parts) == 2 and parts[0].lower() == "bearer" and hmac.compare_digest(parts[1], api_key)


def parse_args(argv):
    try:  # the real parser and config merger, where SGLang is installed
        from sglang.srt.server_args import ServerArgs  # noqa: F401
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger
        import argparse as _ap
        p = _ap.ArgumentParser(prog="sglang serve")
        ServerArgs.add_cli_args(p)
        if "--config" in argv:
            argv = ConfigArgumentMerger(p).merge_config_with_args(argv)
        ns = p.parse_args(argv)
        return vars(ns), []
    except ImportError:
        pass
    argv = merge_config(argv)
    p = argparse.ArgumentParser(prog="labserver (SGLang stand-in)")
    for flag, typ in SUBSET_FLAGS.items():
        if typ is None:
            p.add_argument(flag, action="store_true")
        else:
            p.add_argument(flag, type=typ)
    ns, unknown = p.parse_known_args(argv)
    args = vars(ns)
    if not args.get("model_path"):
        p.error("--model-path is required")
    args["port"] = args.get("port") or 30000
    args["host"] = args.get("host") or "127.0.0.1"
    return args, [u for u in unknown if u.startswith("--")]


class State:
    def __init__(self, args, argv):
        self.token_seconds = float(os.environ.get("LABSERVER_TOKEN_SECONDS", "0.02") or 0)
        self.max_running = int(args.get("max_running_requests") or 64)
        self.slots = threading.BoundedSemaphore(self.max_running)
        self.running = 0
        self.queued = 0
        self.finished = 0
        self.prompt_tokens = {"true": 0, "false": 0}
        self.gen_tokens = {"true": 0, "false": 0}
        self.recent = []  # (monotonic time, tokens) of tokens generated, for gen_throughput
        self.recent_accept = []
        self.stuck = 1 if os.environ.get("LABSERVER_NEVER_DRAINS") == "1" else 0
        self.args, self.argv = args, argv
        self.started = time.time()
        self.started_mono = time.monotonic()
        self.load = float(os.environ.get("LABSERVER_LOAD_SECONDS", "0") or 0)
        self.never_ready = os.environ.get("LABSERVER_NEVER_READY") == "1"
        self.crash_after = int(os.environ.get("LABSERVER_CRASH_AFTER", "0") or 0)
        self.algorithm = os.environ.get("LABSERVER_WRONG_ALGORITHM") or args.get("speculative_algorithm")
        self.served = args.get("served_model_name") or args["model_path"]
        self.requests = 0
        self.ready_seen = False
        self.lock = threading.Lock()
        self.verify_ct = 0
        self.accepted = 0

    # ---- what /metrics counts: each generating request holds one of max_running slots; the others queue

    def begin(self):
        with self.lock:
            self.queued += 1
        self.slots.acquire()
        with self.lock:
            self.queued -= 1
            self.running += 1

    def token(self, streaming):
        now = time.monotonic()
        with self.lock:
            self.gen_tokens[streaming] += 1
            self.recent.append(now)
            while self.recent and self.recent[0] < now - 5.0:
                self.recent.pop(0)

    def end(self, prompt_tokens, streaming, accept_length):
        with self.lock:
            self.running -= 1
            self.finished += 1
            self.prompt_tokens[streaming] += prompt_tokens
            if accept_length is not None:
                self.recent_accept = (self.recent_accept + [accept_length])[-50:]
        self.slots.release()

    def metrics(self):
        """Prometheus text exposition of the SGLang 0.5.17 names in the module docstring."""
        def esc(v):
            return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        model = esc(self.served)
        sched = 'model_name="%s",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"' % model
        tok = 'model_name="%s",engine_type="unified"' % model
        now = time.monotonic()
        with self.lock:
            window = [t for t in self.recent if t >= now - 5.0]
            span = min(5.0, max(0.001, now - self.started_mono))
            thr = len(window) / span
            al = (sum(self.recent_accept) / len(self.recent_accept)) if self.recent_accept else 0.0
            rows = [
                ("sglang:num_running_reqs", "gauge", "The number of running requests.",
                 [(sched, self.running + self.stuck)]),
                ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
                 [(sched, self.queued)]),
                ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", [(sched, round(thr, 3))]),
                ("sglang:spec_accept_length", "gauge", "Mean acceptance length of speculative decoding (accepted "
                 "drafts + bonus token per forward).", [(sched, round(al, 4))]),
                ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                 [(tok + ',is_streaming="%s"' % k, v) for k, v in sorted(self.prompt_tokens.items())]),
                ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
                 [(tok + ',is_streaming="%s"' % k, v) for k, v in sorted(self.gen_tokens.items())]),
                ("sglang:num_requests_total", "counter", "The number of requests.", [(tok, self.finished)]),
            ]
        out = []
        for name, kind, doc, samples in rows:
            base = name[:-len("_total")] if kind == "counter" else name
            out += ["# HELP %s %s" % (base, doc), "# TYPE %s %s" % (base, kind)]
            for labels, v in samples:
                out.append("%s{%s} %s" % (name if kind != "counter" else base + "_total", labels, float(v)))
        return ("\n".join(out) + "\n").encode()

    def ready(self):
        return not self.never_ready and time.time() - self.started >= self.load

    def count(self):
        with self.lock:
            if self.ready_seen:
                self.requests += 1
                if self.crash_after and self.requests >= self.crash_after:
                    sys.stderr.write("labserver: LABSERVER_CRASH_AFTER=%d reached, dying\n" % self.crash_after)
                    sys.stderr.flush()
                    os._exit(70)

    def accept_length(self):
        """A deterministic stand-in for the average accept length (tree modes accept more than linear), or
        LABSERVER_ACCEPT_LENGTH."""
        if os.environ.get("LABSERVER_ACCEPT_LENGTH"):
            return float(os.environ["LABSERVER_ACCEPT_LENGTH"])
        n = self.args.get("speculative_num_draft_tokens") or self.args.get("speculative_dflash_block_size") or 1
        return round(1.0 + min(6.0, n ** 0.5) * (1.2 if self.algorithm == "DDTREE" else 0.8), 3)

    def server_info(self):
        info = {k: v for k, v in self.args.items() if isinstance(v, (str, int, float, bool, type(None)))
                and k not in SECRET_ARGS}
        info.update(speculative_algorithm=self.algorithm, served_model_name=self.served,
                    launch_command=" ".join(["sglang", "serve"] + self.argv), version=VERSION, frontend="python",
                    startup_time=self.started,
                    internal_states=[{"avg_spec_accept_length": self.accept_length(), "last_gen_throughput": 0.0,
                                      "memory_usage": {}}] if self.algorithm else [{}],
                    labserver="stand-in: not SGLang")
        return info


VOCAB = 32000
TOP_LP, RUNNER_UP_LP, REST_LP = -0.05, -3.0, -12.0   # the stand-in's distribution at every position


def word_id(word):
    """The stand-in's tokenizer: one id per whitespace-separated word (stable across runs)."""
    return 100 + sum((i + 1) * ord(c) for i, c in enumerate(word)) % (VOCAB - 200)


def next_token(ids):
    """The stand-in model's argmax after `ids` (its runner-up is the next id)."""
    n, last = len(ids), ids[-1] if ids else 0
    return 100 + (last * 7919 + n * 104729 + 17) % (VOCAB - 200)


def logprob_of(prefix, tok):
    best = next_token(prefix)
    return TOP_LP if tok == best else RUNNER_UP_LP if tok == best + 1 else REST_LP


def greedy(ids, n):
    """`n` tokens after `ids`: the argmax at each position, except at LABSERVER_OFF_ARGMAX's."""
    off = os.environ.get("LABSERVER_OFF_ARGMAX")
    out = []
    for i in range(n):
        t = next_token(list(ids) + out)
        out.append(t + 1 if off not in (None, "") and i == int(off) else t)
    return out


def input_logprobs(ids, start, top_n):
    """SGLang's meta_info input_token_logprobs / input_top_logprobs of `ids` from `start` (entry 0: no
    predicting distribution)."""
    start = max(0, min(int(start), len(ids) - 1)) if ids else 0
    tok, top = [], []
    for k in range(start, len(ids)):
        if k == start:
            tok.append([None, ids[k], None])
            top.append(None)
            continue
        best = next_token(ids[:k])
        tok.append([logprob_of(ids[:k], ids[k]), ids[k], None])
        top.append([[TOP_LP, best, None], [RUNNER_UP_LP, best + 1, None]][:max(0, int(top_n or 0))])
    return tok, top


def make_handler(state):
    class H(BaseHTTPRequestHandler):
        server_version = "labserver/" + VERSION
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *a):
            sys.stderr.write("labserver %s %s\n" % (self.address_string(), fmt % a))

        def send(self, code, obj=None):
            body = b"" if obj is None else json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def body(self):
            n = int(self.headers.get("Content-Length") or 0)
            try:
                return json.loads(self.rfile.read(n) or b"{}")
            except ValueError:
                return None

        def denied(self, p):
            if authorized(p, self.headers.get("Authorization"), state.args.get("api_key")):
                return False
            self.send(401, {"error": "Unauthorized"})
            return True

        def do_GET(self):
            p = self.path.split("?", 1)[0]
            if self.denied(p):
                return
            if p == "/metrics":  # SGLang serves it from the start, only with --enable-metrics
                if not state.args.get("enable_metrics"):
                    return self.send(404, {"detail": "Not Found"})
                body = state.metrics()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            if p in ("/health", "/health_generate", "/ready"):
                if not state.ready():
                    return self.send(503)
                state.ready_seen = True
                state.count()
                return self.send(200)
            state.count()
            if not state.ready():
                return self.send(503, {"error": {"message": "server is starting"}})
            card = {"id": state.served, "object": "model", "created": int(state.started), "owned_by": "sglang",
                    "root": state.served, "parent": None, "max_model_len": state.args.get("context_length") or 32768}
            if p == "/v1/models":
                return self.send(200, {"object": "list", "data": [card]})
            if p.startswith("/v1/models/"):
                if p[len("/v1/models/"):] != state.served:
                    return self.send(404, {"error": {"message": "The model '%s' does not exist" % p[11:],
                                                     "type": "invalid_request_error", "param": "model",
                                                     "code": "model_not_found"}})
                return self.send(200, card)
            if p == "/get_load":
                with state.lock:
                    running, queued = state.running, state.queued
                return self.send(200, [{"dp_rank": 0, "num_reqs": running + queued, "num_waiting_reqs": queued,
                                        "num_tokens": 0, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}])
            if p in ("/server_info", "/get_server_info"):
                return self.send(200, state.server_info())
            if p in ("/model_info", "/get_model_info"):
                return self.send(200, {"model_path": state.args["model_path"], "served_model_name": state.served,
                                       "tokenizer_path": state.args.get("tokenizer_path") or state.args["model_path"],
                                       "is_generation": True, "weight_version": "default",
                                       "model_type": None, "architectures": None})
            return self.send(404, {"detail": "Not Found"})

        def _complete(self, prompt, max_new):
            words = ("Paris. It is known for the Eiffel Tower and the Louvre museum along the Seine river "
                     "and many cafes").split()
            n = max(1, min(int(max_new or 16), 1024))
            return [" " + words[i % len(words)] for i in range(n)]

        def chunk(self, obj):
            """One server-sent event in one HTTP/1.1 chunk."""
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def generate(self, pieces, streaming, prompt_tokens, on_piece):
            """Generate `pieces` at LABSERVER_TOKEN_SECONDS each, counted as running (or queued) meanwhile;
            `on_piece(i)` is called after each token (a stream sends it). Returns the accept length."""
            tag = "true" if streaming else "false"
            al = state.accept_length() if state.algorithm else None
            state.begin()
            try:
                for i in range(len(pieces)):
                    if state.token_seconds:
                        time.sleep(state.token_seconds)
                    state.token(tag)
                    on_piece(i)
            finally:
                state.end(prompt_tokens, tag, al)
            return al

        def start_stream(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

        def end_stream(self):
            self.chunk(b"[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def do_POST(self):
            p = self.path.split("?", 1)[0]
            if self.denied(p):
                return
            state.count()
            if not state.ready():
                return self.send(503, {"error": {"message": "server is starting"}})
            req = self.body()
            if not isinstance(req, dict):
                return self.send(400, {"error": "invalid JSON body"})
            t0 = time.time()
            rid = req.get("rid") or uuid.uuid4().hex
            stream = bool(req.get("stream"))
            if p == "/generate":
                sp = req.get("sampling_params") or {}
                ids = req.get("input_ids")
                by_ids = isinstance(ids, list) and ids and all(isinstance(x, int) for x in ids)
                if not by_ids:
                    ids = [word_id(w) for w in str(req.get("text") or "").split()] or [1]
                plugin = bool(os.environ.get("SGLANG_PLUGINS"))  # the DDTREE plugin loaded (allow-listed)
                if req.get("return_logprob") and state.algorithm and not (plugin and sp.get("max_new_tokens") == 0):
                    return self.send(400, {"error": {"message": "%s speculative decoding does not support "
                                                                "return_logprob yet." % state.algorithm}})
                if sp.get("max_new_tokens") == 0:  # prefill only: the target's own forward, logprobs if asked
                    meta = {"id": rid, "finish_reason": {"type": "length", "length": 0}, "prompt_tokens": len(ids),
                            "completion_tokens": 0, "cached_tokens": 0, "e2e_latency": round(time.time() - t0, 6)}
                    if req.get("return_logprob"):
                        meta["input_token_logprobs"], meta["input_top_logprobs"] = input_logprobs(
                            ids, req.get("logprob_start_len") or 0, req.get("top_logprobs_num"))
                    return self.send(200, {"text": "", "output_ids": [], "meta_info": meta})
                pieces = self._complete(req.get("text"), sp.get("max_new_tokens"))
                n, ptoks = len(pieces), len(ids) if by_ids else len(str(req.get("text") or "").split())
                gen_ids = greedy(ids, n)

                def meta(k, al):
                    m = {"id": rid, "finish_reason": {"type": "length", "length": k} if k == n else None,
                         "prompt_tokens": ptoks, "weight_version": "default", "num_retractions": 0,
                         "reasoning_tokens": 0, "completion_tokens": k, "cached_tokens": 0,
                         "e2e_latency": round(time.time() - t0, 6)}
                    if al:
                        verify = max(1, int(round(k / al)))
                        m.update(spec_verify_ct=verify, spec_accept_length=round(k / verify, 3))
                    return m
                if stream:  # SGLang's /generate stream: cumulative text and ids in every chunk
                    self.start_stream()
                    al0 = state.accept_length() if state.algorithm else None
                    self.generate(pieces, True, ptoks, lambda i: self.chunk(
                        {"text": "".join(pieces[:i + 1]), "output_ids": gen_ids[:i + 1],
                         "meta_info": meta(i + 1, al0)}))
                    return self.end_stream()
                al = self.generate(pieces, False, ptoks, lambda i: None)
                return self.send(200, {"text": "".join(pieces), "output_ids": gen_ids,
                                       "meta_info": meta(n, al)})
            if p == "/v1/completions":
                if req.get("model") not in (None, state.served):
                    return self.send(404, {"object": "error", "message": "The model `%s` does not exist." %
                                           req.get("model"), "type": "NotFoundError", "param": None, "code": 404})
                pieces = self._complete(req.get("prompt"), req.get("max_tokens"))
                n, ptoks = len(pieces), len(str(req.get("prompt")).split())
                cid = uuid.uuid4().hex
                if stream:  # OpenAI completion chunks: one text delta each, finish_reason on the last
                    self.start_stream()
                    self.generate(pieces, True, ptoks, lambda i: self.chunk(
                        {"id": cid, "object": "text_completion", "created": int(t0), "model": state.served,
                         "choices": [{"index": 0, "text": pieces[i], "logprobs": None,
                                      "finish_reason": "length" if i == n - 1 else None, "matched_stop": None}]}))
                    return self.end_stream()
                self.generate(pieces, False, ptoks, lambda i: None)
                return self.send(200, {"id": cid, "object": "text_completion", "created": int(t0),
                                       "model": state.served,
                                       "choices": [{"index": 0, "text": "".join(pieces), "logprobs": None,
                                                    "finish_reason": "length", "matched_stop": None}],
                                       "usage": {"prompt_tokens": ptoks, "completion_tokens": n,
                                                 "total_tokens": n + ptoks}})
            return self.send(404, {"detail": "Not Found"})

    return H


def hold_tp_ports(args) -> list:
    """A TP group's rendezvous ports, held as SGLang's group holds them while it serves (its TCPStore on
    --dist-init-addr, its NCCL port): a second server given the same ports fails to start here as it would
    there. Nothing for one GPU."""
    if int(args.get("tp_size") or 1) <= 1:
        return []
    out = []
    addr = args.get("dist_init_addr")
    for host, port in ([tuple(addr.rsplit(":", 1))] if addr else []) + (
            [("127.0.0.1", args["nccl_port"])] if args.get("nccl_port") else []):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((host, int(port)))  # no SO_REUSEADDR: a port another server holds is refused
        s.listen(8)
        out.append(s)
    return out


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parse_args(argv)
    sys.stderr.write("labserver: SGLang %s STAND-IN (not SGLang) model=%s port=%s algorithm=%s mode=%s%s\n" % (
        VERSION, args["model_path"], args["port"], args.get("speculative_algorithm"),
        os.environ.get("SGLANG_DDTREE_MODE", "-"), " unknown flags: " + " ".join(unknown) if unknown else ""))
    import logging  # SGLang's start-up line, as engine.py writes it (resolved args, secrets and all)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", force=True)
    logging.getLogger("labserver").info(f"server_args={ {k: v for k, v in args.items() if k != 'config'} }")
    if os.environ.get("LABSERVER_FAIL_AT_START") == "1":
        sys.stderr.write("labserver: LABSERVER_FAIL_AT_START=1: failing to load the model\n")
        return 1
    held = hold_tp_ports(args)  # noqa: F841 (held open while the server runs)
    state = State(args, argv)
    srv_cls = ThreadingHTTPServer if ":" not in args["host"] else type(
        "ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})  # an IPv6 address
    srv = srv_cls((args["host"], int(args["port"])), make_handler(state))
    srv.daemon_threads = True
    try:
        srv.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
