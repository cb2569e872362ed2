"""A host's release directory: where releases live, which one is active, how a bundle arrives, and what is kept.

Host layout, under state_dir (the parent of release_root, from the inventory):

    releases/<id>/{manifest.json, wheels/, systemd/ (unit, per-GPU drop-ins), env/gpuN.env (0600 root),
                   bin/ (wait_ready.py, server_secrets.py), site/ (log redactor), labserver/, overlays/}
    releases/current -> <id>          the active release (switched atomically)
    journal.jsonl                     audit journal: one JSON line per run, with its token
    services.json                     per GPU: release and digest it was last started with

No secret is in a release: the secrets env file and the API-key file stay where the operator keeps them
(root-only 0600); the unit reads them (EnvironmentFile=, LoadCredential=).
"""
import hashlib
import io
import os
import shutil
import tarfile

from . import contract
from .fsutil import append_jsonl, check_path, naming, now_iso, read_json, sha256_file, trusted_dir, write_json
from .proc import run
from .wheels import WheelError, check_wheel

ENV_MODE = 0o600       # env files: root only, from creation (systemd reads them as root)
FILE_MODE = 0o644
CACHE_ROOT = contract.JIT_CACHE_ROOT  # the GPU unit's CacheDirectory= parent (render.CACHE_ROOT)


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


def stage(h, spec):
    """Read the bundle from stdin, check every member and sha256, write it into root/.incoming-<id> with
    each file's final mode from creation (env files 0600), then rename it to root/<id>."""
    rid, size = spec["release"], int(spec["size"])
    data = h.ctx.stdin.read(size)
    if len(data) != size or hashlib.sha256(data).hexdigest() != spec["sha256"]:
        raise RuntimeError("the release bundle arrived damaged (%d of %d bytes)" % (len(data), size))
    trusted_dir(h.root, create=True)
    tmp = os.path.join(h.root, ".incoming-%s" % rid)
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
        dest = os.path.join(h.root, rid)
        if os.path.lexists(dest):
            shutil.rmtree(dest)
        os.rename(tmp, dest)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    user = spec.get("user")
    if user and run(["id", "-u", user["name"]], 30)["rc"] != 0:
        h.run(user["useradd"], "useradd")
    return man


def verify_release(root, rid, man):
    """Before activating release `rid`: every file still has its recorded sha256 and the plugin wheel passes the
    wheel checks."""
    tdir = os.path.join(root, rid)
    check_path(tdir)
    for rel, sha in man["files"].items():
        if sha256_file(os.path.join(tdir, rel), follow=False) != sha:
            raise RuntimeError("release %s: %s no longer has its recorded sha256" % (rid, rel))
    wheel = os.path.join(tdir, man["plugin"]["wheel"])
    try:
        check_wheel(wheel)
    except WheelError as exc:
        raise RuntimeError("release %s: plugin wheel refused: %s" % (rid, exc))


def link(root, target):
    """Point `current` at `target` atomically (or remove it for None)."""
    cur = os.path.join(root, "current")
    if target is None:
        if os.path.islink(cur):
            os.unlink(cur)
        return
    tmp = os.path.join(root, ".current-tmp")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, cur)


def finish(h, journal, failed_release, failed_why):
    """The end of every apply: the run's journal line, FAILED in a release that failed, and only the newest
    `keep` releases kept (the current one and those `protect` names always). Returns the releases removed."""
    append_jsonl(os.path.join(h.sdir, "journal.jsonl"), dict(journal, time=journal.get("time") or now_iso()))
    if failed_release:  # a release that failed its gate is never picked as "the previous one"
        d = os.path.join(h.root, failed_release)
        if os.path.isdir(d) and not os.path.islink(d):
            write_json(os.path.join(d, "FAILED"), {"time": now_iso(), "why": failed_why})
    pruned = []
    keep = int(h.a.get("keep", 5))
    rels = list_releases(h.root)
    protect = {current_release(h.root)} | set(h.a.get("protect") or [])
    for r in rels[:-keep] if len(rels) > keep else []:
        if r not in protect:
            shutil.rmtree(os.path.join(h.root, r), ignore_errors=True)
            pruned.append(r)
    if pruned:
        prune_caches(h.root)
    return pruned


def prune_caches(releases, cache_root=CACHE_ROOT):
    """JIT caches (render.CACHE_ENV: <cache_root>/gpuN/<payload key>/) of payloads no release under `releases`
    has."""
    keys = set()
    for r in list_releases(releases):
        d = (manifest_of(releases, r) or {}).get("payload_digest")
        if d:
            keys.add(d[:16])
    if not keys or not os.path.isdir(cache_root) or os.path.islink(cache_root):
        return
    for inst in os.listdir(cache_root):
        d = os.path.join(cache_root, inst)
        if os.path.islink(d) or not os.path.isdir(d):
            continue
        for k in os.listdir(d):
            p = os.path.join(d, k)
            if len(k) == 16 and all(c in "0123456789abcdef" for c in k) and k not in keys \
                    and os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
