"""Release ops: read a host's release state (probe, status, logs, outcome) and change it (apply) as one
transaction per call.

Host layout, under state_dir (the parent of release_root, from the inventory):

    releases/<id>/{manifest.json, wheels/, systemd/ (unit, per-GPU drop-ins), env/gpuN.env (0600 root),
                   bin/ (wait_ready.py, server_secrets.py), site/ (log redactor), labserver/, overlays/}
    releases/current -> <id>          the active release (switched atomically)
    journal.jsonl                     audit journal: one JSON line per run, with its token
    services.json                     per GPU: release and digest it was last started with

No secret is in a release: the secrets env file and the API-key file stay where the operator keeps them
(root-only 0600); the unit reads them (EnvironmentFile=, LoadCredential=), and this agent reads the key only to
send it in the gate's Authorization header.

`release.apply` runs what the control machine planned, in order -- check the secrets files as the unit's own
start check will (before any change), stage a bundle (read from stdin), activate a release, stop services,
restart batches through the health gate -- under the host lock, checking the lock's token before each step.
Activation is one transaction: the plugin in the venv, the file overlays, the unit file with the per-GPU
drop-ins and `current` switch together, or every step already done is undone. Any failure after activation began
re-activates the previous release and restarts what was touched (when the plan gives a previous release).
The op never stops half-way because its client went away: it finishes or rolls back, journals the outcome
with the run's token (release.outcome reads it) and only then lets the lock go.
"""
import glob
import hashlib
import io
import json
import os
import shutil
import tarfile
import time

from . import drain as drainmod
from . import gate as gatemod
from . import locks
from . import server_secrets
from . import venv as venvmod
from .fsutil import (Unsafe, append_jsonl, atomic_write, check_path, describe, free_bytes, naming, now_iso, read_json,
                     size_text, sha256_file, tail_jsonl, trusted_dir, trusted_tree,
                     write_json)
from .proc import run
from .registry import Failure, op
from .systemd import journal_lines, named_states, unit, unit_states
from .wheels import WheelError, check_wheel, normalize

ENV_MODE = 0o600       # env files: root only, from creation (systemd reads them as root)
FILE_MODE = 0o644


class ActivationFailed(Exception):
    def __init__(self, release, step, error, undo_errors):
        self.release, self.step, self.error, self.undo_errors = release, step, error, undo_errors
        Exception.__init__(self, "activating %s failed at %s: %s; %s" % (
            release, step, error, "every step done was undone" if not undo_errors
            else "UNDO INCOMPLETE: " + "; ".join(undo_errors)))


class GateFailed(Exception):
    def __init__(self, message, failed):
        Exception.__init__(self, message)
        self.failed = failed


# ---------------------------------------------------------------- reading state

def current_release(root):
    link = os.path.join(root, "current")
    return os.path.basename(os.readlink(link)) if os.path.islink(link) else None


def list_releases(root):
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d != "current" and not d.startswith(".")
                  and os.path.isfile(os.path.join(root, d, "manifest.json")))


def failed_releases(root):
    return [r for r in list_releases(root) if os.path.exists(os.path.join(root, r, "FAILED"))]


def manifest_of(root, rid):
    return read_json(os.path.join(root, rid, "manifest.json")) if rid else None


def plugin_version(venv, dist):
    try:
        return venvmod.installed_versions(venvmod.site_packages(venv), [dist]).get(normalize(dist))
    except venvmod.VenvError:
        return None


def overlay_check(venv, overlays):
    """Each overlay: installed version matches and the target file is the original (or already patched)."""
    out = []
    if not overlays:
        return out
    sp = venvmod.site_packages(venv)
    versions = venvmod.installed_versions(sp, [o["package"] for o in overlays])
    for o in overlays:
        path = os.path.join(sp, o["path"])
        have = versions.get(normalize(o["package"]))
        sha = sha256_file(path, follow=False) if os.path.isfile(path) and not os.path.islink(path) else None
        ok = have == o["version"] and sha in (o["sha256"], o["new_sha256"])
        why = ""
        if have != o["version"]:
            why = "%s is %s on the host, the overlay is for %s" % (o["package"], have, o["version"])
        elif sha not in (o["sha256"], o["new_sha256"]):
            why = "%s has sha256 %s, the overlay expects %s" % (o["path"], sha, o["sha256"])
        out.append({"path": o["path"], "ok": ok, "why": why, "state": "patched" if sha == o["new_sha256"] else "orig"})
    return out


def check_secrets(secrets_file, key_files=()):
    """The checks the unit's ExecStartPre makes before every start (server_secrets.py: this very module is the
    release's bin/server_secrets.py), made by root before anything restarts, plus every directory above each file
    trusted: the secrets env file, when present, and each API-key file must be root-owned 0600/0400 regular files,
    each key file well-formed. Returns {key file: key} for the gate (never sent back); raises Unsafe, whose
    message never holds a secret."""
    keys = {}
    try:
        if secrets_file and os.path.lexists(secrets_file):
            server_secrets.check_owner_mode(secrets_file)
            check_path(os.path.dirname(secrets_file))
        for f in key_files:
            check_path(os.path.dirname(f))
            keys[f] = server_secrets.read_api_key(f)  # checks the file's owner and mode first
    except (server_secrets.SecretsError, OSError) as exc:
        raise Unsafe(str(exc))
    return keys


def gate_keys(secrets_file, gates):
    """{instance: its API key or None} for these gates, after check_secrets."""
    keys = check_secrets(secrets_file, sorted(set(g["api_key_file"] for g in gates.values() if g.get("api_key_file"))))
    return dict((i, keys.get(g.get("api_key_file"))) for i, g in gates.items())


