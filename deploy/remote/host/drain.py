"""Drain a GPU's server through the host's router before it restarts, and put it back after its gate.

Against the real SGLang router (sglang-router 0.3.2; its API verified on the lab): `GET /workers` lists the
registered workers (`{"workers": [{"id", "url", "is_healthy", "load", ...}]}`), `DELETE /workers/{id}` queues the
removal (202) and the router stops choosing that worker at once -- requests it already proxies run to their end --,
`POST /workers {"url", "api_key"}` queues an addition (202; a worker's key is never inherited when added this
way). With a router API key every call carries `Authorization: Bearer KEY` (read by the caller, as root, from the
host's key file; never printed or returned).

take_out: remove the worker (and, when its port changed, the worker at its previous url: the server still
listening there is the one that is serving), then wait until the server's own counters (sglang:num_running_reqs +
sglang:num_queue_reqs on its /metrics, parsed by metrics.py) say 0, for at most the inventory's drain_timeout;
past it, say so and go on. A reading is one of three: idle (0 in flight, or nothing listens on the port), busy
(requests in flight) or unknown (the server does not answer in time, or answers without its counters: a hung or
SIGSTOPped server); unknown keeps the drain waiting until its deadline, never counts as drained. put_back: one
warm-up request to the server itself, then add the worker and wait until the router reports it healthy. prune:
take out (drained) every worker the router holds that the release does not name. Read-only towards everything but
the router. Stdlib only (and metrics.py).
"""
import json
import re
import time
import urllib.error
import urllib.request

from . import metrics as metricsmod
from .gate import http

ROUTER_WAIT = 15.0      # s for the router to apply a queued removal or report an added worker healthy
POLL = 0.2
WORKER_ID_RE = re.compile(r"[A-Za-z0-9-]{1,64}")   # the router's worker ids are UUIDs


def _router(spec, method, path, body=None, key=None, timeout=5.0):
    code, raw = http(int(spec["port"]), method, path, body, timeout=timeout, address=spec["address"], api_key=key)
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        data = None
    return code, data, raw


def alive(spec, timeout=3.0):
    """(ok, detail): the router answers /liveness."""
    code, _d, raw = _router(spec, "GET", "/liveness", timeout=timeout)
    return code == 200, "HTTP %s" % code if code else raw[:120].decode("utf-8", "replace")


def workers(spec, key=None):
    """{url: worker} as the router lists them; raises RuntimeError when it does not answer."""
    code, data, raw = _router(spec, "GET", "/workers", key=key)
    if code != 200 or not isinstance(data, dict) or not isinstance(data.get("workers"), list):
        raise RuntimeError("the router on %s:%s did not list its workers (HTTP %s %s)" % (
            spec["address"], spec["port"], code, raw[:120].decode("utf-8", "replace")))
    return dict((w.get("url"), w) for w in data["workers"] if isinstance(w, dict))


IDLE, BUSY, UNKNOWN = "idle", "busy", "unknown"
METRICS_TIMEOUT = 3.0


def reading(code, text, error=None):
    """(IDLE | BUSY | UNKNOWN, requests in flight or None, detail) of one /metrics answer: `code` and `text` the
    HTTP status and body, or `error` the exception the request raised. Nothing listening (connection refused) is
    idle: no server, nothing in flight. A timeout, a reset, an HTTP error or a page without the counters is
    unknown: the server may hold requests it cannot report (hung, stopped, overloaded)."""
    if error is not None:
        reason = getattr(error, "reason", error)  # urllib wraps the socket error
        if isinstance(reason, ConnectionRefusedError):
            return IDLE, 0, "not listening"
        what = "timed out" if isinstance(reason, TimeoutError) or "timed out" in str(reason) \
            else "%s: %s" % (type(reason).__name__, reason)
        return UNKNOWN, None, "/metrics %s" % what[:120]
    if code != 200:
        return UNKNOWN, None, "/metrics HTTP %s" % code
    try:
        n = metricsmod.in_flight(metricsmod.serving(text))
    except metricsmod.MetricsError as exc:
        return UNKNOWN, None, str(exc)[:120]
    if n is None:
        return UNKNOWN, None, "/metrics has no sglang:num_running_reqs/num_queue_reqs"
    return (IDLE if n == 0 else BUSY), n, "%d in flight" % n


