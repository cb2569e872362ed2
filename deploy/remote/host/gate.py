"""The health gate: a (re)started service must answer /health, /health_generate, /v1/models with the served
model, a short greedy /generate and /server_info with the expected speculative algorithm, each within the
deadlines, while its unit neither fails nor restarts. Read-only; runs on the host against the address the
service listens on (the manifest's "address": loopback unless the inventory says otherwise), with the host's API
key in the Authorization header when the service has one (read by the caller from the root-only key file; never
printed or returned)."""
import json
import time
import urllib.error
import urllib.request

from .systemd import journal_lines, unit, unit_states


def http(port, method, path, body=None, timeout=5.0, address="127.0.0.1", api_key=None):
    """One request to a GPU service on this host; `api_key` goes in the Authorization header as SGLang expects.
    /health needs no key (SGLang exempts /health*)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if api_key:
        headers["Authorization"] = "Bearer " + api_key
    host = "[%s]" % address if ":" in address else address
    req = urllib.request.Request("http://%s:%d%s" % (host, port, path), data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, raw
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError) as e:
        return None, str(e).encode()


def gate(port, expect, start_timeout, gate_timeout, inst=None, restarts_before=None, poll=0.3, old_invocation=None,
         address="127.0.0.1", api_key=None):
    """The health gate for one service; returns {ok, step, detail, timings, accept_length}.

    Steps: ready (/health 200 while the unit is not failing), /health_generate, /v1/models lists the served
    model, a short greedy /generate returns text, /server_info reports the expected speculative algorithm.
    """
    t0 = time.monotonic()
    res = {"ok": False, "port": port, "steps": {}, "accept_length": None}

    def fail(step, detail):
        res.update(step=step, detail=detail, seconds=round(time.monotonic() - t0, 2))
        if inst:
            res["journal"] = journal_lines(inst, 15)
        return res

    deadline = t0 + start_timeout
    while True:
        if inst:
            st = unit_states([inst])[inst]
            nres = int(st.get("NRestarts") or 0)
            if st.get("ActiveState") == "failed" or st.get("SubState") == "auto-restart" or (
                    restarts_before is not None and nres > restarts_before):
                return fail("start", "unit %s (%s/%s, exit status %s, restarts %d)" % (
                    unit(inst), st.get("ActiveState"), st.get("SubState"), st.get("ExecMainStatus"), nres))
            if st.get("SubState") == "start-post" and st.get("MainPID") == "0":
                return fail("start", "the server process of %s exited while starting (exit status %s)" % (
                    unit(inst), st.get("ExecMainStatus")))
            if st.get("ActiveState") == "inactive" and st.get("InvocationID") != old_invocation:
                return fail("start", "unit %s is inactive (stopped)" % unit(inst))
            if old_invocation is not None and st.get("InvocationID") in (old_invocation, ""):
                # the restart job has not started the new process yet: never gate the old one
                if time.monotonic() > deadline:
                    return fail("start", "unit %s was not restarted within %ss" % (unit(inst), start_timeout))
                time.sleep(poll)
                continue
        code, _ = http(port, "GET", "/health", timeout=2, address=address)
        if code == 200:
            break
        if time.monotonic() > deadline:
            return fail("ready", "no /health 200 on %s:%d within %ss (last: %s)" % (address, port, start_timeout, code))
        time.sleep(poll)
    res["steps"]["ready"] = round(time.monotonic() - t0, 2)
    gdl = time.monotonic() + gate_timeout

    def left():
        return max(1.0, gdl - time.monotonic())

    t = time.monotonic()
    code, body = http(port, "GET", "/health_generate", timeout=left(), address=address, api_key=api_key)
    if code != 200:
        return fail("health_generate", "HTTP %s %s" % (code, body[:200].decode("utf-8", "replace")))
    res["steps"]["health_generate"] = round(time.monotonic() - t, 2)

    t = time.monotonic()
    code, body = http(port, "GET", "/v1/models", timeout=left(), address=address, api_key=api_key)
    try:
        ids = [m.get("id") for m in json.loads(body).get("data", [])] if code == 200 else []
    except ValueError:
        ids = []
    if expect.get("model") not in ids:
        return fail("models", "/v1/models: HTTP %s, serves %s, expected %r" % (code, ids, expect.get("model")))
    res["steps"]["models"] = round(time.monotonic() - t, 2)

    t = time.monotonic()
    code, body = http(port, "POST", "/generate", {"text": "The capital of France is",
                                                  "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
                      timeout=left(), address=address, api_key=api_key)
    try:
        out = json.loads(body) if code == 200 else {}
    except ValueError:
        out = {}
    if not isinstance(out, dict) or not out.get("text"):
        return fail("generate", "greedy /generate: HTTP %s %s" % (code, body[:200].decode("utf-8", "replace")))
    res["steps"]["generate"] = round(time.monotonic() - t, 2)
    res["text"] = out["text"][:60]
    meta = out.get("meta_info") or {}
    if meta.get("spec_accept_length") is not None:
        res["accept_length"] = meta["spec_accept_length"]

    t = time.monotonic()
    code, body = http(port, "GET", "/server_info", timeout=left(), address=address, api_key=api_key)
    if code == 404:
        code, body = http(port, "GET", "/get_server_info", timeout=left(), address=address, api_key=api_key)
    try:
        info = json.loads(body) if code == 200 else {}
    except ValueError:
        info = {}
    algo = info.get("speculative_algorithm")
    if algo != expect.get("algorithm"):
        return fail("server_info", "speculative_algorithm is %r, expected %r (HTTP %s)" % (
            algo, expect.get("algorithm"), code))
    for st in info.get("internal_states") or []:
        if isinstance(st, dict) and st.get("avg_spec_accept_length") is not None:
            res["accept_length"] = st["avg_spec_accept_length"]
    res["steps"]["server_info"] = round(time.monotonic() - t, 2)
    if inst and restarts_before is not None:
        st = unit_states([inst])[inst]
        if int(st.get("NRestarts") or 0) > restarts_before or st.get("ActiveState") not in ("active", "activating"):
            return fail("stable", "unit restarted or stopped during the gate (%s/%s)" % (
                st.get("ActiveState"), st.get("SubState")))
    res.update(ok=True, step="ok", detail="", seconds=round(time.monotonic() - t0, 2), algorithm=algo)
    return res
