"""The loader: the one small program that travels in argv (`python3 -I -S -c LOADER STATE_DIR SHA256 [REQUEST]`).

It checks the agent's state directory with lstat (every component a real directory, never a symbolic link,
owned by root or by the running user, not replaceable by others; the directory itself mode 0700 and ours),
creates it when missing, then runs the agent whose zipapp `agent-<SHA256>.pyz` is held there. When the host
does not hold that zipapp, it answers with a "ship" line; the client then sends the zipapp's bytes after the
request on stdin, and the loader checks their sha256 and stores them (0600, atomically). A zipapp is unpacked
once, after its hash was checked, into the private directory `agent-<SHA256>/` and run from there, so Python
keeps compiled bytecode beside it (a zip import compiles every module on every call: ~30 ms a call).

The request is the first line of stdin, or argv's last word (bulk transfers keep stdin for the data).
The agent imports this module for the same checks and writes: there is one copy of them.
"""
import hashlib
import json
import os
import stat
import sys

MARK = "@@DDTREE@@ "
PACKAGE = "ddtree_agent"


class Unsafe(Exception):
    """A path the agent refuses to use: a symbolic link, a foreign owner, writable by others."""


def check_path(path, private=False, create=False, uid=None):
    """lstat every component of the absolute `path`; create missing ones when `create` (0755, the last 0700
    when `private`). Each must be a directory that is no symbolic link, owned by root or `uid`, and whose
    parent others cannot write (a sticky parent is fine when the entry is ours). A private directory must be
    ours with mode 0700; any other must not be writable by group or others. Returns the last lstat."""
    uid = os.geteuid() if uid is None else uid
    if not path.startswith("/"):
        raise Unsafe("%s: not an absolute path" % path)
    names = [n for n in path.split("/") if n]
    cur, st = "/", os.lstat("/")
    for i, name in enumerate(names):
        if name in (".", ".."):
            raise Unsafe("%s: '.' or '..' in the path" % path)
        parent, nxt = st, os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(nxt, 0o700 if private and i == len(names) - 1 else 0o755)
            except FileExistsError:
                pass
            st = os.lstat(nxt)
        if stat.S_ISLNK(st.st_mode):
            raise Unsafe("%s is a symbolic link" % nxt)
        if not stat.S_ISDIR(st.st_mode):
            raise Unsafe("%s is not a directory" % nxt)
        if st.st_uid not in (0, uid):
            raise Unsafe("%s is owned by uid %d, not by root or uid %d" % (nxt, st.st_uid, uid))
        if parent.st_mode & 0o022 and not (parent.st_mode & stat.S_ISVTX):
            raise Unsafe("%s is writable by group or others" % cur)
        cur = nxt
    if private and (st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700):
        raise Unsafe("%s must be a 0700 directory owned by uid %d (it is %04o, uid %d)"
                     % (path, uid, stat.S_IMODE(st.st_mode), st.st_uid))
    if not private and st.st_mode & 0o022:
        raise Unsafe("%s is writable by group or others" % path)
    return st


def open_private(path, flags=os.O_RDONLY, mode=0o600):
    """os.open with O_NOFOLLOW; a file that exists must be a regular file of ours not writable by others."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symbolic link
            raise Unsafe("%s is a symbolic link" % path)
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        os.close(fd)
        raise Unsafe("%s is not a regular file of ours that only we can write" % path)
    return fd


def read_private(path):
    """The bytes of a file opened with open_private; None when it does not exist."""
    try:
        fd = open_private(path)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def atomic_write(path, data, mode=0o600):
    """Write `data` to a new temporary file beside `path` (O_EXCL, O_NOFOLLOW, `mode` from creation), fsync it
    and rename it over `path`: readers see the old or the new content, never a part, never a wider mode."""
    tmp = "%s.tmp-%d" % (path, os.getpid())
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)  # the umask never widens it, and never narrows what was asked
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # a write's ENOSPC names no file: say which
        if exc.filename is None and exc.errno:
            raise OSError(exc.errno, exc.strerror, path)
        raise
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def reply(obj, raw=False):
    out = sys.stderr if raw else sys.stdout  # a raw op's stdout carries only data
    out.write("\n" + MARK + json.dumps(obj, sort_keys=True) + "\n")
    out.flush()


def read_exactly(stream, n):
    chunks, left = [], n
    while left:
        b = stream.read(min(left, 1 << 20))
        if not b:
            raise Unsafe("the zipapp ended after %d of %d bytes" % (n - left, n))
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def unpack(data, upath):
    """Extract the (hash-checked) zipapp into the private directory `upath`, atomically: a temporary 0700
    directory renamed into place, its marker `.ok` written last. Only `ddtree_agent/<module>.py` members, and
    `ddtree_agent/vendor/<package>/.../<module>.py` (the vendored prometheus_client) whose every component is a
    plain identifier."""
    import io
    import shutil
    import zipfile
    tmp = "%s.tmp-%d" % (upath, os.getpid())
    if os.path.lexists(tmp):
        shutil.rmtree(tmp)
    os.mkdir(tmp, 0o700)
    try:
        os.mkdir(os.path.join(tmp, PACKAGE), 0o700)
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            for name in zf.namelist():
                parts = name.split("/")
                vendor = len(parts) >= 4 and parts[1] == "vendor" and len(parts) <= 6 and all(
                    p.isidentifier() for p in parts[2:-1]) and parts[-1][:-3].isidentifier()
                if not (len(parts) == 2 or vendor or parts[1:] == ["vendor", "__init__.py"]) or \
                        parts[0] != PACKAGE or not parts[-1].endswith(".py") or \
                        parts[-1].startswith(".") or not parts[-1][:-3].isidentifier():
                    raise Unsafe("zipapp member %r" % name)
                d = os.path.join(tmp, *parts[:-1])
                if not os.path.isdir(d):
                    os.makedirs(d, 0o700)
                atomic_write(os.path.join(d, parts[-1]), zf.read(name))
        atomic_write(os.path.join(tmp, ".ok"), b"")
        try:
            os.rename(tmp, upath)
        except OSError:  # another call unpacked it first
            if not os.path.lexists(os.path.join(upath, ".ok")):
                raise
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)


def main(argv):
    state, want = os.path.expanduser(argv[1]), argv[2]
    req = {}
    try:
        req = json.loads(argv[3] if len(argv) > 3 else (sys.stdin.buffer.readline() or b"{}"))
        check_path(state, private=True, create=True)
        upath = os.path.join(state, "agent-%s" % want)
        try:
            os.close(open_private(os.path.join(upath, ".ok")))
            check_path(upath, private=True)
        except FileNotFoundError:
            zpath = upath + ".pyz"
            data = read_private(zpath)
            if data is not None and hashlib.sha256(data).hexdigest() != want:
                data = None  # damaged: replaced by the next shipment
            if data is None:
                if not req.get("ship"):
                    return reply({"type": "ship"}, req.get("raw"))
                data = read_exactly(sys.stdin.buffer, int(req["ship"]))
                if hashlib.sha256(data).hexdigest() != want:
                    raise Unsafe("the zipapp received does not have sha256 %s" % want)
                atomic_write(zpath, data)
            unpack(data, upath)
        sys.path.insert(0, upath)
        main_mod = __import__(PACKAGE + ".main", fromlist=["serve"])
    except Exception as exc:  # nothing ran: say why, in the one envelope
        return reply({"type": "error", "kind": "agent-state", "error": "%s: %s" % (type(exc).__name__, exc)},
                     req.get("raw"))
    main_mod.serve(req, state)


if __name__ == "__main__":
    main(sys.argv)