ROUTER_UNIT = "sglang-router.service"
CACHE_ROOT = "/var/cache/sglang-ddtree"   # the GPU unit's CacheDirectory= parent (render.CACHE_ROOT)
ROUTER_START = 60.0     # s for a (re)started router to answer /liveness


def router_state(man, sdir):
    """The router venvs this host has, and -- when the active release runs a router -- its unit and whether it
    answers /liveness (what the plan refuses a restart on: no router, no drain)."""
    rdir = os.path.join(sdir, "router")
    out = {"venvs": sorted(d for d in os.listdir(rdir) if not d.startswith(".") and not d.endswith(".tmp"))
           if os.path.isdir(rdir) else [], "expected": False}
    r = (man or {}).get("router") or {}
    if r.get("enabled"):
        st = named_states([ROUTER_UNIT]).get(ROUTER_UNIT, {})
        ok, detail = drainmod.alive(r)
        out.update(expected=True, unit=st, alive=ok and st.get("ActiveState") == "active",
                   detail="%s, /liveness %s" % (st.get("ActiveState") or "unknown", detail))
    return out


def venv_trust(venv):
    try:
        venvmod.check_runnable(venv)
        return "ok"
    except (Unsafe, venvmod.VenvError) as exc:
        return str(exc)


def _state(ctx, a, health=False):
    root, sdir = a["root"], a["state_dir"]
    cur = current_release(root)
    man = manifest_of(root, cur)
    lock = locks.read(ctx.state)
    if lock:
        lock["stale"] = locks.stale(lock)
    out = {"current": cur, "releases": list_releases(root), "failed": failed_releases(root), "manifest": man,
           "lock": lock, "services": read_json(os.path.join(sdir, "services.json"), {}),
           "venv_python": os.path.exists(venvmod.python(a["venv"]))}
    if a.get("manifests"):
        out["manifests"] = dict((r, manifest_of(root, r)) for r in out["releases"])
    insts = list(a.get("instances") or [])
    if health:
        insts = sorted(set(insts) | set((man or {}).get("services", {})), key=lambda s: (len(s), s))
    out["units"] = unit_states(insts)
    out["router"] = router_state(man, sdir)
    return out, man, insts


@op("release.probe")
def probe(ctx, a):
    """What a plan needs, changing nothing and taking no lock: current release and manifest, unit states, each
    tree-verify model's config.json (hybrid gate), the file-overlay guards, whether root may run the venv and
    the secrets files: the secrets env file and every API-key file the plan may restart with (those asked for and
    those of the manifests read), each "ok" or why the unit's start check would refuse it (never a key); with
    `listeners` (ports) and `model_dirs` (paths), who listens on each port and whether each path is a model
    directory (fit.py); with `facts` (the facts probe's arguments), the venv's facts as facts.probe reads them
    (the deploy's coherence preflight)."""
    out, _man, _insts = _state(ctx, a)
    out["configs"] = {}
    for m in a.get("models", []):
        p = os.path.join(m, "config.json")
        try:
            with open(p) as fh:
                out["configs"][m] = {"config": json.load(fh)}
        except (OSError, ValueError) as e:
            out["configs"][m] = {"error": "%s: %s" % (p, e)}
    try:
        out["overlays"] = overlay_check(a["venv"], a.get("overlays", []))
    except venvmod.VenvError as exc:
        out["overlays"] = [{"path": o["path"], "ok": False, "why": str(exc), "state": "?"} for o in a["overlays"]]
    if a.get("venv_trust", True):  # a rollback or restart does not ask: its activation checks the venv itself
        out["venv_trust"] = venv_trust(a["venv"]) if out["venv_python"] else "no venv python"
    secrets = a.get("secrets_file")
    out["secrets"] = "unchecked" if not secrets else "ok" if os.path.lexists(secrets) else "absent"
    if out["secrets"] == "ok":
        try:
            check_secrets(secrets)
        except Unsafe as exc:
            out["secrets"] = str(exc)
    key_files = set(a.get("api_key_files") or [])
    for m in [out["manifest"]] + list((out.get("manifests") or {}).values()):
        key_files.update(s["api_key_file"] for s in ((m or {}).get("services") or {}).values()
                         if isinstance(s, dict) and s.get("api_key_file"))
    out["api_keys"] = {}
    for f in sorted(key_files):
        try:
            check_secrets(None, [f])
            out["api_keys"][f] = "ok"
        except Unsafe as exc:
            out["api_keys"][f] = str(exc)
    out["health"] = service_health(out["manifest"], out["units"])
    out["router_view"] = router_view(out["manifest"])
    if a.get("listeners") is not None or a.get("model_dirs") is not None:
        # what the plan checks the inventory against: who listens on its ports, are its model paths models
        from . import fit
        out["listeners"] = fit.listeners(a.get("listeners") or [])
        out["model_dirs"] = dict((m, fit.model_dir(m)) for m in a.get("model_dirs") or [])
    if a.get("facts") is not None:
        # coherence before change: the facts probe's own reading of the venv (distributions with their
        # requirements, native extensions against torch for the GPU archs), in this call, under its deadline
        from . import probe as facts_probe
        out["facts"] = facts_probe.probe(ctx, dict(a["facts"], venv=a["venv"]))
    return out


