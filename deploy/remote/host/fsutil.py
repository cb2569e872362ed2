"""Files the agent reads and writes as root: hashes, JSON, journals, private directories, trusted trees.

Every write goes through a new file created with its final mode (O_EXCL, O_NOFOLLOW) and renamed into place;
every path the agent owns is checked with lstat (loader.check_path). Nothing here follows a symbolic link
that another user could have planted.
"""
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import stat
import time

from .loader import Unsafe, atomic_write, check_path, open_private, read_private  # noqa: F401 (re-exported)

CHUNK = 1 << 20


def sha256_file(path, follow=True):
    """Hex sha256 of a file (O_NOFOLLOW when `follow` is false)."""
    fd = os.open(path, os.O_RDONLY | (0 if follow else os.O_NOFOLLOW))
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def now_iso():
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_json(path, default=None):
    """A JSON file's value; `default` when missing, unreadable or not JSON. Never follows a final symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return default
    try:
        with os.fdopen(fd, "rb") as fh:
            return json.loads(fh.read().decode("utf-8"))
    except ValueError:
        return default


def write_json(path, obj, mode=0o644):
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode(), mode)


def append_jsonl(path, entry, mode=0o644):
    """Append one JSON line under an exclusive flock (concurrent writers never interleave)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, mode)
    with naming(path), os.fdopen(fd, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(json.dumps(entry, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def naming(path):
    """An OSError raised inside names `path` when it names no file: a write's, flush's or fsync's ENOSPC, EDQUOT
    or EIO carries no file name of its own ("[Errno 28] No space left on device" alone says not where)."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or not exc.errno:
            raise
        raise OSError(exc.errno, exc.strerror, path)


def size_text(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return ("%d %s" % (n, unit)) if unit == "B" else ("%.1f %s" % (n, unit))
        n /= 1024.0


def describe(exc):
    """`Type: message` of an exception for an error reply; a full file system also says how much is free where
    it failed (the path is in the message: naming())."""
    text = "%s: %s" % (type(exc).__name__, exc)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT) and exc.filename:
        free = free_bytes(os.path.dirname(str(exc.filename)) or "/")
        if free:
            text += " (%s free on the file system of %s)" % (size_text(free["free"]), free["path"])
    return text


def tail_jsonl(path, n):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return []
    with os.fdopen(fd, "r") as fh:
        lines = fh.readlines()[-n:] if n > 0 else []
    out = []
    for ln in lines:
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass
    return out


def private_dir(*parts):
    """A directory under the agent's private state, created 0700 when missing, checked with lstat."""
    path = os.path.join(*parts)
    check_path(path, private=True, create=True)
    return path


def trusted_dir(path, create=False):
    """A directory root may write into: no symlink on the way, owned by root (or us), not writable by others."""
    check_path(path, private=False, create=create)
    return path


def _trusted_target(path, uid):
    """A symlink's final target: a regular file or directory of root (or ours), not writable by others, in
    trusted directories."""
    real = os.path.realpath(path)
    st = os.lstat(real)
    check_path(real if stat.S_ISDIR(st.st_mode) else os.path.dirname(real), uid=uid)
    if st.st_uid not in (0, uid) or st.st_mode & 0o022:
        raise Unsafe("%s -> %s is writable by others or owned by uid %d" % (path, real, st.st_uid))


def trusted_tree(root):
    """Before root runs code from `root` (a venv): every directory and file in it owned by root (or the running
    user) and not writable by group or others, every symlink's target likewise, and the path to it trusted.
    Returns the number of entries checked; raises Unsafe naming the first offender."""
    uid = os.geteuid()
    check_path(root, uid=uid)
    n = 0
    stack = [root]
    while stack:
        d = stack.pop()
        with os.scandir(d) as it:
            for e in it:
                n += 1
                st = e.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    if st.st_uid not in (0, uid):
                        raise Unsafe("%s is a symbolic link owned by uid %d" % (e.path, st.st_uid))
                    try:
                        _trusted_target(e.path, uid)
                    except FileNotFoundError:
                        pass  # a dangling link runs nothing
                    continue
                if st.st_uid not in (0, uid):
                    raise Unsafe("%s is owned by uid %d" % (e.path, st.st_uid))
                if st.st_mode & 0o022:
                    raise Unsafe("%s is writable by %s" % (e.path, "group" if st.st_mode & 0o020 else "others"))
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
    return n


def free_bytes(path):
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or "/")
        return {"path": path, "free": st.f_bavail * st.f_frsize}
    except OSError:
        return None