def server_load(port, address="127.0.0.1", timeout=METRICS_TIMEOUT):
    """(requests in flight or None when unknown, detail) from the server's /metrics (see reading)."""
    state, n, detail = read_server(port, address, timeout)
    return n, detail


def read_server(port, address="127.0.0.1", timeout=METRICS_TIMEOUT):
    """reading() of the server on `port`: one GET /metrics within `timeout`."""
    host = "[%s]" % address if ":" in address else address
    try:
        with urllib.request.urlopen("http://%s:%d/metrics" % (host, int(port)), timeout=timeout) as r:
            return reading(r.status, r.read(4 << 20).decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        return reading(exc.code, "")
    except (OSError, ValueError) as exc:
        return reading(None, None, exc)


def remove(spec, inst, key=None, url=None):
    """Take `inst`'s worker (or the worker at `url`) out of the router; True when it was listed. Raises
    RuntimeError only when the router cannot be asked or keeps listing it (the caller stops: restarting then would
    cut requests)."""
    url = url or spec["workers"][inst]
    listed = workers(spec, key)
    if url not in listed:
        return False
    wid = listed[url].get("id")
    if not isinstance(wid, str) or not WORKER_ID_RE.fullmatch(wid):  # a host's answer: checked before it is a path
        raise RuntimeError("the router lists %s with a worker id that is not one (%r)" % (url, str(wid)[:40]))
    code, _d, raw = _router(spec, "DELETE", "/workers/%s" % wid, key=key)
    if code not in (200, 202, 204):
        raise RuntimeError("the router refused to remove %s (HTTP %s %s)" % (
            url, code, raw[:120].decode("utf-8", "replace")))
    end = time.monotonic() + ROUTER_WAIT
    while url in workers(spec, key):
        if time.monotonic() > end:
            raise RuntimeError("the router still lists %s %.0fs after removing it" % (url, ROUTER_WAIT))
        time.sleep(POLL)
    return True


def url_port(url):
    """The port of a worker url the router lists (http://127.0.0.1:30000), or None."""
    m = re.match(r"^https?://[^/]*:([0-9]{1,5})/?$", str(url or ""))
    return int(m.group(1)) if m and 0 < int(m.group(1)) < 65536 else None


def _read_all(ports):
    """One reading of a GPU's servers [(port, address)]: the sum in flight when every one is known, else unknown."""
    rs = [read_server(port, address) for port, address in ports]
    unknown = [d for st, _n, d in rs if st == UNKNOWN]
    if unknown:
        return None, "; ".join(unknown)
    n = sum(x for _st, x, _d in rs)
    return n, "%d in flight" % n


def wait_idle(spec, servers, t0=None):
    """Wait until every server of {inst: [(port, address), ...]} (a GPU's servers: two while its port changes)
    holds no request, for at most spec["timeout"] s from `t0`. An unknown reading (None: the server does not say)
    keeps waiting like a busy one. Returns {inst: {in_flight_at_start, in_flight (None: unknown), seconds, drained,
    timed_out, detail}}."""
    t0 = time.monotonic() if t0 is None else t0
    deadline = t0 + float(spec.get("timeout") or 0)
    ports = dict(servers)
    out, left = {}, dict(ports)
    for inst in ports:
        n, detail = _read_all(ports[inst])
        out[inst] = {"in_flight_at_start": n, "in_flight": n, "detail": detail}
    while True:
        for inst in list(left):
            if out[inst]["in_flight"] == 0:
                out[inst].update(seconds=round(time.monotonic() - t0, 2), drained=True, timed_out=False)
                del left[inst]
        if not left:
            return out
        if time.monotonic() >= deadline:
            for inst in left:
                out[inst].update(seconds=round(time.monotonic() - t0, 2), drained=False, timed_out=True)
            return out
        time.sleep(POLL)
        for inst in left:
            out[inst]["in_flight"], out[inst]["detail"] = _read_all(ports[inst])
            if out[inst]["in_flight_at_start"] is None:
                out[inst]["in_flight_at_start"] = out[inst]["in_flight"]


def take_out(spec, servers, key=None):
    """Remove every server of {inst: (port, address)} from the router first -- with the worker at its previous url
    (spec["previous"]) when its port changed, whose server is the one still serving --, then wait for all of them
    together (one deadline for the batch), on both ports. Returns {inst: {removed, url, in_flight_at_start,
    in_flight, seconds, drained, timed_out, detail, previous_url}}."""
    t0 = time.monotonic()
    prev = dict((i, u) for i, u in (spec.get("previous") or {}).items()
                if i in servers and u and u != spec["workers"][i])
    removed = dict((inst, remove(spec, inst, key)) for inst in servers)
    old_removed = dict((inst, remove(spec, inst, key, url=u)) for inst, u in prev.items())
    watch = {}
    for inst, (port, address) in servers.items():
        watch[inst] = [(port, address)]
        if url_port(prev.get(inst)):
            watch[inst].append((url_port(prev[inst]), address))
    out = wait_idle(spec, watch, t0)
    for inst in servers:
        out[inst].update(removed=removed[inst] or old_removed.get(inst, False), url=spec["workers"][inst])
        if inst in prev:
            out[inst].update(previous_url=prev[inst], previous_removed=old_removed[inst])
    return out


def prune(spec, keep=(), key=None):
    """Take out of the router every worker the release does not name (spec["expected"]) nor the run handles itself
    (`keep`: the previous urls of GPUs it restarts, the urls of GPUs it stops), draining each (at most the drain
    deadline, all together); a worker left behind by a port change or an interrupted run. Returns [{url, removed,
    in_flight_at_start, in_flight, seconds, drained, timed_out, detail}]."""
    expected = set(spec.get("expected") or []) | set(keep)
    stray = sorted(u for u in workers(spec, key) if u not in expected)
    if not stray:
        return []
    t0 = time.monotonic()
    removed = dict((u, remove(spec, None, key, url=u)) for u in stray)
    # the server behind a stray url is waited on unless a named worker shares its port (it keeps serving there)
    named = set(url_port(u) for u in spec.get("expected") or [])
    watch = dict((u, [(url_port(u), "127.0.0.1")] if url_port(u) and url_port(u) not in named else [])
                 for u in stray)
    out = wait_idle(spec, watch, t0)
    return [dict(out[u], url=u, removed=removed[u]) for u in stray]


def warm_up(port, key=None, address="127.0.0.1", timeout=60.0):
    """One request to the server itself before it takes user traffic (its first one pays the JIT/caches)."""
    t0 = time.monotonic()
    code, raw = http(int(port), "POST", "/generate", {"text": "Warm-up: the capital of France is",
                                                     "sampling_params": {"max_new_tokens": 16, "temperature": 0}},
                     timeout=timeout, address=address, api_key=key)
    return {"ok": code == 200, "seconds": round(time.monotonic() - t0, 3),
            "detail": "" if code == 200 else "HTTP %s %s" % (code, raw[:120].decode("utf-8", "replace"))}


def put_back(spec, inst, key=None):
    """Add `inst`'s worker to the router (with the worker's key) and wait until the router reports it healthy.
    Returns {ok, seconds, detail}."""
    t0 = time.monotonic()
    url = spec["workers"][inst]
    if url not in workers(spec, key):
        body = {"url": url}
        if key:
            body["api_key"] = key
        code, _d, raw = _router(spec, "POST", "/workers", body, key=key)
        if code not in (200, 201, 202):
            return {"ok": False, "seconds": round(time.monotonic() - t0, 2),
                    "detail": "the router refused to add %s (HTTP %s %s)" % (
                        url, code, raw[:120].decode("utf-8", "replace"))}
    end = time.monotonic() + ROUTER_WAIT
    while True:
        w = workers(spec, key).get(url)
        if w and w.get("is_healthy"):
            return {"ok": True, "seconds": round(time.monotonic() - t0, 2), "detail": ""}
        if time.monotonic() > end:
            return {"ok": False, "seconds": round(time.monotonic() - t0, 2),
                    "detail": "%s not healthy in the router after %.0fs (%s)" % (
                        url, ROUTER_WAIT, "listed, unhealthy" if w else "not listed")}
        time.sleep(POLL)
