"""The health gate: a (re)started service must answer /health, /health_generate, /v1/models with the served
model, a short greedy /generate and /server_info with the expected speculative algorithm, each within the
deadlines, while its unit neither fails nor restarts; then, when the plan gives one, the canary (`canary`): held
prompts generated greedy and re-scored by the server's own prefill, every emitted token within the margin of the
target's argmax, and the accept length at or above the floor (deploy/canary.py says what and why). Read-only;
runs on the host against the address the service listens on (the manifest's "address": loopback unless the
inventory says otherwise), with the host's API key in the Authorization header when the service has one (read by
the caller from the root-only key file; never printed or returned)."""
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
         address="127.0.0.1", api_key=None, canary_spec=None):
    """The health gate for one service; returns {ok, step, detail, timings, accept_length}.

    Steps: ready (/health 200 while the unit is not failing), /health_generate, /v1/models lists the served
    model, a short greedy /generate returns text, /server_info reports the expected speculative algorithm,
    the canary (`canary_spec`) passes.
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
    if canary_spec:
        t = time.monotonic()
        ok, detail, info = canary(port, canary_spec, left, address=address, api_key=api_key)
        res["canary"] = info
        if info.get("accept_length") is not None:
            res["accept_length"] = info["accept_length"]
        if not ok:
            return fail("canary", detail)
        res["steps"]["canary"] = round(time.monotonic() - t, 2)
    if inst and restarts_before is not None:
        st = unit_states([inst])[inst]
        if int(st.get("NRestarts") or 0) > restarts_before or st.get("ActiveState") not in ("active", "activating"):
            return fail("stable", "unit restarted or stopped during the gate (%s/%s)" % (
                st.get("ActiveState"), st.get("SubState")))
    res.update(ok=True, step="ok", detail="", seconds=round(time.monotonic() - t0, 2), algorithm=algo)
    return res


def _post_json(port, body, left, address, api_key):
    code, raw = http(port, "POST", "/generate", body, timeout=left(), address=address, api_key=api_key)
    try:
        out = json.loads(raw) if code == 200 else None
    except ValueError:
        out = None
    if not isinstance(out, dict):
        return None, "HTTP %s %s" % (code, raw[:200].decode("utf-8", "replace"))
    fin = (out.get("meta_info") or {}).get("finish_reason")
    if isinstance(fin, dict) and fin.get("type") == "abort":
        return None, "aborted: %s" % str(fin.get("message"))[:200]
    return out, None


def _prefill(ids, start):
    """The prefill-only request: input-token logprobs of `ids` from position `start`, the top-1 at each."""
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 1}


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _accept(out, accepts):
    """One generation's (spec_accept_length, completion_tokens, spec_verify_ct) from its meta_info, where it
    reports an accept length (the last two None where it does not count them)."""
    meta = out.get("meta_info") or {}
    al, n, ct = _num(meta.get("spec_accept_length")), _num(meta.get("completion_tokens")), \
        _num(meta.get("spec_verify_ct"))
    if al is not None:
        accepts.append((float(al), n, ct) if n is not None and ct else (float(al), None, None))


def _metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            try:
                return float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                return None
    return None


def _name(k, p):
    if "text" in p:
        t = p["text"].replace("\n", " ")
        return "prompt %d (%r)" % (k, t[:40] + ("..." if len(t) > 40 else ""))
    return "prompt %d (%d token ids)" % (k, len(p["input_ids"]))


def canary(port, spec, left, address="127.0.0.1", api_key=None):
    """Run a canary spec (deploy/canary.py) against one server. `left()`: seconds left of the gate's deadline.
    Returns (ok, detail, info); a failure's detail names the prompt, the position and the gap."""
    margin = float(spec["margin"])
    info = {"prompts": len(spec["prompts"]), "tokens": 0, "max_gap": 0.0 if spec.get("rescore", True) else None,
            "accept_length": None,
            "accept_floor": spec.get("accept_floor"), "floor_source": spec.get("floor_source")}
    accepts = []
    for k, p in enumerate(spec["prompts"]):
        name = _name(k, p)
        if left() <= 1.0:
            return False, "%s: the gate's deadline (gate_timeout) passed after %d of %d prompts" % (
                name, k, len(spec["prompts"])), info
        ids = p.get("input_ids")
        if not spec.get("rescore", True):  # accept length only (a server that admits no logprob request)
            out, err = _post_json(port, dict({"text": p["text"]} if ids is None else {"input_ids": list(ids)},
                                             sampling_params={"max_new_tokens": int(spec["tokens"]), "temperature": 0,
                                                              "ignore_eos": True}), left, address, api_key)
            if err:
                return False, "%s: greedy /generate: %s" % (name, err), info
            _accept(out, accepts)
            info["tokens"] += len(out.get("output_ids") or [])
            continue
        if ids is None:  # the prompt's token ids, from the server's own tokenizer, by the same prefill request
            out, err = _post_json(port, {"text": p["text"], "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                         "return_logprob": True, "logprob_start_len": 0}, left, address, api_key)
            if err:
                return False, "%s: tokenizing prefill: %s" % (name, err), info
            try:
                ids = [int(e[1]) for e in out["meta_info"]["input_token_logprobs"]]
            except (KeyError, TypeError, IndexError, ValueError):
                return False, "%s: the tokenizing prefill returned no input_token_logprobs" % name, info
        ids = list(ids)
        if not ids:
            return False, "%s: empty prompt" % name, info
        out, err = _post_json(port, {"input_ids": ids, "sampling_params": {
            "max_new_tokens": int(spec["tokens"]), "temperature": 0, "ignore_eos": True}}, left, address, api_key)
        if err:
            return False, "%s: greedy /generate: %s" % (name, err), info
        gen = out.get("output_ids")
        if not isinstance(gen, list) or not gen or not all(isinstance(x, int) for x in gen):
            return False, "%s: greedy /generate returned no output_ids" % name, info
        _accept(out, accepts)
        # the same server's own prefill of prompt + output: the target's distribution at each emitted position
        # (entry 0 is the last prompt token, whose predicting distribution is not returned)
        out, err = _post_json(port, _prefill(ids + gen, len(ids) - 1), left, address, api_key)
        if err:
            return False, "%s: re-scoring prefill: %s" % (name, err), info
        meta = out.get("meta_info") or {}
        try:
            rows = list(zip(meta["input_token_logprobs"], meta["input_top_logprobs"]))[1:]
        except (KeyError, TypeError):
            return False, "%s: the re-scoring prefill returned no input logprobs" % name, info
        if len(rows) != len(gen):
            return False, "%s: %d emitted tokens but %d re-scored" % (name, len(gen), len(rows)), info
        for j, (tok, top) in enumerate(rows):
            try:
                lp, tid = float(tok[0]), int(tok[1])
                best_lp, best_id = float(top[0][0]), int(top[0][1])
            except (TypeError, IndexError, ValueError):
                return False, "%s position %d: malformed logprob entry %r / %r" % (name, j, tok, top), info
            if tid != gen[j]:
                return False, "%s position %d: re-scored token %d is not the emitted %d" % (name, j, tid, gen[j]), info
            gap = best_lp - lp
            info["max_gap"] = round(max(info["max_gap"], gap), 4)
            if gap > margin:
                return False, ("%s position %d: emitted token %d is %.3f nats below the target's argmax %d "
                               "(margin %s nats)" % (name, j, gen[j], gap, best_id, margin)), info
        info["tokens"] += len(gen)
    if accepts:  # as fab bench sums it: tokens over verify steps, else the mean of the requests' own figures
        counted = [a for a in accepts if a[1] is not None]
        info["accept_length"] = round(sum(a[1] for a in counted) / sum(a[2] for a in counted), 3) \
            if len(counted) == len(accepts) else round(sum(a[0] for a in accepts) / len(accepts), 3)
        info["accept_from"] = "requests"
    else:  # the server's own gauge, where requests do not report theirs
        code, raw = http(port, "GET", "/metrics", timeout=min(5.0, left()), address=address)
        v = _metric(raw.decode("utf-8", "replace"), "sglang:spec_accept_length") if code == 200 else None
        if v:
            info["accept_length"], info["accept_from"] = round(v, 3), "/metrics"
    floor = spec.get("accept_floor")
    if floor is not None:
        al = info["accept_length"]
        if al is None:
            return False, "accept length: the server reported none (floor %s from %s)" % (
                floor, spec.get("floor_source")), info
        if al < float(floor):
            return False, "accept length %.3f over %d prompts is below the floor %s (%s)" % (
                al, len(spec["prompts"]), floor, spec.get("floor_source")), info
    return True, "", info