def service_health(man, units, timeout=2.0):
    """{instance: "ok" or why not} for each enabled service of the active release whose unit is active: its
    /health must answer 200 within `timeout` (a hung or stopped server does not: it is no healthy service, even
    with its unit running)."""
    out = {}
    for i, ms in sorted(((man or {}).get("services") or {}).items()):
        if not ms.get("enabled", True) or (units.get(i) or {}).get("ActiveState") != "active" or not ms.get("port"):
            continue
        code, raw = gatemod.http(int(ms["port"]), "GET", "/health", timeout=timeout,
                                 address=ms.get("address") or "127.0.0.1")
        out[i] = "ok" if code == 200 else ("/health HTTP %s" % code if code else
                                           "/health: %s" % raw[:80].decode("utf-8", "replace"))
    return out


METRICS_MAX = 1 << 20   # bytes of a server's /metrics text returned (SGLang's is a few tens of KiB)


def router_view(man):
    """The router's own view of its workers, {url: {healthy, load}}, or why it could not be read. With a router key
    this needs root (the key file is root's): read-only, the key is sent and never returned."""
    r = (man or {}).get("router") or {}
    if not r.get("enabled"):
        return None
    ok, detail = drainmod.alive(r)
    view = {"alive": ok, "detail": detail, "port": r["port"], "listen": r.get("listen")}
    if not ok:
        return view
    key = None
    if r.get("api_key_file"):
        try:
            key = server_secrets.read_api_key(r["api_key_file"])
        except (server_secrets.SecretsError, OSError) as exc:
            view["error"] = "cannot read the router's key file: %s" % exc
            return view
    try:
        view["workers"] = dict((u, {"healthy": bool(w.get("is_healthy")), "load": w.get("load")})
                               for u, w in drainmod.workers(r, key).items())
    except RuntimeError as exc:
        view["error"] = str(exc)
    return view


@op("release.status")
def status(ctx, a):
    """Unit states, /health, each server's /metrics text (parsed by the caller) and the router's view."""
    out, man, insts = _state(ctx, a, health=True)
    health, metrics = {}, {}
    for i in insts:
        ms = (man or {}).get("services", {}).get(i) or {}
        port = ms.get("port") or (a.get("ports") or {}).get(i)
        if port:  # at the address it listens on (the manifest's); /health and /metrics need no API key
            addr = ms.get("address") or "127.0.0.1"
            code, _ = gatemod.http(int(port), "GET", "/health", timeout=2, address=addr)
            health[i] = code
            if code is not None and a.get("metrics", True):
                mcode, raw = gatemod.http(int(port), "GET", "/metrics", timeout=3, address=addr)
                metrics[i] = raw[:METRICS_MAX].decode("utf-8", "replace") if mcode == 200 else None
    out.update(metrics=metrics, router_view=router_view(man))
    out.update(health=health, journal=tail_jsonl(os.path.join(a["state_dir"], "journal.jsonl"), a.get("journal_n", 5)),
               plugin_installed=plugin_version(a["venv"], ((man or {}).get("plugin") or {}).get("dist")
                                               or "sglang-ddtree"))
    return out


@op("release.logs")
def logs(ctx, a):
    out = dict((i, journal_lines(i, a.get("n", 50), a.get("since"))) for i in a["instances"])
    if a.get("router"):
        out["router"] = journal_lines(None, a.get("n", 50), a.get("since"), unit_name=ROUTER_UNIT)
    return out


@op("release.outcome")
def outcome(ctx, a):
    """The journal entry of the run with this token (what happened on the host while its client was away)."""
    entries = [j for j in tail_jsonl(os.path.join(a["state_dir"], "journal.jsonl"), 200) if j.get("token") == a["token"]]
    lock = locks.read(ctx.state)
    return {"entry": entries[-1] if entries else None, "running": bool(lock and lock.get("token") == a["token"])}


# ---------------------------------------------------------------- changing state

