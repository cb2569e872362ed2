"""The JIT caches of the transient bench and smoke servers: a per-GPU copy of the GPU's service caches.

A deployed service keeps its kernels under its unit's CacheDirectory, <JIT_CACHE_ROOT>/<instance>/<payload key>/
(the contract's JIT_CACHE_ENV folders: Triton, FlashInfer, SGLang's, DeepGEMM's, inductor's). A transient server
started with empty caches compiles them all again (minutes for a tree-verify server's CUDA graphs). `seed` copies
the service's folder of the active payload into the transient servers' cache directory,
/var/cache/<TRANSIENT_CACHE>/<instance>/<payload key>/, and `env` points the servers' cache variables at it.

The copy reads the service's files and never changes them: regular files only (symlinks, devices and the like are
skipped), each opened without following links and written as a new file (never a link), files already there kept
(the caches are content-addressed: a file of the same name is the same kernel). The whole copy runs in a child
process as the service user (its own files on both sides: root writes nothing into a directory another user owns),
bounded by a size cap (the service's folder larger than it: not copied, a warning) and a deadline. The transient
directory is kept between runs, so a later bench starts warm even where the service has no caches; other payloads'
folders in it are removed.
"""
import json
import os
import pwd
import re
import select
import shutil
import signal
import stat
import time

from . import contract

SERVICE_ROOT = contract.JIT_CACHE_ROOT
TRANSIENT_ROOT = "/var/cache/" + contract.TRANSIENT_CACHE
CAP_BYTES = 8 << 30  # a service's folder larger than this is not copied (the servers start cold)
DEADLINE_S = 180.0  # the most the copy may take (what is copied by then stays; the servers start part-warm)
INSTANCE_RE = re.compile(r"gpu[0-9]{1,2}\Z")  # inventory.Service.instance: gpu<first GPU>
KEY_RE = re.compile(r"[0-9a-f]{16}\Z")  # render.cache_dirs: the payload digest's first 16 hex digits
CHUNK = 1 << 20


def check(instance, key):
    """The op's `instance` and `cache_key` arguments (both null: no service, the servers start cold); returns
    None or the problem."""
    if instance is None and key is None:
        return None
    if not (isinstance(instance, str) and INSTANCE_RE.match(instance)):
        return "instance must be gpuN"
    if not (isinstance(key, str) and KEY_RE.match(key)):
        return "cache_key must be 16 hex digits (the active payload's key)"
    return None


def paths(instance, key, service_root=None, transient_root=None):
    """(the service's payload folder, the transient servers' one)."""
    return (os.path.join(service_root or SERVICE_ROOT, instance, key),
            os.path.join(transient_root or TRANSIENT_ROOT, instance, key))


def env(dest):
    """The transient servers' cache variables under `dest` (the contract's names and folders, XDG's too)."""
    return {k: os.path.join(dest, d) for k, d in contract.JIT_CACHE_ENV + (contract.XDG_CACHE_ENV,)}


def tree_bytes(top, stop_at=None):
    """Bytes of the regular files under `top` (links not followed); stops counting past `stop_at`."""
    total = 0
    if not os.path.isdir(top) or os.path.islink(top):
        return 0
    for _root, _dirs, files, dfd in os.fwalk(top, follow_symlinks=False):
        for f in files:
            try:
                st = os.stat(f, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_size
        if stop_at is not None and total > stop_at:
            break
    return total


def _copy_file(sfd, name, ddfd):
    """Copy regular file `name` from directory fd `sfd` into `ddfd` as a new file; bytes copied (None: skipped,
    not a regular file)."""
    try:
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=sfd)
    except OSError:
        return None
    try:
        st = os.fstat(src)
        if not stat.S_ISREG(st.st_mode):
            return None
        tmp = ".%s.seed-%d" % (name, os.getpid())
        out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=ddfd)
        n = 0
        try:
            while True:
                b = os.read(src, CHUNK)
                if not b:
                    break
                os.write(out, b)
                n += len(b)
            os.fchmod(out, stat.S_IMODE(st.st_mode) & 0o755 | 0o600)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
        os.rename(tmp, name, src_dir_fd=ddfd, dst_dir_fd=ddfd)
        return n
    finally:
        os.close(src)


def _open_dir(name, dfd, create):
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dfd)
        except FileExistsError:
            pass
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dfd)


def copy_tree(src, dest, until):
    """Copy the regular files under `src` missing under `dest` (directories made 0700); (bytes, files, done)."""
    copied = files = 0
    top = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for root, _dirs, names, sfd in os.fwalk(src, follow_symlinks=False):
            rel = os.path.relpath(root, src)
            fds = [os.dup(top)]
            try:
                for part in ([] if rel == "." else rel.split(os.sep)):
                    fds.append(_open_dir(part, fds[-1], True))
                have = set(os.listdir(fds[-1]))
                for name in names:
                    if time.monotonic() > until:
                        return copied, files, False
                    if name not in have:
                        n = _copy_file(sfd, name, fds[-1])
                        if n is not None:
                            copied, files = copied + n, files + 1
            finally:
                for fd in fds:
                    os.close(fd)
    finally:
        os.close(top)
    return copied, files, True


