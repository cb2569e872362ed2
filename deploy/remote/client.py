"""The one client of the agent runtime: ship the zipapp once per host, invoke it by hash, read the envelope.

A call is one SSH exec on the host's existing connection (paramiko, no Fabric runner, no stdin penalty): the
command line is `[sudo -n --] python3 -I -S -c LOADER STATE_DIR SHA256` (the loader is ~6 KB; the agent's
source never travels in argv), stdin carries the request line, then the zipapp when the host asked for it,
then the op's data (a release bundle). Every call has a deadline; long calls also have a silence limit (the
agent sends heartbeats), so a dead link is reported within seconds of it dying, not at the deadline.

Bulk bytes (wheels) go through OpenSSH's own `ssh` with the inventory's known_hosts and key (stream_argv):
the same loader and envelope, the request as the last argument, the data on stdin or stdout.
"""
from __future__ import annotations

import getpass
import os
import shlex
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

from ..ssh import openssh_handshake_cut
from . import zipapp
from .errors import AgentError, LinkLost  # noqa: F401 (the client's errors: callers catch them from here)
from .host import envelope

ROOT_STATE = "/var/lib/ddtree"     # root-owned, 0700: the zipapp, the host lock, provision's staging and backups
USER_STATE = "~/.cache/ddtree"     # the SSH user's own, 0700: for the read-only facts probe without sudo
REPLY_MARGIN = 2.0                 # the agent's own deadline ends this much before the client's


def _lost(reason: str, returncode: int | None, err: str, moved: int) -> LinkLost:
    exc = LinkLost("link-lost", reason + ": " + err.strip()[-600:])
    exc.handshake_cut = moved == 0 and openssh_handshake_cut(returncode, err)
    return exc


def _loader_source() -> str:
    """The loader without its docstrings, comments and blank lines (it travels in argv on every call). A line
    scan, not ast: this runs at every `fab` start-up (loader.py has triple quotes only around docstrings, and
    a test compiles the result)."""
    out, in_doc = [], False
    for line in (Path(zipapp.HOST_DIR) / "loader.py").read_text().splitlines():
        text = line.strip()
        if in_doc:
            in_doc = not text.endswith('"""')
            continue
        if text.startswith('"""'):
            in_doc = not (len(text) > 3 and text.endswith('"""'))
            out.append(line[:len(line) - len(line.lstrip())] + "pass")  # a body that was only a docstring
            continue
        if text and not text.startswith("#"):
            out.append(line)
    return "\n".join(out) + "\n"


LOADER = _loader_source()


def loader_argv(state: str, sha256: str, request: str | None = None) -> list[str]:
    return ["python3", "-I", "-S", "-c", LOADER, state, sha256] + ([request] if request is not None else [])


def command_line(argv: list[str], user: str, root: bool) -> str:
    """The remote shell command: as is for root (or a read-only call), else through `sudo -n` (a sudo that
    wants a password fails at once instead of hanging)."""
    cmd = shlex.join(argv)
    return "sudo -n -- " + cmd if root and user != "root" else cmd


def lock_holder(command: str) -> dict:
    """Who holds a host lock (provision and deploy share it): user@machine, the command, our pid, a fresh token."""
    return {"holder": f"{getpass.getuser()}@{socket.gethostname()}", "command": command, "pid": os.getpid(),
            "token": uuid.uuid4().hex}


def _error_kind(rc: int | None, stderr: str) -> tuple[str, str]:
    if "password is required" in stderr or "sudo:" in stderr[:200]:
        return "sudo", f"sudo -n refused ({stderr.strip()[-300:]}); the SSH user needs passwordless sudo"
    if rc == 127:
        return "no-python", f"no python3 on the host ({stderr.strip()[-300:]})"
    tail = stderr.strip()[-800:]
    return "no-reply", (f"the agent gave no answer (exit {rc}): {tail}" if tail else
                        f"the agent gave no answer (exit {rc}, nothing on stderr: killed by a signal?)")


