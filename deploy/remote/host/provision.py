"""Provision ops: the reference's wheels (scan, build, send) and a target's overlay (receive, apply, undo).

Everything lives under the agent's private state directory (root-owned, 0700, checked with lstat):
    provision/built/<sha256 of RECORD>/   wheels rebuilt on the reference, with built.json
    provision/incoming/<sha256>/<wheel>   wheels staged on a target (`.part` while arriving)
    provision/backups/<id>/               the wheels and manifest that undo a provision
No path is built from a wheel name that did not match wheels.WHEEL_NAME whole, and no wheel is offered,
staged or installed without its bytes and its RECORD checked: a planted built.json or wheel is never used.
The pip and smoke-import commands come from the control machine as argv (the plan shows them); this side
appends only the verified private paths and the module names it found. The smoke import runs on the reference at
scan time and on the target after install; the target is judged against the reference (importsmoke.judge).
"""
import json
import os
import re
import sys
import time
import zipfile

from . import importsmoke
from . import venv as venvmod
from .fsutil import (Unsafe, check_path, describe, naming, open_private, private_dir, read_json, sha256_file,
                     write_json)
from .proc import run
from .registry import Failure, op
from .wheels import (WheelError, check_wheel, checked_filename, checked_sha256, installed_pth, normalize,
                     parse_wheel_filename, repack, verify_record, wheel_matches_installed, wheel_tags,
                     top_level_modules)

ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9T._-]{0,120}")
PROGRESS_EVERY = 0.25  # seconds between "received" events (progress bars, stall detection)


def _prov(ctx, *sub):
    return private_dir(ctx.state, "provision", *sub)


def _candidate_wheels(dirs):
    out = []
    for base in dirs:
        base = os.path.expanduser(base)
        if not os.path.isdir(base):
            continue
        for root, _dirs, files in os.walk(base):
            for f in files:
                if parse_wheel_filename(f) is not None:
                    out.append(os.path.join(root, f))
    return out


def _source(kind, path):
    return {"kind": kind, "path": path, "sha256": sha256_file(path, follow=False), "size": os.path.getsize(path),
            "filename": os.path.basename(path)}


def _rebuilt(ctx, key, di, pth):
    """A wheel rebuilt earlier from the same RECORD, if it is still exactly the installed files."""
    bdir = os.path.join(ctx.state, "provision", "built", key)
    try:
        check_path(bdir, private=True)
        meta = read_json(os.path.join(bdir, "built.json")) or {}
        whl = os.path.join(bdir, checked_filename(meta.get("filename")))
        os.close(open_private(whl))
    except (OSError, Unsafe, WheelError):
        return None
    if not wheel_matches_installed(whl, di, pth):
        return None
    return _source("rebuilt", whl)


def _installed(wanted, installed, out):
    """(canonical name, request, Dist) for each requested distribution installed; the others are reported in
    `out` as not installed."""
    for want in wanted:
        name = normalize(want["name"])
        d = installed.get(name)
        if d is None:
            out[name] = {"error": "not installed"}
        else:
            yield name, want, d


def _smoke(ctx, argv, mods, cuda, timeout):
    """Run the smoke import of `mods`: (run() result, {module: None or its exception line})."""
    r = run(argv + [json.dumps(mods), "cuda" if cuda else "nocuda"], timeout, merge=False,
            cap=importsmoke.output_cap(mods))
    return r, importsmoke.parse(r["out"], mods, r["rc"], r["timed_out"])


def _reference_smoke(ctx, venv, argv, modules):
    """On the reference: the smoke import of every module of the scanned distributions ({name: [module]}), without
    CUDA and without writing bytecode. Returns {name: {"modules": {module: None or error}}} or, where it could
    not run, {name: {"error": why}}."""
    python = venvmod.python(venv)
    argv = _prefix(argv, python, "smoke")
    mods = sorted(set(m for ms in modules.values() for m in ms))
    if not mods:
        return dict((n, {"modules": {}}) for n in modules)
    try:
        venvmod.check_runnable(venv)
    except (Unsafe, venvmod.VenvError) as exc:
        return dict((n, {"error": "root will not run %s: %s" % (python, exc)}) for n in modules)
    r, got = _smoke(ctx, argv, mods, False, max(30.0, ctx.deadline.left(cap=600, floor=30)))
    if r.get("missing"):
        return dict((n, {"error": "could not run %s: %s" % (python, r["err"])}) for n in modules)
    ctx.event("smoke", modules=len(mods), failed=sum(1 for e in got.values() if e is not None),
              seconds=r.get("seconds"))
    return dict((n, {"modules": dict((m, got[m]) for m in ms), "seconds": r.get("seconds")})
                for n, ms in modules.items())