class Host(object):
    """One apply: the paths it works on, the commands it runs, the events it sends."""

    def __init__(self, ctx, a):
        self.ctx, self.a = ctx, a
        self.root, self.sdir, self.venv = a["root"], a["state_dir"], a["venv"]
        self.unit_dir = a.get("unit_dir") or "/etc/systemd/system"
        self.unit_file = a.get("unit_file") or "sglang-ddtree@.service"
        self.out = set()   # the GPUs this run holds out of the router (recorded in the lock)

    def run(self, argv, step, timeout=600, check=True):
        r = run(argv, max(5.0, self.ctx.deadline.left(cap=timeout, floor=5)))
        if check and r["rc"] != 0:
            text = (r["out"] + r["err"]).strip()
            raise RuntimeError("%s: %s exited %s: %s%s" % (step, " ".join(argv[:4]), r["rc"], text[-1500:],
                                                           self.space_note(text)))
        return r

    def space_note(self, text):
        """A command that ran out of space (pip's own OSError names no file): how much is free where this run
        writes (the venv, the releases)."""
        if "No space left on device" not in text and "Disk quota exceeded" not in text:
            return ""
        free = [f for f in (free_bytes(p) for p in (self.venv, self.root)) if f]
        return " (free: %s)" % ", ".join("%s on %s" % (size_text(f["free"]), f["path"]) for f in free)

    # ---- stage

    def stage(self, spec):
        """Read the bundle from stdin, check every member and sha256, write it into root/.incoming-<id> with
        each file's final mode from creation (env files 0600), then rename it to root/<id>."""
        rid, size = spec["release"], int(spec["size"])
        data = self.ctx.stdin.read(size)
        if len(data) != size or hashlib.sha256(data).hexdigest() != spec["sha256"]:
            raise RuntimeError("the release bundle arrived damaged (%d of %d bytes)" % (len(data), size))
        trusted_dir(self.root, create=True)
        tmp = os.path.join(self.root, ".incoming-%s" % rid)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.mkdir(tmp, 0o700)
        try:
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                members = tar.getmembers()
                for m in members:
                    parts = m.name.split("/")
                    if not m.isfile() or m.name.startswith("/") or any(p in ("", ".", "..") for p in parts) \
                            or parts[0] != rid or len(parts) < 2:
                        raise RuntimeError("refusing bundle member %r" % m.name)
                for m in members:
                    rel = m.name.split("/", 1)[1]
                    dst = os.path.join(tmp, rel)
                    d = os.path.dirname(dst)
                    if not os.path.isdir(d):
                        os.makedirs(d, 0o755)
                    mode = ENV_MODE if rel.startswith("env/") else FILE_MODE
                    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
                    os.fchmod(fd, mode)
                    with naming(dst), os.fdopen(fd, "wb") as fh:
                        shutil.copyfileobj(tar.extractfile(m), fh)
            man = read_json(os.path.join(tmp, "manifest.json"))
            if not isinstance(man, dict) or man.get("release") != rid:
                raise RuntimeError("bundle %s has no manifest for that release" % rid)
            for rel, sha in man["files"].items():
                if sha256_file(os.path.join(tmp, rel), follow=False) != sha:
                    raise RuntimeError("sha256 mismatch for %s in release %s" % (rel, rid))
            for dirpath, _dirs, _files in os.walk(tmp):
                os.chmod(dirpath, 0o755)
            dest = os.path.join(self.root, rid)
            if os.path.lexists(dest):
                shutil.rmtree(dest)
            os.rename(tmp, dest)
        finally:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
        user = spec.get("user")
        if user and run(["id", "-u", user["name"]], 30)["rc"] != 0:
            self.run(user["useradd"], "useradd")
        return man

    # ---- activate: one transaction

    def verify_release(self, rid, man):
        tdir = os.path.join(self.root, rid)
        check_path(tdir)
        for rel, sha in man["files"].items():
            if sha256_file(os.path.join(tdir, rel), follow=False) != sha:
                raise RuntimeError("release %s: %s no longer has its recorded sha256" % (rid, rel))
        wheel = os.path.join(tdir, man["plugin"]["wheel"])
        try:
            check_wheel(wheel)
        except WheelError as exc:
            raise RuntimeError("release %s: plugin wheel refused: %s" % (rid, exc))

    def activate(self, spec):
        """Make spec["release"] active: plugin wheel, overlays, unit file and per-GPU drop-ins, `current`,
        enablement -- or nothing."""
        target = spec["release"]
        man = manifest_of(self.root, target)
        if not man:
            raise Failure("no-release", "release %s is not on this host" % target)
        prev = current_release(self.root)
        pman = manifest_of(self.root, prev) if prev and prev != target else None
        # every check before the first change
        self.verify_release(target, man)
        try:
            trusted_tree(self.venv)
            check_secrets(self.a.get("secrets_file"))
        except Unsafe as exc:
            raise Failure("unsafe", "refusing to activate %s: %s; nothing changed" % (target, exc))
        sp = venvmod.site_packages(self.venv) if (man["overlays"] or (pman and pman["overlays"])) else None
        want = dict((o["path"], o) for o in man["overlays"])
        undo, done, step = [], [], "checks"
        t0 = time.monotonic()
        try:
            step = "plugin"
            self.run(spec["commands"]["install_plugin"], "pip install")
            undo.append(("plugin", lambda: self.run(spec["commands"]["undo_plugin"], "restore plugin")))
            done.append(step)
            step = "overlays"
            saved = {}

            def put_file(path, data):
                if path not in saved:
                    saved[path] = open(path, "rb").read() if os.path.isfile(path) else None
                atomic_write(path, data, FILE_MODE)
            undo.append(("overlays", lambda: [atomic_write(p, d, FILE_MODE) for p, d in saved.items()
                                              if d is not None]))
            for o in (pman or {}).get("overlays", []):
                if o["path"] not in want:
                    orig = os.path.join(self.root, prev, "overlays", "orig", o["path"])
                    if os.path.isfile(orig):
                        put_file(os.path.join(sp, o["path"]), open(orig, "rb").read())
            bad = [c for c in overlay_check(self.venv, man["overlays"]) if not c["ok"]]
            if bad:
                raise RuntimeError("file overlay guard: " + "; ".join(c["why"] for c in bad))
            tdir = os.path.join(self.root, target)
            for o in man["overlays"]:
                target_file = os.path.join(sp, o["path"])
                orig = os.path.join(tdir, "overlays", "orig", o["path"])
                if not os.path.exists(orig):
                    src = None
                    if sha256_file(target_file) == o["sha256"]:
                        src = target_file
                    elif pman:  # already patched by the previous release: its copy is the original
                        porig = os.path.join(self.root, prev, "overlays", "orig", o["path"])
                        src = porig if os.path.isfile(porig) else None
                    if src:
                        os.makedirs(os.path.dirname(orig), 0o755, exist_ok=True)
                        atomic_write(orig, open(src, "rb").read(), FILE_MODE)
                put_file(target_file, open(os.path.join(tdir, "overlays", "new", o["path"]), "rb").read())
            done.append(step)
            step = "router-venv"
            rv = spec.get("router_venv")
            if rv and not os.path.isdir(rv["path"]):
                self.build_router_venv(rv, target)
                undo.append(("router-venv", lambda: shutil.rmtree(rv["path"], ignore_errors=True)))
                done.append(step)
            step = "unit"  # the template unit and the per-GPU drop-ins switch together, with one daemon-reload
            self.put_systemd(self.systemd_files(tdir, man, spec), undo, spec["commands"]["daemon_reload"])
            done.append(step)
            step = "current"
            self.link(target)
            undo.append(("current", lambda: self.link(prev)))
            done.append(step)
            step = "enable"
            for key in ("enable", "disable"):
                if spec["commands"].get(key):
                    self.run(spec["commands"][key], "systemctl " + key)
            done.append(step)
        except Failure:
            raise
        except Exception as exc:
            errors = []
            for name, fn in reversed(undo):
                try:
                    fn()
                except Exception as uexc:  # keep undoing the rest; say what could not be undone
                    errors.append("%s: %s: %s" % (name, type(uexc).__name__, uexc))
            raise ActivationFailed(target, step, describe(exc), errors)
        return {"previous": prev, "current": target, "steps": done, "seconds": round(time.monotonic() - t0, 2)}

    def build_router_venv(self, rv, rid):
        """The router's own venv from the wheel the release carries, built beside its final path and renamed
        into place: there is a whole venv at rv["path"] or none."""
        base = os.path.join(self.sdir, "router")
        path, tmp = rv["path"], rv["path"] + ".tmp"
        if os.path.dirname(path) != base or not os.path.basename(path).startswith("sglang-router-") or \
                rv["commands"]["venv"][-1] != tmp:
            raise RuntimeError("refusing router venv path %r (must be in %s)" % (path, base))
        wheel = os.path.join(self.root, rid, rv["wheel"])
        if not os.path.isfile(wheel):
            raise RuntimeError("the host has no router venv %s and release %s does not carry its wheel; deploy "
                               "again (the plan sends the wheel to a host that lacks it)" % (path, rid))
        try:
            check_wheel(wheel)
        except WheelError as exc:
            raise RuntimeError("router wheel refused: %s" % exc)
        if sha256_file(wheel) != rv["sha256"]:
            raise RuntimeError("router wheel %s does not have the pinned sha256" % rv["wheel"])
        trusted_dir(base, create=True)
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        try:
            self.run(rv["commands"]["venv"], "router venv", timeout=300)
            self.run(rv["commands"]["install"], "router pip install", timeout=600)
            os.rename(tmp, path)
        finally:
            if os.path.lexists(tmp):
                shutil.rmtree(tmp, ignore_errors=True)

    def router_up(self, spec):
        """(Re)start the router when what it runs changed (its digest differs from the one it was started with)
        or it is not running; wait for /liveness. Raises RuntimeError when it does not come up."""
        rec_path = os.path.join(self.sdir, "router.json")
        rec = read_json(rec_path, {})
        st = named_states([ROUTER_UNIT]).get(ROUTER_UNIT, {})
        if rec.get("digest") == spec["digest"] and st.get("ActiveState") == "active" and drainmod.alive(spec)[0]:
            return {"restarted": False}
        t0 = time.monotonic()
        self.run(spec["reset_failed"], "router reset-failed", check=False)
        self.run(spec["restart"], "router restart")
        end = t0 + ROUTER_START
        while True:
            ok, detail = drainmod.alive(spec)
            if ok:
                break
            if time.monotonic() > end:
                raise RuntimeError("sglang-router did not answer /liveness within %.0fs (%s): %s" % (
                    ROUTER_START, detail, " | ".join(journal_lines(None, 5, unit_name=ROUTER_UNIT))))
            time.sleep(0.3)
        write_json(rec_path, {"digest": spec["digest"], "started": now_iso()})
        res = {"restarted": True, "seconds": round(time.monotonic() - t0, 2)}
        self.ctx.event("router", phase="restarted", **res)
        return res

    def systemd_files(self, tdir, man, spec):
        """{path: bytes, or None to remove}: the release's template unit, each service's per-GPU drop-in
        (DeviceAllow for its own GPU) and the removal of our drop-ins of instances the release has none for."""
        prefix = self.unit_file.split("@", 1)[0] + "@"
        want = {os.path.join(self.unit_dir, self.unit_file):
                open(os.path.join(tdir, "systemd", self.unit_file), "rb").read()}
        r = man.get("router") or {}
        if r.get("enabled"):
            if r.get("unit") != ROUTER_UNIT:
                raise RuntimeError("release %s: refusing router unit %r" % (man.get("release"), r.get("unit")))
            want[os.path.join(self.unit_dir, ROUTER_UNIT)] = open(os.path.join(tdir, "systemd", ROUTER_UNIT), "rb").read()
        name = spec.get("dropin_name")
        for inst, s in sorted(man.get("services", {}).items()):
            rel = s.get("dropin")
            if not rel:
                continue
            base = os.path.basename(rel)
            if rel != "%s%s.service.d/%s" % (prefix, inst, base) or base != (name or base) \
                    or not base.endswith(".conf") or "/" in inst or inst in ("", ".", ".."):
                raise RuntimeError("release %s: refusing drop-in path %r of %s" % (man.get("release"), rel, inst))
            want[os.path.join(self.unit_dir, rel)] = open(os.path.join(tdir, "systemd", rel), "rb").read()
        if name:
            for old in glob.glob(os.path.join(glob.escape(self.unit_dir), glob.escape(prefix) + "*.service.d",
                                              glob.escape(name))):
                want.setdefault(old, None)
        return want

    def put_systemd(self, want, undo, reload_argv):
        """Write (or, for None, remove) each file of `want` that differs, into lstat-checked root directories;
        one daemon-reload when anything changed. The undo puts every old file back and reloads again."""
        saved = {}

        def current(path):
            return open(path, "rb").read() if os.path.isfile(path) and not os.path.islink(path) else None

        def put(path, data):
            if data is None:
                if os.path.lexists(path):
                    os.unlink(path)
                try:
                    os.rmdir(os.path.dirname(path))  # a drop-in directory left empty
                except OSError:
                    pass
            else:
                check_path(os.path.dirname(path), create=True)
                atomic_write(path, data, FILE_MODE)

        def restore():
            for path, old in saved.items():
                if old is None and current(path) is None:
                    continue  # never written (or not ours): nothing to undo
                put(path, old)
            self.run(reload_argv, "daemon-reload")
        for path, data in sorted(want.items(), key=lambda kv: (kv[1] is not None, kv[0])):
            old = current(path)
            if old == data:
                continue
            if not saved:
                undo.append(("unit", restore))
            saved[path] = old
            put(path, data)
        if saved:
            self.run(reload_argv, "daemon-reload")
        return sorted(saved)

    def link(self, target):
        cur = os.path.join(self.root, "current")
        if target is None:
            if os.path.islink(cur):
                os.unlink(cur)
            return
        tmp = os.path.join(self.root, ".current-tmp")
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, cur)

    # ---- services

    def stop(self, argv, insts, spec=None):
        """Stop services; with a drain spec (the release's router), take them out of the router and wait for them
        first. A router that cannot be asked does not stop the stop: their health checks fail within seconds."""
        drain = (spec or {}).get("drain")
        if drain:
            try:
                key = server_secrets.read_api_key(drain["api_key_file"]) if drain.get("api_key_file") else None
                done = drainmod.take_out(drain, dict((i, tuple(v)) for i, v in spec["servers"].items()), key)
                for i in insts:
                    self.ctx.event("drain", instance=i, **done[i])
            except (RuntimeError, server_secrets.SecretsError, OSError) as exc:
                self.ctx.event("note", message="drain-failed", detail=str(exc))
        self.run(argv, "stop", check=False)
        self.ctx.event("stopped", instances=insts)

    def restart_batch(self, batch, release):
        """(Re)start one batch together, then gate each service; records services.json on success."""
        insts = batch["instances"]
        try:  # what the unit's ExecStartPre will check, before anything restarts (apply checked it once already)
            keys = gate_keys(self.a.get("secrets_file"), batch["gates"])
        except Unsafe as exc:  # nothing restarted: the running services keep serving
            keys = None
            results = dict((i, {"ok": False, "step": "secrets", "detail": str(exc), "port": batch["gates"][i]["port"]})
                           for i in insts)
        if keys is not None:
            results = self.restart_gate(batch, keys)
        rec_path = os.path.join(self.sdir, "services.json")
        rec = read_json(rec_path, {})
        for i in insts:
            if results[i]["ok"]:
                rec[i] = {"release": release, "digest": batch["gates"][i].get("digest"), "started": now_iso(),
                          "accept_length": results[i].get("accept_length")}
            self.ctx.event("gate", instance=i, port=batch["gates"][i]["port"], gate=results[i])
        write_json(rec_path, rec)
        return results

    def restart_gate(self, batch, keys):
        """Drain the batch out of the router (when it has one), reset, restart it together (one systemctl), gate
        each service with its address and key, warm it up and put it back into the router."""
        insts = batch["instances"]
        drain = batch.get("drain")
        rkey = server_secrets.read_api_key(drain["api_key_file"]) if drain and drain.get("api_key_file") else None
        drained = {}
        if drain:  # the whole batch out of the router first, then one wait (one deadline) for all of it
            try:
                drained = drainmod.take_out(drain, dict(
                    (i, (batch["gates"][i]["port"], batch["gates"][i].get("address") or "127.0.0.1")) for i in insts),
                    rkey)
            except RuntimeError as exc:  # the router cannot be asked: restarting now would cut requests
                return dict((j, {"ok": False, "step": "drain", "detail": str(exc), "port": batch["gates"][j]["port"]})
                            for j in insts)
            self.out.update(insts)
            self.ctx.progress(out=sorted(self.out, key=lambda s: (len(s), s)))
            for i in insts:
                self.ctx.event("drain", instance=i, **drained[i])
        results = self.restart_only(batch, keys)
        for i in insts if drain else []:
            results[i]["drain"] = drained[i]
            if not results[i].get("ok"):
                continue  # a server that failed its gate stays out of the router
            g = batch["gates"][i]
            results[i]["warmup"] = drainmod.warm_up(g["port"], keys.get(i), g.get("address") or "127.0.0.1")
            back = drainmod.put_back(drain, i, rkey)
            results[i]["router"] = back
            if not back["ok"]:
                results[i].update(ok=False, step="router", detail=back["detail"])
            else:
                self.out.discard(i)
        if drain:
            self.ctx.progress(out=sorted(self.out, key=lambda s: (len(s), s)))
        return results

    def prune(self, spec, keep=()):
        """Take out of the router (drained) every worker the release does not name; say so per worker. A router
        that cannot be asked is a warning here (the restarts' own drain refuses to restart without it)."""
        if not spec:
            return []
        try:
            key = server_secrets.read_api_key(spec["api_key_file"]) if spec.get("api_key_file") else None
            done = drainmod.prune(spec, keep, key)
        except (RuntimeError, server_secrets.SecretsError, OSError) as exc:
            self.ctx.event("note", message="prune-failed", detail=str(exc))
            return []
        for d in done:
            self.ctx.event("stray", **d)
        return done

    def restart_only(self, batch, keys):
        """Reset, restart the batch together (one systemctl), then gate each service with its address and key."""
        insts = batch["instances"]
        self.run(batch["reset_failed"], "reset-failed", check=False)  # a start-limit hit or failed state
        before = unit_states(insts)
        t0 = time.monotonic()
        r = self.run(batch["restart"], "restart", check=False)
        if r["rc"] != 0:
            results = dict((i, {"ok": False, "step": "systemctl", "detail": (r["out"] + r["err"]).strip()[-400:]})
                           for i in insts)
        else:
            results = {}
            for i in insts:
                g = batch["gates"][i]
                # the start timeout the plan derived from the mode and budget (deploy/startup.py), and the canary
                results[i] = gatemod.gate(g["port"], g["expect"], g.get("start_timeout") or self.a["start_timeout"],
                                          self.a["gate_timeout"],
                                          inst=i, restarts_before=int(before[i].get("NRestarts") or 0),
                                          old_invocation=before[i].get("InvocationID", ""),
                                          address=g.get("address") or "127.0.0.1", api_key=keys.get(i),
                                          canary_spec=g.get("canary"))
                results[i]["restart_seconds"] = round(time.monotonic() - t0, 2)
        return results

    def roll(self, batches, release, touched):
        """Restart batch after batch; stops at the first batch with a failing gate (GateFailed)."""
        gates = {}
        for b in batches:
            self.ctx.step("restart " + ",".join(b["instances"]),
                          seconds=(self.a["start_timeout"] + self.a["gate_timeout"] + 30 + 2 * drainmod.ROUTER_WAIT)
                          * len(b["instances"]) + float((b.get("drain") or {}).get("timeout") or 0))
            results = self.restart_batch(b, release)
            gates.update(results)
            touched.extend(b["instances"])
            bad = [i for i in b["instances"] if not results[i].get("ok")]
            if bad:
                raise GateFailed("gate failed on %s: %s" % (", ".join(bad), "; ".join(
                    "%s: %s" % (results[i].get("step"), results[i].get("detail")) for i in bad)), bad)
        return gates

    def rollback(self, spec, touched, failed=()):
        """After a failure past activation: re-activate the previous release, stop what it does not run, restart
        and gate what was touched. Returns {ok, release, seconds, detail}."""
        t0 = time.monotonic()
        prev = spec.get("activate")
        if not prev:
            if touched:
                self.stop(spec["stop"] + [unit(i) for i in touched], touched)
            self.ctx.event("rollback", phase="none", instances=touched)
            return {"ok": False, "release": None, "detail": "no previous release; services stopped",
                    "seconds": round(time.monotonic() - t0, 2)}
        self.ctx.event("rollback", phase="start", release=prev["release"])
        ok, detail = True, ""
        try:
            self.activate(prev)
            if spec.get("router"):
                self.router_up(spec["router"])
            pman = manifest_of(self.root, prev["release"])
            gone = [i for i in touched if i not in pman.get("services", {})]
            if gone:
                self.stop(spec["stop"] + [unit(i) for i in gone], gone)
            # the services that failed their gate first: they are out of the router already, so the others still
            # serve while those come back (restarting a serving one first would leave the router short of two)
            restart = [i for i in touched if i in pman.get("services", {})]
            restart = [i for i in restart if i in failed] + [i for i in restart if i not in failed]
            size = max(1, int(spec.get("max_unavailable") or 1))
            batches = [self.batch(spec, restart[i:i + size]) for i in range(0, len(restart), size)]
            self.roll(batches, prev["release"], [])
            self.prune(spec.get("drain"))  # e.g. the new url of a GPU whose port the failed release changed
        except GateFailed as exc:
            ok, detail = False, str(exc)
        except Exception as exc:
            ok, detail = False, describe(exc)
        res = {"ok": ok, "release": prev["release"], "seconds": round(time.monotonic() - t0, 2), "detail": detail}
        self.ctx.event("rollback", phase="done", **res)
        return res

    @staticmethod
    def batch(spec, insts):
        """A restart batch of the previous release's services, from the command prefixes and the gates the plan
        made (rollout.rollback_spec: the control side builds every gate)."""
        units = [unit(i) for i in insts]
        return {"instances": insts, "reset_failed": spec["reset_failed"] + units, "restart": spec["restart"] + units,
                "gates": dict((i, spec["gates"][i]) for i in insts), "drain": spec.get("drain")}

    def finish(self, journal, failed_release, failed_why):
        append_jsonl(os.path.join(self.sdir, "journal.jsonl"), dict(journal, time=journal.get("time") or now_iso()))
        if failed_release:  # a release that failed its gate is never picked as "the previous one"
            d = os.path.join(self.root, failed_release)
            if os.path.isdir(d) and not os.path.islink(d):
                write_json(os.path.join(d, "FAILED"), {"time": now_iso(), "why": failed_why})
        pruned = []
        keep = int(self.a.get("keep", 5))
        rels = list_releases(self.root)
        protect = {current_release(self.root)} | set(self.a.get("protect") or [])
        for r in rels[:-keep] if len(rels) > keep else []:
            if r not in protect:
                shutil.rmtree(os.path.join(self.root, r), ignore_errors=True)
                pruned.append(r)
        if pruned:
            self.prune_caches()
        return pruned

    def prune_caches(self, root=CACHE_ROOT):
        """JIT caches (render.CACHE_ENV: <root>/gpuN/<payload key>/) of payloads no kept release has."""
        keys = set()
        for r in list_releases(self.root):
            d = (manifest_of(self.root, r) or {}).get("payload_digest")
            if d:
                keys.add(d[:16])
        if not keys or not os.path.isdir(root) or os.path.islink(root):
            return
        for inst in os.listdir(root):
            d = os.path.join(root, inst)
            if os.path.islink(d) or not os.path.isdir(d):
                continue
            for k in os.listdir(d):
                p = os.path.join(d, k)
                if len(k) == 16 and all(c in "0123456789abcdef" for c in k) and k not in keys \
                        and os.path.isdir(p) and not os.path.islink(p):
                    shutil.rmtree(p, ignore_errors=True)