def _seed_child(src, dest, cap, until):
    """The copy, in the (unprivileged) child: a result dict."""
    inst_dir = os.path.dirname(dest)
    os.makedirs(dest, mode=0o700, exist_ok=True)
    for d in (inst_dir, dest):
        st = os.lstat(d)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            return {"state": "cold", "warning": "%s is not a directory of the server's user: not used" % d}
        os.chmod(d, 0o700)
    for other in os.listdir(inst_dir):  # other payloads' kernels: never used again by this payload's servers
        p = os.path.join(inst_dir, other)
        if other != os.path.basename(dest) and KEY_RE.match(other) and not os.path.islink(p) and os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
    for d in env(dest).values():
        os.makedirs(d, mode=0o700, exist_ok=True)
    out = {"source": src, "seeded_mib": 0}
    if not os.path.isdir(src) or os.path.islink(src):
        out["note"] = "the service has no JIT caches for this payload"
    else:
        size = tree_bytes(src, stop_at=cap)
        if size > cap:
            out["warning"] = ("the service's JIT caches (%s) are larger than %d MiB: not copied"
                              % (src, cap >> 20))
        else:
            copied, files, done = copy_tree(src, dest, until)
            out.update(seeded_mib=round(copied / 2 ** 20, 1), seeded_files=files)
            if not done:
                out["warning"] = "copying the service's JIT caches ran past its deadline: a part was copied"
    have = tree_bytes(dest)
    out.update(cache_mib=round(have / 2 ** 20, 1), state="warm" if have else "cold")
    return out


def _drop_to(user):
    pw = pwd.getpwnam(user)
    os.setgroups([])
    os.setgid(pw.pw_gid)
    os.setuid(pw.pw_uid)


def seed(instance, key, user=None, cap=CAP_BYTES, deadline_s=DEADLINE_S, service_root=None, transient_root=None):
    """Seed the transient servers' caches of `instance` from the service's folder of payload `key`, as `user`
    (root drops to it; None: as this process's user). Returns (the cache variables for the servers or {}, a
    result dict: state warm|cold, cache_mib, seeded_mib, source, warning/note)."""
    if instance is None:
        return {}, {"state": "cold", "note": "no service on this GPU: the servers start with empty JIT caches"}
    src, dest = paths(instance, key, service_root, transient_root)
    transient_root = os.path.dirname(os.path.dirname(dest))
    try:
        st = os.lstat(transient_root)
    except FileNotFoundError:
        os.makedirs(transient_root, mode=0o755, exist_ok=True)
        if user and os.geteuid() == 0:
            pw = pwd.getpwnam(user)
            os.chown(transient_root, pw.pw_uid, pw.pw_gid)
        st = os.lstat(transient_root)
    if not stat.S_ISDIR(st.st_mode):
        return {}, {"state": "cold", "warning": "%s is not a directory: the servers start cold" % transient_root}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the service user's, writes its result to the pipe and exits
        code = 0
        try:
            os.close(r)
            if user and os.geteuid() == 0:
                _drop_to(user)
            res = _seed_child(src, dest, cap, time.monotonic() + deadline_s)
        except Exception as exc:  # noqa: BLE001 - reported, the servers then start cold
            res, code = {"state": "cold", "warning": "seeding the JIT caches failed: %s" % exc}, 1
        try:
            os.write(w, json.dumps(res).encode())
        finally:
            os._exit(code)
    os.close(w)
    chunks, until = [], time.monotonic() + deadline_s + 30
    try:
        while True:
            left = until - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                break
            ready, _w, _x = select.select([r], [], [], left)
            if not ready:
                continue
            b = os.read(r, 65536)
            if not b:
                break
            chunks.append(b)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    try:
        res = json.loads(b"".join(chunks).decode())
    except ValueError:
        res = {"state": "cold", "warning": "seeding the JIT caches did not finish: the servers start cold"}
    if not os.path.isdir(env(dest)["TRITON_CACHE_DIR"]):
        return {}, res
    return env(dest), res


def line(res):
    """One line for the operator: how the run's servers start."""
    if res.get("state") == "warm":
        s = "warm: %s MiB of JIT caches" % res.get("cache_mib")
        if res.get("seeded_files"):
            s += " (%s MiB in %d files seeded from %s)" % (res.get("seeded_mib"), res["seeded_files"],
                                                        res.get("source"))
        else:
            s += " (kept from an earlier run)"
    else:
        s = "cold: empty JIT caches"
    return s + "".join("; %s" % res[k] for k in ("note", "warning") if res.get(k))