class Remote:
    """The agent on one host, over one open SSH connection (a Fabric Connection)."""

    def __init__(self, conn, host: str | None = None, state_dir: str | None = None):
        self.conn = conn
        self.host = host or conn.host
        self.root_state = state_dir or ROOT_STATE

    def state(self, root: bool) -> str:
        return self.root_state if root or self.conn.user == "root" else USER_STATE

    def command(self, root: bool, request: str | None = None) -> str:
        return command_line(loader_argv(self.state(root), zipapp.build().sha256, request), self.conn.user, root)

    def call(self, op: str, args: dict | None = None, *, deadline: float, root: bool = True, lock: dict | None = None,
             data: bytes = b"", on_event: Callable[[dict], None] | None = None, silence: float | None = None) -> dict:
        """Run `op` on the host and return its result; raise AgentError (LinkLost when the link died)."""
        app = zipapp.build()
        ship = False  # the host's "ship" reply alone decides whether the zipapp travels
        for _attempt in (1, 2):
            req = envelope.request_line(op, args, max(1.0, deadline - REPLY_MARGIN), lock,
                                        ship=app.size if ship else None)
            stdin = req.encode() + b"\n" + (app.data if ship else b"") + data
            replies, rc, err = self._exec(self.command(root), stdin, deadline, on_event, silence)
            fin = envelope.final(replies)
            if fin is not None and fin["type"] == "ship" and not ship:
                ship = True
                continue
            break
        if fin is None:
            kind, msg = _error_kind(rc, err)
            raise AgentError(kind, msg)
        if fin["type"] == "ship":
            raise AgentError("agent-state", "the host did not keep the zipapp it was sent")
        if fin["type"] == "error":
            raise AgentError(fin.get("kind") or "error", fin.get("error") or "agent failed", fin)
        return fin.get("result") or {}

    def _exec(self, command: str, stdin: bytes, deadline: float, on_event, silence) -> tuple[list, int | None, str]:
        self.conn.open()
        transport = self.conn.client.get_transport()  # its socket: ssh.tcp_connect (TCP_NODELAY, QUICKACK)
        end = time.monotonic() + deadline
        try:
            chan = transport.open_session(timeout=min(20.0, deadline))
        except Exception as exc:  # paramiko raises SSHException/EOFError on a dead transport
            raise LinkLost("link-lost", f"cannot open a channel: {exc}") from None
        replies: list[dict] = []
        out, err = bytearray(), bytearray()
        try:
            chan.settimeout(max(1.0, deadline))
            chan.exec_command(command)
            if stdin:
                chan.sendall(stdin)
            chan.shutdown_write()
            chan.settimeout(0.25)
            last = time.monotonic()
            while True:
                try:
                    chunk = chan.recv(1 << 16)
                except socket.timeout:
                    chunk = None
                now = time.monotonic()
                if chunk:
                    last = now
                    out += chunk
                    *lines, rest = bytes(out).split(b"\n")
                    out = bytearray(rest)
                    for line in lines:
                        obj = envelope.parse_line(line)
                        if obj is None:
                            continue
                        if obj["type"] == "event" and on_event:
                            on_event(obj)
                        elif obj["type"] != "hb":
                            replies.append(obj)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(1 << 16)
                if chunk == b"":
                    break
                if now > end:
                    raise AgentError("timeout", f"no answer within {deadline:.0f}s (the host is hung or "
                                                f"overloaded)")
                if silence and now - last > silence:
                    raise LinkLost("link-lost", f"no word from the host for {silence:.0f}s (link down?)")
            if out:
                obj = envelope.parse_line(bytes(out))
                if obj is not None and obj["type"] not in ("event", "hb"):
                    replies.append(obj)
            rc = chan.recv_exit_status() if chan.status_event.wait(5) else None
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(1 << 16)
        except (socket.timeout, EOFError, OSError) as exc:
            raise LinkLost("link-lost", f"connection lost: {type(exc).__name__}: {exc}") from None
        finally:
            chan.close()
        if not envelope.final(replies) and not transport.is_active():
            raise LinkLost("link-lost", "the SSH connection dropped before the host answered")
        return replies, rc, err.decode("utf-8", "replace")

    # ---------------------------------------------------------------- bulk transfers through OpenSSH

    def stream_argv(self, ssh_argv: list[str], op: str, args: dict, deadline: float, lock: dict | None = None,
                    raw: bool = False) -> list[str]:
        """argv of an OpenSSH `ssh` running `op` with the request as the loader's last argument (stdin and
        stdout stay free for the bytes). The zipapp must be on the host already (a call made it so)."""
        req = envelope.request_line(op, dict(args), max(1.0, deadline - REPLY_MARGIN), lock, raw=raw)
        return ssh_argv + [self.command(True, req)]


# ---------------------------------------------------------------- OpenSSH streams

def _watch(p: subprocess.Popen, deadline: float, stall: float, progress_at: Callable[[], float], what: str):
    """Kill `p` when the deadline passes or nothing moved for `stall` seconds; returns the reason or None."""
    end = time.monotonic() + deadline
    while p.poll() is None:
        now = time.monotonic()
        if now > end:
            p.kill()
            return f"{what}: not done within {deadline:.0f}s"
        if now - progress_at() > stall:
            p.kill()
            return f"{what}: no progress for {stall:.0f}s (link down?)"
        time.sleep(0.2)
    return None