@op("release.apply", mutating=True)
def apply(ctx, a):
    """Run a planned change: stage, activate, stop, restart batches (gated); roll back on any failure after
    activation began; journal the outcome. Returns {ok, error, restarted, gates, rollback, pruned, ...}."""
    h = Host(ctx, a)
    t0 = time.monotonic()
    trusted_dir(h.sdir, create=True)
    cur = current_release(h.root)
    if "expect_current" in a and cur != a["expect_current"]:
        raise Failure("changed", "the host changed since the plan: its current release is %s, the plan saw %s; "
                                 "plan again" % (cur, a["expect_current"]))
    journal = dict(a.get("journal") or {}, token=(ctx.lock or {}).get("token"))
    res = {"ok": True, "restarted": [], "gates": {}, "rolled_back": False, "previous": cur,
           "release": (a.get("activate") or {}).get("release") or cur}
    touched, began, lost = res["restarted"], False, False
    if locks.interrupted(ctx.took_over):  # the lock of a run that died part-way: say so, journal its end
        dead = locks.interrupted(ctx.took_over)
        res["interrupted"] = dead
        ctx.event("interrupted", **dead)
        append_jsonl(os.path.join(h.sdir, "journal.jsonl"), dict(
            event="interrupted", token=dead.get("token"), ok=False, time=now_iso(), by=dead.get("holder"),
            command=dead.get("command"), error="the run died at step %r with %s out of the router; finished by %s" % (
                dead.get("step"), ", ".join(dead.get("out") or []) or "no GPU",
                journal.get("command") or "the next run")))
    try:
        gates = {}
        for b in a.get("batches") or []:
            gates.update(b["gates"])
        try:  # before any change: a restart the unit's own start check would refuse must not begin
            gate_keys(a.get("secrets_file"), gates)
        except Unsafe as exc:
            raise Failure("secrets", "refusing to restart %s: %s; nothing changed" % (
                ", ".join(sorted(gates, key=lambda s: (len(s), s))) or "anything", exc))
        if a.get("stage"):
            ctx.step("stage")
            t = time.monotonic()
            h.stage(a["stage"])
            res["stage_seconds"] = round(time.monotonic() - t, 2)
        if a.get("activate"):
            ctx.step("activate")
            began = True
            act = h.activate(a["activate"])
            res["activate"] = act
            ctx.event("activated", release=act["current"], previous=act["previous"], seconds=act["seconds"],
                      stage_seconds=res.get("stage_seconds"), bundle=(a.get("stage") or {}).get("size"))
        if a.get("router"):  # before any GPU restarts: the drain goes through it
            ctx.step("router", seconds=ROUTER_START + 30)
            res["router"] = h.router_up(a["router"])
        batches = a.get("batches") or []
        if a.get("prune"):  # workers nobody names (a port changed, a run died): out first, drained
            ctx.step("prune", seconds=float(a["prune"].get("timeout") or 0) + 2 * drainmod.ROUTER_WAIT)
            keep = [u for b in batches for u in ((b.get("drain") or {}).get("previous") or {}).values()]
            keep += list(((a.get("stop") or {}).get("drain") or {}).get("workers", {}).values())
            res["pruned_workers"] = h.prune(a["prune"], keep)
        if a.get("stop"):
            ctx.step("stop")
            h.stop(a["stop"]["argv"], a["stop"]["instances"], a["stop"])
        if not batches:
            ctx.event("note", message="nothing-restarted")
        res["gates"] = h.roll(batches, res["release"], touched)
        if a.get("prune"):
            ctx.step("prune", seconds=float(a["prune"].get("timeout") or 0) + 2 * drainmod.ROUTER_WAIT)
            res["pruned_workers"] = (res.get("pruned_workers") or []) + h.prune(a["prune"])
        ctx.step("done")  # a run whose lock was broken while it ran does not report success
    except locks.LockLost as exc:  # someone broke our lock: they own the host now; stop, touch nothing more
        res.update(ok=False, error=str(exc), lock_lost=True)
        lost = True
    except Exception as exc:
        res.update(ok=False, error=str(exc) if isinstance(exc, (GateFailed, ActivationFailed, Failure))
                   else describe(exc))
        if isinstance(exc, GateFailed):
            res["failed"] = exc.failed
        if isinstance(exc, Failure):
            res["kind"] = exc.kind
        # activation undoes itself when it fails; past it, the previous release comes back -- unless the lock
        # was broken meanwhile (a failing gate may be the other run restarting our units): then hands off
        if began and not isinstance(exc, ActivationFailed) and a.get("rollback") is not None:
            try:
                ctx.step("rollback")
                rb = h.rollback(a["rollback"], list(touched), res.get("failed") or ())
                res.update(rollback=rb, rolled_back=rb["ok"])
            except locks.LockLost as lexc:
                res.update(error=res["error"] + "; not rolled back: " + str(lexc), lock_lost=True)
                lost = True
    res["seconds"] = round(time.monotonic() - t0, 2)
    journal.update(restarted=list(touched), seconds=res["seconds"])
    if not res["ok"]:
        journal.update(event=a.get("fail_event") or journal.get("event"), error=res.get("error"))
        if res.get("failed"):
            journal["failed"] = res["failed"]
        if "rollback" in res:
            journal.update(rolled_back_to=res["rollback"].get("release"), rollback_ok=res["rollback"]["ok"],
                           rollback_seconds=res["rollback"].get("seconds"))
    journal["ok"] = res["ok"]
    if lost:
        journal["event"] = "lock-lost"
    staged = (a.get("stage") or {}).get("release")
    res["pruned"] = h.finish(journal, staged if not res["ok"] and staged and a.get("mark_failed", True) else None,
                             res.get("error", ""))
    return res
