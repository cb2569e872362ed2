"""The lab's load generator judges a request by the tokens the server says it generated, so a speculative server
that streams several tokens a chunk (real SGLang under DFLASH/DDTREE) is not counted as failed."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy.lab import loadgen


def serve(chunks_of):
    """A loopback server streaming `/generate` as SGLang does: `data: {json}` chunks whose meta_info carries the
    running completion_tokens, then `data: [DONE]`; chunks_of(max_new_tokens) gives each chunk's token count."""
    seen = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append(body)
            n = body["sampling_params"]["max_new_tokens"]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            done = 0
            for k in chunks_of(n):
                done += k
                meta = {"completion_tokens": done} if k else {}
                self.wfile.write(b"data: " + json.dumps({"text": "x", "meta_info": meta}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


@pytest.mark.parametrize("chunks, ok", [
    (lambda n: [3] * (n // 3) + [n % 3] * bool(n % 3), True),   # several tokens a chunk (speculative)
    (lambda n: [1] * n, True),                                   # one a chunk (plain, the stand-in)
    (lambda n: [4] * (n // 4 - 1), False),                       # stopped short: failed, whatever the chunk count
])
def test_a_request_is_judged_by_the_tokens_the_server_generated(chunks, ok):
    srv, seen = serve(chunks)
    try:
        load = loadgen.Load([(f"http://127.0.0.1:{srv.server_port}", None)], clients=2, total=4,
                            max_new_tokens=24).start()
        load.join()
    finally:
        srv.shutdown()
    s = loadgen.summary(load.results)
    assert s["sent"] == 4 and s["completed"] == (4 if ok else 0), s
    assert all(b["sampling_params"]["ignore_eos"] is True for b in seen)


def test_chunk_tokens_falls_back_to_one_a_chunk():
    assert loadgen.chunk_tokens(b'{"meta_info": {"completion_tokens": 7}}', 3) == 7
    assert loadgen.chunk_tokens(b'{"text": "a"}', 3) == 4
    assert loadgen.chunk_tokens(b"not json", 3) == 4
    assert loadgen.chunk_tokens(b'{"meta_info": {"completion_tokens": 2}}', 3) == 4  # never backwards
