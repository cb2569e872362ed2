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
    "--config": str, "--api-key": str, "--admin-api-key": str,
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
        self.args, self.argv = args, argv
        self.started = time.time()
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
        """A deterministic stand-in for the average accept length (tree modes accept more than linear)."""
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
            n = max(1, min(int(max_new or 16), 64))
            text = " " + " ".join(words[i % len(words)] for i in range(n))
            return text, n

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
            if p == "/generate":
                sp = req.get("sampling_params") or {}
                text, n = self._complete(req.get("text"), sp.get("max_new_tokens"))
                al = state.accept_length()
                verify = max(1, int(round(n / al)))
                meta = {"id": req.get("rid") or uuid.uuid4().hex, "finish_reason": {"type": "length", "length": n},
                        "prompt_tokens": len(str(req.get("text") or "").split()), "weight_version": "default",
                        "num_retractions": 0, "reasoning_tokens": 0, "completion_tokens": n, "cached_tokens": 0,
                        "e2e_latency": round(time.time() - t0, 6)}
                if state.algorithm:
                    meta.update(spec_verify_ct=verify, spec_accept_length=round(n / verify, 3))
                return self.send(200, {"text": text, "output_ids": list(range(100, 100 + n)), "meta_info": meta})
            if p == "/v1/completions":
                if req.get("model") not in (None, state.served):
                    return self.send(404, {"object": "error", "message": "The model `%s` does not exist." %
                                           req.get("model"), "type": "NotFoundError", "param": None, "code": 404})
                text, n = self._complete(req.get("prompt"), req.get("max_tokens"))
                return self.send(200, {"id": uuid.uuid4().hex, "object": "text_completion", "created": int(t0),
                                       "model": state.served,
                                       "choices": [{"index": 0, "text": text, "logprobs": None,
                                                    "finish_reason": "length", "matched_stop": None}],
                                       "usage": {"prompt_tokens": len(str(req.get("prompt")).split()),
                                                 "completion_tokens": n,
                                                 "total_tokens": n + len(str(req.get("prompt")).split())}})
            return self.send(404, {"detail": "Not Found"})

    return H


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
