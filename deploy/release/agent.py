"""The remote half of `fab deploy/rollback/status/logs/restart`: a stdlib-only program for the host's python3.

Sent as an argument (`python3 -c SOURCE OP ARGS_B64`), one SSH round trip per operation; prints one line
`@@AGENT@@ <json>` as its result. Every operation is also importable locally (tests run the gate against
the lab server on loopback). Host layout, under state_dir (parent of release_root):

    releases/<id>/{manifest.json, wheels/, systemd/, env/gpuN.env, bin/, labserver/, overlays/{new,orig}/}
    releases/current -> <id>          active release (switched atomically)
    deploy.lock                       holder, command, start time (O_EXCL; --break-lock removes it)
    journal.jsonl                     audit journal: one JSON line per deploy, rollback, restart
    services.json                     per GPU: release and digest it was last started with
"""
import base64
import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request

MARK = "@@AGENT@@"
UNIT_DIR = "/etc/systemd/system"
UNIT_FILE = "sglang-ddtree@.service"


def _now():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def _run(argv, timeout=600):
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    return r.returncode, r.stdout


def _read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def unit(inst):
    return "sglang-ddtree@%s.service" % inst


# ---------------------------------------------------------------- releases and lock

def current_release(root):
    link = os.path.join(root, "current")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def list_releases(root):
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d not in ("current",) and not d.startswith(".")
                  and os.path.isfile(os.path.join(root, d, "manifest.json")))


def lock_path(a):
    return os.path.join(a["state_dir"], "deploy.lock")


def lock_read(a):
    return _read_json(lock_path(a))


def lock_acquire(a, holder):
    os.makedirs(a["state_dir"], exist_ok=True)
    path = lock_path(a)
    if a.get("break_lock") and os.path.exists(path):
        old = lock_read(a)
        os.unlink(path)
        journal_append(a, {"event": "break-lock", "broken": old, "by": holder.get("holder")})
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return {"ok": False, "holder": lock_read(a) or {"holder": "unknown (unreadable lock file)"}}
    holder = dict(holder, started=_now(), started_ts=time.time())
    with os.fdopen(fd, "w") as f:
        json.dump(holder, f)
    return {"ok": True, "holder": holder}


def lock_release(a, token):
    cur = lock_read(a)
    if cur and cur.get("token") == token:
        os.unlink(lock_path(a))
        return True
    return False


