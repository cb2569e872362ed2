"""A bounded streaming load generator for the lab: N clients per endpoint (a host's router), each sending streaming
`/generate` requests one after another until a fixed total of requests has been sent or a time cap passed; it
stops by itself. Used by tests/lab/test_lab_router.py and benchmarks/rollout_under_load.py.

Lab addresses only: every endpoint must be in this lab's subnet (deploy/lab/fleet.SUBNET) or loopback, so it can
never be pointed at a real fleet. Stdlib HTTP (urllib), one thread per client.

A request is `ok` when its stream ended with `data: [DONE]` after exactly max_new_tokens tokens, counted from each
chunk's `meta_info.completion_tokens` (SGLang's running count: a speculative server streams several tokens a
chunk; the stand-in streams one) or, where a chunk has none, one per chunk. Requests ask `ignore_eos`, so a real
model generates them all. Anything else -- a refused connection, an HTTP error, a cut stream -- is `failed`, with
the error.
"""
from __future__ import annotations

import ipaddress
import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from . import fleet


@dataclass
class Result:
    endpoint: str
    client: int
    start: float
    end: float
    ok: bool
    tokens: int
    error: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


def check_lab(url: str) -> None:
    host = urlsplit(url).hostname or ""
    ip = ipaddress.ip_address(host)
    if not (ip.is_loopback or ip in ipaddress.ip_network(f"{fleet.SUBNET}.0/24")):
        raise ValueError(f"{url}: the load generator talks to this lab's hosts only ({fleet.SUBNET}.0/24)")


def chunk_tokens(payload: bytes, so_far: int) -> int:
    """The tokens generated so far after one stream chunk: its `meta_info.completion_tokens` where it has one,
    else one more than before."""
    try:
        meta = json.loads(payload).get("meta_info") or {}
        count = meta.get("completion_tokens")
    except (ValueError, AttributeError):
        count = None
    return count if type(count) is int and count >= so_far else so_far + 1


@dataclass
class Load:
    endpoints: list[tuple[str, str | None]]     # (base URL of a router, its API key or None)
    clients: int = 8                            # per endpoint
    total: int = 2000                           # requests, all clients together
    time_cap: float = 300.0                     # s
    max_new_tokens: int = 32
    timeout: float = 60.0                       # s per request
    results: list[Result] = field(default_factory=list)

    def __post_init__(self):
        for url, _k in self.endpoints:
            check_lab(url)
        self._lock = threading.Lock()
        self._sent = 0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.t0 = None

    def _take(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.total or time.monotonic() - self.t0 > self.time_cap:
                return False
            self._sent += 1
            return True

    def one(self, url: str, key: str | None, client: int) -> Result:
        body = json.dumps({"text": f"client {client}: the capital of France is", "stream": True,
                           "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0,
                                               "ignore_eos": True}}).encode()
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = "Bearer " + key
        t = time.monotonic()
        n, done, err = 0, False, ""
        try:
            req = urllib.request.Request(url + "/generate", data=body, headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                for line in r:
                    if line.startswith(b"data: [DONE]"):
                        done = True
                    elif line.startswith(b"data:"):
                        n = chunk_tokens(line[5:], n)
        except urllib.error.HTTPError as e:
            err = f"HTTP {e.code} {e.read()[:120]!r}"
        except Exception as e:  # a reset or cut stream: that request failed
            err = f"{type(e).__name__}: {e}"
        ok = done and n == self.max_new_tokens and not err
        if not ok and not err:
            err = f"stream ended after {n} of {self.max_new_tokens} tokens" + ("" if done else " without [DONE]")
        return Result(url, client, t, time.monotonic(), ok, n, err)

    def _client(self, url, key, client):
        while self._take():
            r = self.one(url, key, client)
            with self._lock:
                self.results.append(r)

    def start(self) -> "Load":
        self.t0 = time.monotonic()
        for url, key in self.endpoints:
            for c in range(self.clients):
                th = threading.Thread(target=self._client, args=(url, key, c), daemon=True)
                th.start()
                self._threads.append(th)
        return self

    def stop(self) -> None:
        self._stop.set()
        self.join()

    def join(self) -> None:
        for th in self._threads:
            th.join(self.timeout + 5)

    def done(self) -> bool:
        return not any(th.is_alive() for th in self._threads)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, int(round(q / 100.0 * (len(v) - 1)))))]


def summary(results: list[Result]) -> dict:
    ok = [r for r in results if r.ok]
    return {"sent": len(results), "completed": len(ok), "failed": len(results) - len(ok),
            "p50": percentile([r.latency for r in ok], 50), "p99": percentile([r.latency for r in ok], 99),
            "tokens": sum(r.tokens for r in results), "errors": sorted({r.error for r in results if r.error})[:5]}