@op("provision.scan")
def scan(ctx, a):
    """On the reference: per distribution, drift against RECORD, size, tags, the .pth files it installs, and a
    wheel that is exactly its installed files (an original from a wheelhouse or pip's cache, or one rebuilt
    earlier), if any. With `commands.smoke`, also its top-level modules and whether each imports here (`smoke`):
    what a target is held to after it installs the same wheels."""
    venv = a["venv"]
    lay = venvmod.layout(venv)
    site = lay["purelib"]
    candidates = _candidate_wheels(list(a.get("wheelhouse") or []) + ["~/.cache/pip/wheels"])
    smoke_argv = (a.get("commands") or {}).get("smoke")
    out = {}
    modules = {}
    for name, want, d in _installed(a["dists"], venvmod.index(site), out):
        di = d.path
        info = {"version": d.version, "dist_info": di}
        if smoke_argv is not None:
            modules[name] = top_level_modules(di)
        if want.get("version") and d.version != want["version"]:
            info["error"] = "installed version %s, expected %s" % (d.version, want["version"])
        drift, size = verify_record(di, lay)
        pth = installed_pth(di)
        info.update(drift=drift, installed_bytes=size, tags=wheel_tags(d.read_text("WHEEL")), pth=pth,
                    record_sha256=sha256_file(os.path.join(di, "RECORD")))
        source = None
        if not drift:
            for whl in candidates:
                if parse_wheel_filename(os.path.basename(whl)) == (name, d.version):
                    try:
                        if wheel_matches_installed(whl, di, pth):
                            source = _source("original", whl)
                            break
                    except (OSError, zipfile.BadZipFile, ValueError):
                        continue
            if source is None:
                source = _rebuilt(ctx, info["record_sha256"], di, pth)
        info["source"] = source
        out[name] = info
    if smoke_argv is not None:
        for name, sm in _reference_smoke(ctx, venv, smoke_argv, modules).items():
            out[name]["smoke"] = sm
    return {"dists": out}


@op("provision.build", mutating=True)
def build(ctx, a):
    """On the reference: rebuild wheels from installed distributions into the private built directory."""
    lay = venvmod.layout(a["venv"])
    out = {}
    for name, _want, d in _installed(a["dists"], venvmod.index(lay["purelib"]), out):
        ctx.step("build " + name)
        di = d.path
        key = sha256_file(os.path.join(di, "RECORD"))
        bdir = _prov(ctx, "built", key)
        r = repack(di, bdir, lay)
        r.update(kind="rebuilt", pth=installed_pth(di))
        if not r["drift"]:  # drifted builds are not reusable by RECORD key
            write_json(os.path.join(bdir, "built.json"),
                       {"filename": r["filename"], "sha256": r["sha256"], "size": r["size"]}, mode=0o600)
        out[name] = r
        ctx.event("built", name=name, filename=r["filename"], size=r["size"])
    return {"dists": out}


@op("provision.send", raw=True)
def send(ctx, a):
    """Stream wheels (paths the scan or build named) to stdout one after the other, each from its `offset`: raw
    bytes with sendfile(2), no envelope; the client knows each size. Every file is checked before the first byte."""
    fds = []
    try:
        for f in a["files"]:
            checked_filename(os.path.basename(f["path"]))
            fd = os.open(f["path"], os.O_RDONLY | os.O_NOFOLLOW)
            fds.append((fd, int(f.get("offset") or 0), os.fstat(fd).st_size))
        sys.stdout.flush()
        out = sys.stdout.fileno()  # the data channel; envelopes of a raw op go to stderr
        big_pipe(out)
        sent = 0
        for fd, offset, size in fds:
            while offset < size:
                n = os.sendfile(out, fd, offset, min(size - offset, 64 << 20))
                if n == 0:
                    break
                offset += n
                sent += n
    finally:
        for fd, _o, _s in fds:
            os.close(fd)
    return {"sent": sent}


def big_pipe(fd, size=1 << 20):
    """A 1 MiB pipe buffer where `fd` is a pipe (64 KiB by default): a quarter of the context switches between
    sshd and the agent, about a third more throughput on the lab's links (measured: 250 -> 330 MB/s)."""
    try:
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), size)
    except OSError:
        pass