def _big_pipe(fd: int) -> None:
    from .host.provision import big_pipe
    big_pipe(fd)


def upload(argv: list[str], sources: list[tuple[str, int, int]], progress: Callable[[int], None] | None,
           deadline: float, stall: float = 60.0, started: Callable[[subprocess.Popen], None] | None = None) -> dict:
    """Send the byte ranges `sources` [(path, offset, size)] one after the other as the stdin of an agent op (argv
    from Remote.stream_argv), with sendfile(2) into the pipe; the agent's "received" events drive `progress`
    (bytes each time) and the stall watch. Returns the op's result; raises AgentError (LinkLost on a cut)."""
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _big_pipe(p.stdin.fileno())
    if started:
        started(p)
    moved = [time.monotonic(), 0]
    errbuf: list[bytes] = []
    threading.Thread(target=lambda: errbuf.append(p.stderr.read()), daemon=True).start()

    def feed() -> None:
        try:
            for path, offset, size in sources:
                with open(path, "rb") as fh:
                    pos = offset
                    while pos < size:
                        n = os.sendfile(p.stdin.fileno(), fh.fileno(), pos, min(size - pos, 8 << 20))
                        if n == 0:
                            break
                        pos += n
        except OSError:
            pass  # the far end went away; the reply (or its absence) says what arrived
        finally:
            try:
                p.stdin.close()
            except OSError:
                pass
    threading.Thread(target=feed, daemon=True).start()
    why: list = []
    watcher = threading.Thread(target=lambda: why.append(_watch(p, deadline, stall, lambda: moved[0], "upload")),
                               daemon=True)
    watcher.start()
    replies: list[dict] = []
    heard = 0  # the agent's envelopes of any kind: once one came, the host ran something
    for line in p.stdout:
        obj = envelope.parse_line(line)
        if obj is None:
            continue
        heard += 1
        if obj["type"] == "event" and obj.get("event") == "received":
            if progress and obj["bytes"] > moved[1]:
                progress(obj["bytes"] - moved[1])
            moved[:] = [time.monotonic(), max(moved[1], obj["bytes"])]
        elif obj["type"] == "hb":
            moved[0] = time.monotonic()
        elif obj["type"] != "event":
            replies.append(obj)
    p.wait()
    watcher.join()
    fin = envelope.final(replies)
    if fin is None:
        err = b"".join(errbuf).decode("utf-8", "replace")
        cut_short = why[0] if why and why[0] else None  # our own deadline or stall watch killed it
        raise _lost(cut_short or f"ssh exited {p.returncode}", None if cut_short else p.returncode, err,
                    moved[1] + heard)
    if fin["type"] == "error":
        raise AgentError(fin.get("kind") or "error", fin.get("error") or "agent failed", fin)
    if fin["type"] == "ship":
        raise AgentError("agent-state", "the host has no agent zipapp yet (make a call first)")
    return fin.get("result") or {}


def download(argv: list[str], sinks: list[tuple[Path, int]], progress: Callable[[int], None] | None,
             deadline: float, stall: float = 60.0) -> int:
    """Split an agent raw op's stdout (wheels' bytes, one after the other) into `sinks` [(part file, bytes)],
    appending to each; returns the bytes received. The agent writes errors to stderr, never into the data."""
    p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _big_pipe(p.stdout.fileno())
    moved = [time.monotonic()]
    errbuf: list[bytes] = []
    threading.Thread(target=lambda: errbuf.append(p.stderr.read()), daemon=True).start()
    why: list = []
    watcher = threading.Thread(target=lambda: why.append(_watch(p, deadline, stall, lambda: moved[0], "download")),
                               daemon=True)
    watcher.start()
    got, want = 0, sum(n for _p, n in sinks)
    src = p.stdout.fileno()
    for part, count in sinks:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT, 0o644)  # no O_APPEND: splice(2) refuses it
        try:
            os.lseek(fd, 0, os.SEEK_END)
            left = count
            while left > 0:
                n = os.splice(src, fd, min(left, 8 << 20))
                if n == 0:
                    break
                left -= n
                got += n
                moved[0] = time.monotonic()
                if progress:
                    progress(n)
        finally:
            os.close(fd)
        if left:
            break
    p.wait()
    watcher.join()
    if p.returncode != 0 or (why and why[0]) or got != want:
        err = b"".join(errbuf).decode("utf-8", "replace")
        fin = envelope.final(envelope.parse_output(err))
        if fin and fin["type"] == "error":
            raise AgentError(fin.get("kind") or "error", fin.get("error") or "agent failed", fin)
        raise _lost((why[0] if why and why[0] else None) or f"ssh exited {p.returncode} after {got} of {want} bytes",
                    None if why and why[0] else p.returncode, err, got)
    return got
