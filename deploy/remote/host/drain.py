"""Drain a GPU's server through the host's router before it restarts, and put it back after its gate.

Against the real SGLang router (sglang-router 0.3.2; its API verified on the lab): `GET /workers` lists the
registered workers (`{"workers": [{"id", "url", "is_healthy", "load", ...}]}`), `DELETE /workers/{id}` queues the
removal (202) and the router stops choosing that worker at once -- requests it already proxies run to their end --,
`POST /workers {"url", "api_key"}` queues an addition (202; a worker's key is never inherited when added this
way). With a router API key every call carries `Authorization: Bearer KEY` (read by the caller, as root, from the
host's key file; never printed or returned).

take_out: remove the worker, then wait until the server's own counters (sglang:num_running_reqs +
sglang:num_queue_reqs on its /metrics, parsed by metrics.py) say 0, for at most the inventory's drain_timeout;
past it, say so and go on. put_back: one warm-up request to the server itself, then add the worker and wait until
the router reports it healthy. Read-only towards everything but the router. Stdlib only (and metrics.py).
"""
import json
import re
import time

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


def server_load(port, address="127.0.0.1"):
    """(requests in flight or None, detail) from the server's /metrics; (0, ...) when nothing listens there."""
    code, raw = http(int(port), "GET", "/metrics", timeout=3, address=address)
    if code is None:
        return 0, "not answering (%s)" % raw[:80].decode("utf-8", "replace")
    if code != 200:
        return None, "/metrics HTTP %s" % code
    try:
        figures = metricsmod.serving(raw.decode("utf-8", "replace"))
    except metricsmod.MetricsError as exc:
        return None, str(exc)
    n = metricsmod.in_flight(figures)
    return n, "no sglang:num_running_reqs/num_queue_reqs" if n is None else "%d in flight" % n


def remove(spec, inst, key=None):
    """Take `inst`'s worker out of the router; True when it was listed. Raises RuntimeError only when the router
    cannot be asked or keeps listing it (the caller stops: restarting then would cut requests)."""
    url = spec["workers"][inst]
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


def wait_idle(spec, servers, t0=None):
    """Wait until every server of {inst: (port, address)} holds no request, for at most spec["timeout"] s from
    `t0`. Returns {inst: {in_flight_at_start, in_flight, seconds, drained, timed_out, detail}}."""
    t0 = time.monotonic() if t0 is None else t0
    deadline = t0 + float(spec.get("timeout") or 0)
    out, left = {}, dict(servers)
    for inst, (port, address) in servers.items():
        n, detail = server_load(port, address)
        out[inst] = {"in_flight_at_start": n, "in_flight": n, "detail": detail}
    while True:
        for inst in list(left):
            if out[inst]["in_flight"] == 0 or out[inst]["in_flight"] is None:
                out[inst].update(seconds=round(time.monotonic() - t0, 2), drained=out[inst]["in_flight"] == 0,
                                 timed_out=False)
                del left[inst]
        if not left:
            return out
        if time.monotonic() >= deadline:
            for inst in left:
                out[inst].update(seconds=round(time.monotonic() - t0, 2), drained=False, timed_out=True)
            return out
        time.sleep(POLL)
        for inst, (port, address) in left.items():
            out[inst]["in_flight"], out[inst]["detail"] = server_load(port, address)


def take_out(spec, servers, key=None):
    """Remove every server of {inst: (port, address)} from the router first, then wait for all of them together
    (one deadline for the batch). Returns {inst: {removed, url, in_flight_at_start, in_flight, seconds, drained,
    timed_out, detail}}."""
    t0 = time.monotonic()
    removed = dict((inst, remove(spec, inst, key)) for inst in servers)
    out = wait_idle(spec, servers, t0)
    for inst in servers:
        out[inst].update(removed=removed[inst], url=spec["workers"][inst])
    return out


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