def _incoming(ctx, sha, filename):
    return os.path.join(_prov(ctx, "incoming", checked_sha256(sha)), checked_filename(filename))


def _receive_one(ctx, w, note):
    """One wheel from stdin into its private `.part` (appended at `offset`, hashed as it comes); renamed into
    place when complete with the right sha256, deleted when the sha256 is wrong."""
    import hashlib
    sha, size, offset = w["sha256"], int(w["size"]), int(w.get("offset") or 0)
    final = _incoming(ctx, sha, w["filename"])
    part = final + ".part"
    h = hashlib.sha256()
    if offset:
        fd = open_private(part, os.O_RDWR)
        have = os.fstat(fd).st_size
        if have != offset:
            os.close(fd)
            return {"status": "offset-mismatch", "have": have}
        with os.fdopen(os.dup(fd), "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        os.lseek(fd, offset, os.SEEK_SET)
    else:
        fd = open_private(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    got = offset
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    try:
        while got < size:
            n = ctx.stdin.readinto(view[:min(len(buf), size - got)])
            if not n:
                break
            h.update(view[:n])
            w_ = 0
            with naming(part):
                while w_ < n:
                    w_ += os.write(fd, view[w_:n])
            got += n
            note(n)
    finally:
        os.close(fd)
    if got < size:
        return {"status": "partial", "have": got}
    if h.hexdigest() != sha:
        os.unlink(part)
        return {"status": "bad-hash", "have": got}
    os.rename(part, final)
    return {"status": "ok", "received": got - offset}


@op("provision.receive", mutating=True)
def receive(ctx, a):
    """On a target: the listed wheels arrive on stdin one after the other (each from its `offset`, continuing an
    earlier partial upload) into the private staging directory. Every name and sha256 is checked before the first
    byte is read. Progress events carry the bytes received so far; the lock is renewed as they come."""
    wheels = a["wheels"]
    for w in wheels:
        checked_sha256(w["sha256"])
        checked_filename(w["filename"])
    big_pipe(0)
    out = {}
    total = [0, 0.0, time.monotonic()]  # bytes, last event (0: the first block reports at once), last lock renewal

    def note(n):
        total[0] += n
        now = time.monotonic()
        if now - total[1] >= PROGRESS_EVERY:
            ctx.event("received", bytes=total[0])
            total[1] = now
        if now - total[2] >= 30:
            ctx.step("receive")
            total[2] = now
    for w in wheels:
        r = _receive_one(ctx, w, note)
        out[w["sha256"]] = r
        if r["status"] == "partial":
            break  # the stream ended: what is missing arrives with the next run, from where it stopped
    ctx.event("received", bytes=total[0])
    return {"wheels": out}


# ---------------------------------------------------------------- apply / undo


def _verified(ctx, w, allow_pth):
    """The private staged copy of wheel `w`, its sha256 and RECORD checked now, just before install."""
    path = _incoming(ctx, w["sha256"], w["filename"])
    if not os.path.lexists(path):
        raise Failure("not-staged", "staged wheel %s is missing; nothing changed" % w["filename"])
    if sha256_file(path, follow=False) != w["sha256"]:
        raise Failure("bad-wheel", "staged wheel %s fails its sha256 check; nothing changed" % w["filename"])
    try:
        check_wheel(path, allow_pth)
    except WheelError as exc:
        raise Failure("bad-wheel", "staged wheel refused: %s; nothing changed" % exc)
    return path


def _prefix(argv, python, what):
    """A command prefix from the control machine: it must run this venv's python."""
    if not isinstance(argv, list) or not argv or argv[0] != python:
        raise Failure("bad-command", "%s must run %s, got %r" % (what, python, argv))
    return list(argv)


def _run_step(ctx, steps, step, argv, timeout=None, r=None):
    """Run `argv` (or record `r`, a run() result already had) as one step of the apply."""
    if r is None:
        r = run(argv, timeout if timeout is not None else max(30.0, ctx.deadline.left(cap=3600, floor=30)))
        output = r["out"] + r["err"]
    else:
        output = r["err"]  # the smoke import: stdout is its report (in the result), stderr what the modules said
    steps.append({"step": step, "argv": argv[:3] + (["..."] if len(argv) > 3 else []), "rc": r["rc"],
                  "output": output[-6000:], "seconds": r.get("seconds")})
    ctx.event("step", step=step, rc=r["rc"], seconds=r.get("seconds"))
    return r


def _backup(ctx, pid, python, names, lay, commands):
    """Keep the current versions of `names` as wheels rebuilt from their RECORD (stored uncompressed)."""
    bdir = _prov(ctx, "backups", pid)
    installed = venvmod.index(lay["purelib"])
    before = venvmod.installed_versions(None, names, installed)
    wheels = {}
    for n in sorted(names):
        if before.get(n) is None:
            continue
        di = installed[normalize(n)].path
        r = repack(di, bdir, lay, compression=zipfile.ZIP_STORED)
        wheels[n] = {"filename": r["filename"], "sha256": r["sha256"], "size": r["size"], "drift": r["drift"],
                     "pth": installed_pth(di)}
    manifest = {"id": pid, "created": time.time(), "python": python, "before": before, "wheels": wheels,
                "status": "backed-up", "commands": commands}
    write_json(os.path.join(bdir, "manifest.json"), manifest, mode=0o600)
    return bdir, manifest


def _restore(ctx, bdir, manifest, steps, lay, commands):
    """Bring every distribution in the manifest back to its `before` version."""
    site = lay["purelib"]
    before = manifest["before"]
    installed = venvmod.index(site)
    now = venvmod.installed_versions(None, before, installed)
    remove = sorted(n for n, v in before.items() if v is None and now.get(n) is not None)
    if remove:
        _run_step(ctx, steps, "restore-uninstall", commands["pip_uninstall"] + remove)
    reinstall = sorted(n for n, v in before.items() if v is not None and now.get(n) != v)
    # pip rolls a failed distribution back to its old files; check that rather than trust it
    for n, v in sorted(before.items()):
        if v is None or n in reinstall or now.get(n) != v:
            continue
        d = installed.get(n)
        drift, _size = verify_record(d.path, lay) if d is not None else ([1], 0)
        if drift and not manifest["wheels"][n].get("drift"):
            reinstall.append(n)
    if reinstall:
        wheels = []
        for n in reinstall:
            w = manifest["wheels"][n]
            path = os.path.join(bdir, checked_filename(w["filename"]))
            if sha256_file(path, follow=False) != w["sha256"]:
                raise RuntimeError("backup wheel %s fails its sha256 check" % path)
            wheels.append(path)
        _run_step(ctx, steps, "restore-install", commands["pip_install"] + wheels)
    after = venvmod.installed_versions(site, before)
    return {n: (before[n], after[n]) for n in before if after[n] != before[n]}


def _commands(a, python):
    c = a.get("commands") or {}
    return {"pip_install": _prefix(c.get("pip_install"), python, "pip_install"),
            "pip_uninstall": _prefix(c.get("pip_uninstall"), python, "pip_uninstall"),
            "smoke": _prefix(c.get("smoke"), python, "smoke")}


@op("provision.apply", mutating=True)
def apply(ctx, a):
    """Verify the staged wheels and the venv, back up, install, remove extras, smoke-import; restore the backup
    on any failure. Nothing changes before every check has passed. The smoke import is judged against the
    reference's (`reference_smoke`: {module: None or its error there}): a module failing here that imports there
    fails the apply; one failing on both is a warning in the result."""
    venv = a["venv"]
    python = venvmod.python(venv)
    pid = a["id"]
    if not ID.fullmatch(pid or ""):
        raise Failure("bad-request", "bad provision id %r" % pid)
    try:
        reference_smoke = importsmoke.checked_reference(a.get("reference_smoke"))
    except ValueError as exc:
        raise Failure("bad-request", "%s; nothing changed" % exc)
    commands = _commands(a, python)
    lay = venvmod.layout(venv)
    install, remove = a.get("install") or [], [normalize(n) for n in a.get("remove") or []]
    names = sorted({normalize(w["name"]) for w in install} | set(remove))
    steps = []
    result = {"id": pid, "steps": steps, "ok": False, "warnings": []}
    ctx.step("verify")
    allow = a.get("allow_pth") or {}
    paths = [_verified(ctx, w, allow.get(normalize(w["name"])) or ()) for w in install]
    try:
        result["venv_entries_checked"] = venvmod.check_runnable(venv)
    except (Unsafe, venvmod.VenvError) as exc:
        raise Failure("unsafe-venv", "refusing to run %s as root: %s; nothing changed" % (python, exc))
    ctx.step("backup")
    bdir, manifest = _backup(ctx, pid, python, names, lay, commands)
    manifest["plan"] = {"install": [w["filename"] for w in install], "remove": remove}
    result["backup"] = bdir
    failure = None
    try:
        if install:
            ctx.step("install")
            r = _run_step(ctx, steps, "install", commands["pip_install"] + paths)
            if r["rc"] != 0:
                failure = "pip install failed (exit %s)" % r["rc"]
        if failure is None and remove:
            ctx.step("remove-extra")
            r = _run_step(ctx, steps, "remove-extra", commands["pip_uninstall"] + remove)
            if r["rc"] != 0:
                failure = "pip uninstall failed (exit %s)" % r["rc"]
        if failure is None:
            installed = venvmod.index(lay["purelib"])
            now = venvmod.installed_versions(None, names, installed)
            want = dict((normalize(w["name"]), w["version"]) for w in install)
            want.update((n, None) for n in remove)
            off = dict((n, (v, now.get(n))) for n, v in want.items() if now.get(n) != v)
            if off:
                failure = "after pip, versions differ from the plan: %s" % off
        if failure is None and a.get("smoke", True):
            mods = set()
            for w in install:
                d = installed.get(normalize(w["name"]))
                if d is not None:
                    mods.update(top_level_modules(d.path))
            result["smoke_modules"] = sorted(mods)
            if mods:
                ctx.step("smoke")
                cuda = bool(a.get("cuda_init")) and "torch" in mods and os.path.exists("/dev/nvidiactl")
                r, got = _smoke(ctx, commands["smoke"], sorted(mods), cuda, 600)
                _run_step(ctx, steps, "smoke", commands["smoke"], r=r)
                steps[-1]["cuda_init"] = cuda
                verdict = importsmoke.judge(got, reference_smoke)
                result["smoke"] = verdict
                result["warnings"] += importsmoke.warnings(verdict)
                failure = importsmoke.failure(verdict)
                if failure is None and r["rc"] != 0:
                    failure = ("smoke import failed (exit %s)" % r["rc"]) + (" at CUDA init" if cuda else "")
    except Exception as exc:  # restore below, whatever went wrong (a lost lock included)
        failure = describe(exc)
    if failure is None:
        manifest.update(status="applied", after=now)  # nothing installs between the version check and here
        write_json(os.path.join(bdir, "manifest.json"), manifest, mode=0o600)
        result.update(ok=True, after=manifest["after"])
        return result
    result["error"] = failure
    wrong = _restore(ctx, bdir, manifest, steps, lay, commands)
    manifest["status"] = "restored-after-failure" if not wrong else "restore-incomplete"
    write_json(os.path.join(bdir, "manifest.json"), manifest, mode=0o600)
    result["restored"] = not wrong
    if wrong:
        result["restore_error"] = "still differs after restore: %s" % wrong
    return result


def _backups(ctx):
    base = os.path.join(ctx.state, "provision", "backups")
    out = []
    if os.path.isdir(base) and not os.path.islink(base):
        for pid in sorted(os.listdir(base)):
            m = read_json(os.path.join(base, pid, "manifest.json"))
            if isinstance(m, dict) and m.get("id") == pid:
                out.append(m)
    out.sort(key=lambda m: m.get("created", 0))
    return out


@op("provision.undo", mutating=True)
def undo(ctx, a):
    """Restore the latest applied provision (or `id`) from its backup wheels."""
    venv = a["venv"]
    python = venvmod.python(venv)
    commands = _commands(a, python)
    ms = [m for m in _backups(ctx) if m.get("status") == "applied" and (not a.get("id") or m["id"] == a["id"])]
    if not ms:
        return {"ok": False, "error": "no applied provision to undo under %s/provision/backups" % ctx.state}
    try:
        venvmod.check_runnable(venv)
    except (Unsafe, venvmod.VenvError) as exc:
        raise Failure("unsafe-venv", "refusing to run %s as root: %s; nothing changed" % (python, exc))
    m = ms[-1]
    bdir = _prov(ctx, "backups", m["id"])
    steps = []
    ctx.step("undo")
    wrong = _restore(ctx, bdir, m, steps, venvmod.layout(venv), commands)
    m.update(status="undone" if not wrong else "undo-incomplete", undone_at=time.time())
    write_json(os.path.join(bdir, "manifest.json"), m, mode=0o600)
    return {"ok": not wrong, "id": m["id"], "before": m["before"], "steps": steps,
            "error": ("still differs after undo: %s" % wrong) if wrong else None}


@op("provision.backups")
def backups(ctx, a):
    return {"backups": _backups(ctx)}