def journal_append(a, entry):
    os.makedirs(a["state_dir"], exist_ok=True)
    entry = dict(entry, time=entry.get("time") or _now())
    with open(os.path.join(a["state_dir"], "journal.jsonl"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def journal_tail(a, n):
    try:
        with open(os.path.join(a["state_dir"], "journal.jsonl")) as f:
            lines = f.readlines()[-n:]
    except OSError:
        return []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass
    return out


# ---------------------------------------------------------------- systemd

def unit_states(insts):
    if not insts:
        return {}
    props = "Id,ActiveState,SubState,NRestarts,ExecMainStatus,UnitFileState,InvocationID,MainPID"
    code, out = _run(["systemctl", "show", "--property", props] + [unit(i) for i in insts])
    states, cur = {}, {}
    for line in (out + "\n").splitlines() + [""]:
        if not line.strip():
            if cur.get("Id"):
                states[cur["Id"].split("@", 1)[1].rsplit(".", 1)[0]] = cur
            cur = {}
            continue
        k, _, v = line.partition("=")
        cur[k] = v
    return {i: states.get(i, {}) for i in insts}


def journal_lines(inst, n=20, since=None):
    argv = ["journalctl", "--no-pager", "-o", "short-iso", "-n", str(n), "-u", unit(inst)]
    if since:
        argv += ["--since", since]
    return _run(argv, timeout=60)[1].splitlines()


# ---------------------------------------------------------------- HTTP gate

def http(port, method, path, body=None, timeout=5.0, address="127.0.0.1", api_key=None):
    """One request to a GPU service on this host; `address` is where it listens (the manifest's "address"),
    `api_key` goes in the Authorization header as SGLang expects (never printed or returned)."""
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


SECRETS_ENV = "/etc/ddtree/secrets.env"  # render.SECRETS_FILE: the unit's optional EnvironmentFile of secrets


def server_secrets(root, release):
    """The release's own bin/server_secrets.py (the unit's ExecStartPre check), imported from the root-owned,
    sha256-verified release directory."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "ddtree_server_secrets", os.path.join(root, release, "bin", "server_secrets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def secrets_preflight(root, release, gates):
    """Before anything restarts: the secrets env file and each service's API-key file must be root-owned
    0600/0400 regular files (else the unit's ExecStartPre would refuse to start and leave it down). Returns
    {instance: api key or None}; raises ValueError/OSError (the message never holds a secret)."""
    if not any(g.get("api_key_file") for g in gates.values()) and not os.path.lexists(SECRETS_ENV):
        return {i: None for i in gates}
    if not os.path.isfile(os.path.join(root, release, "bin", "server_secrets.py")):
        return {i: None for i in gates}  # a release from before the check: its unit has neither check nor key
    mod = server_secrets(root, release)
    if os.path.lexists(SECRETS_ENV):
        mod.check_owner_mode(SECRETS_ENV)
    return {i: mod.read_api_key(g["api_key_file"]) if g.get("api_key_file") else None for i, g in gates.items()}


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
            return fail("ready", "no /health 200 on port %d within %ss (last: %s)" % (port, start_timeout, code))
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


# ---------------------------------------------------------------- operations

def failed_releases(root):
    return [r for r in list_releases(root) if os.path.exists(os.path.join(root, r, "FAILED"))]


def op_probe(a):
    """State for planning; optionally takes the lock. Reads each tree-verify model's config.json."""
    root = a["root"]
    cur = current_release(root)
    out = {"current": cur, "releases": list_releases(root), "failed": failed_releases(root), "lock": lock_read(a),
           "manifest": _read_json(os.path.join(root, cur, "manifest.json")) if cur else None,
           "services": _read_json(os.path.join(a["state_dir"], "services.json"), {}),
           "units": unit_states(a.get("instances", [])), "configs": {},
           "venv_python": os.path.exists(os.path.join(a["venv"], "bin", "python"))}
    for m in a.get("models", []):
        p = os.path.join(m, "config.json")
        try:
            out["configs"][m] = {"config": _read_json_strict(p)}
        except (OSError, ValueError) as e:
            out["configs"][m] = {"error": "%s: %s" % (p, e)}
    out["overlays"] = overlay_check(a["venv"], a.get("overlays", []))
    if a.get("lock_holder"):
        out["lock_result"] = lock_acquire(a, a["lock_holder"])
    return out


def _read_json_strict(p):
    with open(p) as f:
        return json.load(f)


def site_packages(venv):
    c = sorted(glob.glob(os.path.join(venv, "lib", "python3*", "site-packages")))
    if not c:
        raise RuntimeError("%s: no lib/python3*/site-packages" % venv)
    return c[-1]


def dist_version(sp, package):
    norm = package.lower().replace("-", "_")
    for d in glob.glob(os.path.join(sp, "*.dist-info")):
        name, _, rest = os.path.basename(d)[:-len(".dist-info")].partition("-")
        if name.lower().replace("-", "_") == norm:
            return rest
    return None


def overlay_check(venv, overlays):
    """Each overlay: installed version matches and the target file is the original (or already patched)."""
    out = []
    if not overlays:
        return out
    sp = site_packages(venv)
    for o in overlays:
        path = os.path.join(sp, o["path"])
        have = dist_version(sp, o["package"])
        sha = _sha(path) if os.path.isfile(path) else None
        ok = have == o["version"] and sha in (o["sha256"], o["new_sha256"])
        why = ""
        if have != o["version"]:
            why = "%s is %s on the host, the overlay is for %s" % (o["package"], have, o["version"])
        elif sha not in (o["sha256"], o["new_sha256"]):
            why = "%s has sha256 %s, the overlay expects %s" % (o["path"], sha, o["sha256"])
        out.append({"path": o["path"], "ok": ok, "why": why, "state": "patched" if sha == o["new_sha256"] else "orig"})
    return out


def op_stage(a):
    """Unpack an uploaded bundle into releases/<id>, verify every sha256, then activate it."""
    root, rid, t0 = a["root"], a["release"], time.monotonic()
    os.makedirs(root, mode=0o755, exist_ok=True)
    dest = os.path.join(root, rid)
    tmp = os.path.join(root, ".incoming-" + rid)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with tarfile.open(a["bundle"]) as tar:
        for m in tar.getmembers():
            if not m.isfile() or m.name.startswith("/") or ".." in m.name.split("/") or \
                    not m.name.startswith(rid + "/"):
                raise RuntimeError("refusing bundle member %r" % m.name)
        tar.extractall(tmp)
    os.unlink(a["bundle"])
    man = _read_json_strict(os.path.join(tmp, rid, "manifest.json"))
    for rel, sha in man["files"].items():
        if _sha(os.path.join(tmp, rid, rel)) != sha:
            raise RuntimeError("sha256 mismatch for %s in release %s" % (rel, rid))
    user = man["service_user"]
    if _run(["id", "-u", user])[0] != 0:
        code, out = _run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                          "--shell", "/usr/sbin/nologin", "--user-group", user])
        if code != 0:
            raise RuntimeError("useradd %s: %s" % (user, out))
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.rename(os.path.join(tmp, rid), dest)
    shutil.rmtree(tmp, ignore_errors=True)
    for dirpath, dirnames, _ in os.walk(dest):
        os.chmod(dirpath, 0o755)
    gid = int(_run(["id", "-g", user])[1].strip())
    for env in glob.glob(os.path.join(dest, "env", "*.env")):
        os.chown(env, 0, gid)
        os.chmod(env, 0o640)
    staged = round(time.monotonic() - t0, 2)
    res = op_activate(dict(a, target=rid))
    res["stage_seconds"] = staged
    return res


def op_activate(a):
    """Make `target` the active release: plugin wheel, file overlays, unit file, `current` link."""
    root, target, t0 = a["root"], a["target"], time.monotonic()
    tdir = os.path.join(root, target)
    man = _read_json_strict(os.path.join(tdir, "manifest.json"))
    prev = current_release(root)
    pman = _read_json(os.path.join(root, prev, "manifest.json")) if prev and prev != target else None
    steps = {}
    # 1. plugin wheel, offline, no dependency resolution (SGLang's CUDA stack is the provision issue's)
    t = time.monotonic()
    py = os.path.join(man["venv"], "bin", "python")
    code, out = _run([py, "-m", "pip", "install", "--no-index", "--no-deps", "--force-reinstall",
                      "--disable-pip-version-check", "--quiet", os.path.join(tdir, man["plugin"]["wheel"])])
    if code != 0:
        raise RuntimeError("pip install %s failed: %s" % (man["plugin"]["wheel"], out[-1500:]))
    steps["wheel"] = round(time.monotonic() - t, 2)
    # 2. file overlays: restore what the previous release patched and this one does not, then apply
    t = time.monotonic()
    sp = site_packages(man["venv"]) if (man["overlays"] or (pman and pman["overlays"])) else None
    want = {o["path"]: o for o in man["overlays"]}
    for o in (pman or {}).get("overlays", []):
        if o["path"] not in want:
            orig = os.path.join(root, prev, "overlays", "orig", o["path"])
            if os.path.isfile(orig):
                shutil.copy2(orig, os.path.join(sp, o["path"]))
    checks = overlay_check(man["venv"], man["overlays"])
    bad = [c for c in checks if not c["ok"]]
    if bad:
        raise RuntimeError("file overlay guard: " + "; ".join(c["why"] for c in bad))
    for o in man["overlays"]:
        target_file = os.path.join(sp, o["path"])
        orig = os.path.join(tdir, "overlays", "orig", o["path"])
        if _sha(target_file) == o["sha256"] and not os.path.exists(orig):
            os.makedirs(os.path.dirname(orig), exist_ok=True)
            shutil.copy2(target_file, orig)
        elif not os.path.exists(orig) and pman:  # already patched by the previous release: its copy is the original
            porig = os.path.join(root, prev, "overlays", "orig", o["path"])
            if os.path.isfile(porig):
                os.makedirs(os.path.dirname(orig), exist_ok=True)
                shutil.copy2(porig, orig)
        shutil.copy2(os.path.join(tdir, "overlays", "new", o["path"]), target_file)
    steps["overlays"] = round(time.monotonic() - t, 2)
    # 3. unit file + daemon-reload (only when it changed)
    t = time.monotonic()
    src, dst = os.path.join(tdir, "systemd", UNIT_FILE), os.path.join(UNIT_DIR, UNIT_FILE)
    if not os.path.exists(dst) or _sha(src) != _sha(dst):
        shutil.copyfile(src, dst + ".tmp")
        os.chmod(dst + ".tmp", 0o644)
        os.replace(dst + ".tmp", dst)
        code, out = _run(["systemctl", "daemon-reload"])
        if code != 0:
            raise RuntimeError("daemon-reload: " + out)
        steps["unit"] = "updated"
    # 3b. per-GPU device drop-ins (DeviceAllow for each service's own GPU): those of this release, none other
    if sync_dropins(tdir, man):
        code, out = _run(["systemctl", "daemon-reload"])
        if code != 0:
            raise RuntimeError("daemon-reload: " + out)
        steps["dropins"] = "updated"
    # 4. current -> target, atomically
    tmp = os.path.join(root, ".current-tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, os.path.join(root, "current"))
    # 5. boot-time enablement follows the inventory
    en = [unit(i) for i, s in man["services"].items() if s.get("enabled", True)]
    dis = [unit(i) for i, s in man["services"].items() if not s.get("enabled", True)]
    if en:
        _run(["systemctl", "enable", "--quiet"] + en)
    if dis:
        _run(["systemctl", "disable", "--now", "--quiet"] + dis)
    steps["link"] = round(time.monotonic() - t, 2)
    return {"previous": prev, "current": target, "steps": steps, "seconds": round(time.monotonic() - t0, 2)}


DROPIN_NAME = "50-ddtree-gpu.conf"


def sync_dropins(tdir, man):
    """Install the release's `systemd/sglang-ddtree@<inst>.service.d/50-ddtree-gpu.conf` files and remove ours
    from instances the release does not have one for; True when anything changed (daemon-reload needed)."""
    want = {}
    for inst, s in man.get("services", {}).items():
        rel = s.get("dropin")
        if rel:
            want[os.path.join(UNIT_DIR, "sglang-ddtree@%s.service.d" % inst, DROPIN_NAME)] = os.path.join(
                tdir, "systemd", rel)
    changed = False
    for old in glob.glob(os.path.join(UNIT_DIR, "sglang-ddtree@*.service.d", DROPIN_NAME)):
        if old not in want:
            os.unlink(old)
            changed = True
    for dst, src in sorted(want.items()):
        if os.path.isfile(dst) and not os.path.islink(dst) and _sha(dst) == _sha(src):
            continue
        d = os.path.dirname(dst)
        if os.path.islink(d):
            raise RuntimeError("%s is a symbolic link" % d)
        os.makedirs(d, mode=0o755, exist_ok=True)
        shutil.copyfile(src, dst + ".tmp")
        os.chmod(dst + ".tmp", 0o644)
        os.replace(dst + ".tmp", dst)
        changed = True
    return changed


def op_restart(a):
    """(Re)start instances together (one batch), then gate each; records services.json on success."""
    insts = a["instances"]
    try:
        keys = secrets_preflight(a["root"], a.get("release") or current_release(a["root"]), a["gates"])
    except (OSError, ValueError) as e:  # nothing was restarted: the running services keep serving
        return {"results": {i: {"ok": False, "step": "secrets", "detail": str(e), "port": a["gates"][i]["port"]}
                            for i in insts}}
    before = unit_states(insts)
    action = a.get("action", "restart")
    for i in insts:  # clear a start-limit hit or failed state from earlier attempts
        if before[i].get("ActiveState") == "failed" or before[i].get("SubState") == "auto-restart":
            _run(["systemctl", "reset-failed", unit(i)])
    t0 = time.monotonic()
    code, out = _run(["systemctl", action, "--no-block"] + [unit(i) for i in insts])
    if code != 0:
        return {"results": {i: {"ok": False, "step": "systemctl", "detail": out.strip()[-400:]} for i in insts}}
    results = {}
    for i in insts:
        g = a["gates"][i]
        results[i] = gate(g["port"], g["expect"], a["start_timeout"], a["gate_timeout"], inst=i,
                          restarts_before=int(before[i].get("NRestarts") or 0),
                          old_invocation=before[i].get("InvocationID", ""),
                          address=g.get("address") or "127.0.0.1", api_key=keys.get(i))
        results[i]["restart_seconds"] = round(time.monotonic() - t0, 2)
    rec = _read_json(os.path.join(a["state_dir"], "services.json"), {})
    for i in insts:
        if results[i]["ok"]:
            rec[i] = {"release": a.get("release"), "digest": a["gates"][i].get("digest"), "started": _now(),
                      "accept_length": results[i].get("accept_length")}
    _write_json(os.path.join(a["state_dir"], "services.json"), rec)
    return {"results": results}


def op_stop(a):
    code, out = _run(["systemctl", "stop"] + [unit(i) for i in a["instances"]])
    return {"ok": code == 0, "out": out[-400:]}


def op_finish(a):
    """Journal entry, prune old releases (never current or `protect`), release the lock."""
    if a.get("journal"):
        journal_append(a, a["journal"])
    if a.get("failed_release"):  # a release that failed its gate is never picked as "the previous one"
        d = os.path.join(a["root"], a["failed_release"])
        if os.path.isdir(d):
            _write_json(os.path.join(d, "FAILED"), {"time": _now(), "why": a.get("failed_why", "")})
    pruned = []
    keep = int(a.get("keep", 5))
    rels = list_releases(a["root"])
    cur = current_release(a["root"])
    protect = {cur} | set(a.get("protect", []))
    for r in rels[:-keep] if len(rels) > keep else []:
        if r not in protect:
            shutil.rmtree(os.path.join(a["root"], r), ignore_errors=True)
            pruned.append(r)
    released = lock_release(a, a["token"]) if a.get("token") else False
    return {"pruned": pruned, "unlocked": released}


def op_unlock(a):
    return {"unlocked": lock_release(a, a["token"])}


def op_status(a):
    root = a["root"]
    cur = current_release(root)
    man = _read_json(os.path.join(root, cur, "manifest.json")) if cur else None
    insts = sorted(set(a.get("instances", [])) | set((man or {}).get("services", {})),
                   key=lambda s: (len(s), s))
    health = {}
    for i in insts:
        ms = (man or {}).get("services", {}).get(i) or {}
        port = ms.get("port") or a.get("ports", {}).get(i)
        if port:  # /health needs no API key (SGLang exempts /health*)
            code, _ = http(int(port), "GET", "/health", timeout=2, address=ms.get("address") or "127.0.0.1")
            health[i] = code
    plugin = None
    try:
        plugin = dist_version(site_packages(a["venv"]), "sglang_ddtree")
    except RuntimeError:
        pass
    return {"current": cur, "releases": list_releases(root), "failed": failed_releases(root), "manifest": man,
            "lock": lock_read(a),
            "units": unit_states(insts), "health": health, "plugin_installed": plugin,
            "services": _read_json(os.path.join(a["state_dir"], "services.json"), {}),
            "journal": journal_tail(a, a.get("journal_n", 5))}


def op_logs(a):
    return {i: journal_lines(i, a.get("n", 50), a.get("since")) for i in a["instances"]}


OPS = {"probe": op_probe, "stage": op_stage, "activate": op_activate, "restart": op_restart, "stop": op_stop,
       "finish": op_finish, "unlock": op_unlock, "status": op_status, "logs": op_logs}


def main(argv):
    op, args = argv[1], json.loads(base64.b64decode(argv[2]))
    try:
        out = {"ok": True, "result": OPS[op](args)}
    except Exception as e:  # reported to the caller with the host's name; never a bare traceback
        out = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
    sys.stdout.write("\n" + MARK + " " + json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
