"""SSH connections with verified host keys, and a bounded per-host worker pool.

Fabric's Connection auto-accepts unknown host keys by default; every connection made here rejects
them instead and checks the inventory's known_hosts file (the lab writes one at `lab.up`).
`fab -H a,b` runs hosts one after another and ThreadingGroup has no bound, so multi-step per-host
work runs on `run_per_host`: a fixed-size thread pool of per-host Connections.
"""
from __future__ import annotations

import os
import re
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any, Callable

import paramiko
from fabric import Connection
from paramiko.ssh_exception import (AuthenticationException, BadHostKeyException, NoValidConnectionsError,
                                    SSHException)

from .inventory import Host, Inventory
from .remote.errors import AgentError, LinkLost


class HostError(RuntimeError):
    """A failure on one host, with a short kind ('unreachable', 'host-key', 'auth', ...)."""

    def __init__(self, host: str, kind: str, message: str):
        super().__init__(f"{host}: {kind}: {message}")
        self.host, self.kind, self.message = host, kind, message


def known_hosts_path(inv: Inventory) -> str:
    return inv.ssh_path("known_hosts") or os.path.expanduser("~/.ssh/known_hosts")


def connect(inv: Inventory, host: Host) -> Connection:
    """A Fabric Connection to `host` that refuses unknown or changed host keys."""
    identity = inv.ssh_path("identity_file")
    timeout = inv.ssh.get("connect_timeout", 10)
    kw: dict[str, Any] = {"banner_timeout": timeout, "auth_timeout": timeout}
    if identity:
        kw.update(key_filename=identity, look_for_keys=False, allow_agent=False)
    conn = Connection(host.address, user=host.user, port=host.port,
                      connect_timeout=inv.ssh.get("connect_timeout", 10), connect_kwargs=kw)
    client = conn.client
    kh = known_hosts_path(inv)
    # Replace Fabric's AutoAddPolicy: an unknown key is refused, never written down.
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    if os.path.exists(kh):
        client.load_host_keys(kh)
        client._host_keys_filename = None  # never save back into the inventory's known_hosts
    return conn


def nodelay(sock) -> None:
    """No Nagle on the SSH socket: each agent call is a few small packets each way, and Nagle plus delayed ACKs
    add ~40 ms to every one of them (measured on the lab: a trivial call 135 -> 35 ms)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (OSError, AttributeError):
        pass


_QUICKACK = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class QuickAckSocket(socket.socket):
    """The SSH client socket, acknowledging what it reads at once (TCP_QUICKACK after every read; Linux clears
    the flag by itself, so it is set again each time).

    Why: sshd keeps Nagle on for sessions without a tty, and after authentication it writes small messages
    (hostkeys-00, debug lines) then the first channel's open confirmation. That confirmation waits for our ACK
    of the earlier ones, and our kernel delays that ACK by ~40 ms, since we have nothing to send. Measured on
    the lab: the first channel opens in 6 ms instead of 52. Our own writes need TCP_NODELAY (nodelay above)."""

    def recv(self, bufsize, flags=0):
        data = super().recv(bufsize, flags)
        if _QUICKACK is not None:
            try:
                self.setsockopt(socket.IPPROTO_TCP, _QUICKACK, 1)
            except OSError:
                pass
        return data


def tcp_connect(address: str, port: int, timeout: float) -> socket.socket:
    """A connected TCP socket for SSH: no Nagle, quick ACKs, the connect bounded by `timeout`."""
    plain = socket.create_connection((address, port), timeout=timeout)
    sock = QuickAckSocket(fileno=plain.detach())
    sock.settimeout(timeout)
    nodelay(sock)
    return sock


CONNECT_RETRIES = 2  # ssh.connect_retries: new connections after sshd cut a handshake (0 = none)


def handshake_cut(exc: BaseException) -> bool:
    """True when sshd ended the connection in the middle of the SSH handshake without refusing anything: end of
    file or a reset while reading its banner, during key exchange or before its answer to our authentication.

    sshd does this to shed load (MaxStartups drops unauthenticated connections at random), when the process
    serving the connection dies, or while it restarts; a new connection a moment later is answered. Nothing else
    is this: a refused key, an unknown or changed host key, a timeout, a refused TCP connection are never retried
    (a timeout already spent its deadline; the others would fail the same way again)."""
    if isinstance(exc, (EOFError, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)):
        return True
    if isinstance(exc, BadHostKeyException):
        return False
    if isinstance(exc, AuthenticationException):
        # paramiko's words when the transport ended (EOF) while it waited for the server's answer
        return "transport shut down or saw EOF" in str(exc)
    if isinstance(exc, SSHException) and str(exc).startswith("Error reading SSH protocol banner"):
        return isinstance(exc.__context__, (EOFError, ConnectionResetError))  # not a banner timeout
    return False


def _host_error(inv: Inventory, host: Host, exc: BaseException, attempts: int) -> HostError:
    """paramiko's exception as one HostError with a clear kind."""
    if handshake_cut(exc):
        tried = f" ({attempts} connections)" if attempts > 1 else ""
        return HostError(host.name, "handshake-cut",
                         f"sshd on {host.address}:{host.port} closed the connection during the SSH handshake "
                         f"(authenticating as {host.user}){tried}: {type(exc).__name__}: {exc}; nothing was refused "
                         f"-- sshd's journal on the host says why (MaxStartups, a dying sshd, a restart)")
    if isinstance(exc, BadHostKeyException):
        return HostError(host.name, "host-key-mismatch",
                         f"{host.address} presented a {exc.key.get_name()} key that differs from "
                         f"{known_hosts_path(inv)}; refusing (possible man-in-the-middle or rebuilt host)")
    if isinstance(exc, SSHException):
        if "not found in known_hosts" in str(exc):
            return HostError(host.name, "host-key-unknown",
                             f"{host.address} is not in {known_hosts_path(inv)}; add its key after checking "
                             f"it out of band (host keys are never auto-accepted)")
        if isinstance(exc, AuthenticationException):
            return HostError(host.name, "auth", f"authentication as {host.user} failed: {exc}")
        return HostError(host.name, "ssh", str(exc))
    if isinstance(exc, (NoValidConnectionsError, socket.timeout, TimeoutError, OSError)):
        return HostError(host.name, "unreachable", f"{host.address}:{host.port}: {exc}")
    return HostError(host.name, "ssh", f"{type(exc).__name__}: {exc}")  # EOFError outside a handshake


def open_checked(inv: Inventory, host: Host) -> Connection:
    """connect() and open now, turning paramiko's exceptions into one HostError with a clear kind.

    A handshake that sshd cut (handshake_cut) is tried again on a new connection (retry_cut): each try is bounded
    by `connect_timeout`, so the whole open is too."""
    timeout = inv.ssh.get("connect_timeout", 10)

    def once() -> Connection:
        conn = connect(inv, host)
        try:
            conn.connect_kwargs["sock"] = tcp_connect(host.address, host.port, timeout)
            conn.open()
        except BaseException:
            conn.close()
            raise
        return conn
    try:
        conn = retry_cut(inv, host, once, lambda e: f"{type(e).__name__}: {e}" if handshake_cut(e) else None)
    except (SSHException, EOFError, OSError) as exc:  # OSError: socket errors, timeouts, NoValidConnections
        # a cut that is raised here was cut on every try
        raise _host_error(inv, host, exc, inv.ssh.get("connect_retries", CONNECT_RETRIES) + 1) from None
    conn.client.get_transport().set_keepalive(KEEPALIVE)
    return conn


def retry_cut(inv: Inventory, host: Host, attempt: Callable[[], Any], cut: Callable[[Exception], str | None]) -> Any:
    """attempt() again while it fails with a handshake that sshd cut (`cut` names it: its detail, else None):
    `ssh.connect_retries` times (default 2, 0 for none) after 0.5 s, then 1 s, each said on stderr. The one
    retry of both paramiko's connections (open_checked) and OpenSSH's streams (retry_cut_streams)."""
    retries = inv.ssh.get("connect_retries", CONNECT_RETRIES)
    for n in range(retries + 1):
        try:
            return attempt()
        except Exception as exc:
            detail = cut(exc) if n < retries else None
            if detail is None:
                raise
            delay = 0.5 * 2 ** n
            print(f"{host.name}: sshd closed the connection during the SSH handshake ({detail}); a new connection "
                  f"in {delay:g} s ({n + 1} of {retries})", file=sys.stderr)
            time.sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


# OpenSSH's `ssh` (LogLevel=INFO: at ERROR it exits 255 without a word) when sshd ended the connection before
# authentication completed (after it, the words are "Connection to HOST closed by remote host."; a refused key is
# "Permission denied (...)", an unknown or changed host key "Host key verification failed.")
_OPENSSH_CUT = re.compile(r"^(Connection closed by \S+ port \d+|Connection reset by \S+ port \d+|"
                          r"kex_exchange_identification: (Connection closed by remote host|"
                          r"read: Connection reset by peer))\r?$", re.M)


def openssh_handshake_cut(returncode: int | None, stderr: str) -> bool:
    """OpenSSH's `ssh` ended (exit 255) because sshd cut the handshake: handshake_cut's case, in ssh's words."""
    return returncode == 255 and bool(_OPENSSH_CUT.search(stderr or ""))


def retry_cut_streams(inv: Inventory, host: Host, attempt: Callable[[], Any]) -> Any:
    """retry_cut for an OpenSSH stream: a LinkLost whose stream sshd cut in its handshake (nothing ran on the host,
    no byte moved) is made again."""
    return retry_cut(inv, host, attempt, lambda e: "OpenSSH: " + e.message.splitlines()[-1][-160:]
                     if isinstance(e, LinkLost) and e.handshake_cut else None)


KEEPALIVE = 15  # seconds between SSH keepalives on long, quiet calls (a health gate can take minutes)


def openssh_argv(inv: Inventory, host: Host) -> list[str]:
    """OpenSSH's own client for bulk bytes, with exactly the inventory's trust: its known_hosts only (no user or
    system ssh config, no other known_hosts), unknown or changed keys refused, no password prompts, keepalives
    so a dead link ends the transfer."""
    argv = ["ssh", "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={known_hosts_path(inv)}", "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"ConnectTimeout={inv.ssh.get('connect_timeout', 10)}", "-o", "ServerAliveInterval=10",
            "-o", "ServerAliveCountMax=3", "-o", "LogLevel=INFO"]  # INFO: a cut handshake says so, ERROR is silent
    identity = inv.ssh_path("identity_file")
    if identity:
        argv += ["-i", identity, "-o", "IdentitiesOnly=yes"]
    return argv + ["-p", str(host.port), "-l", host.user, host.address]


@dataclass
class HostResult:
    host: str
    ok: bool
    value: Any = None
    error: str | None = None
    kind: str | None = None
    seconds: float = 0.0


def run_per_host(inv: Inventory, hosts: list[Host], fn: Callable[[Connection, Host], Any],
                 parallel: int | None = None, label: str = "") -> list[HostResult]:
    """Run `fn(conn, host)` for every host on a bounded pool; one host's failure never stops others.

    Results come back in the order of `hosts`. Progress is drawn on stderr when it is a terminal.
    """
    parallel = max(1, min(parallel or inv.settings.get("parallel", 16), len(hosts) or 1))

    def one(host: Host) -> HostResult:
        t0 = time.time()
        conn = None
        try:
            conn = open_checked(inv, host)
            return HostResult(host.name, True, fn(conn, host), seconds=time.time() - t0)
        except (HostError, AgentError) as exc:
            return HostResult(host.name, False, error=exc.message, kind=exc.kind, seconds=time.time() - t0)
        except Exception as exc:  # a bug or remote failure on one host must not stop the others
            return HostResult(host.name, False, error=f"{type(exc).__name__}: {exc}", kind="error",
                              seconds=time.time() - t0)
        finally:
            if conn is not None:
                conn.close()

    results: dict[str, HostResult] = {}
    progress = None
    if sys.stderr.isatty() and label:
        from rich.progress import Progress
        progress = Progress(transient=True)
        progress.start()
        task = progress.add_task(label, total=len(hosts))
    try:
        with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="host") as pool:
            futures = {pool.submit(one, h): h for h in hosts}
            try:
                for fut in as_completed(futures):
                    r = fut.result()
                    results[r.host] = r
                    if progress:
                        progress.advance(task)
            except KeyboardInterrupt:
                # hosts not started never start; a host already changing finishes its step on its own agent
                # (which finishes or rolls back and releases its lock) -- we wait for those answers
                pool.shutdown(wait=False, cancel_futures=True)
                print("interrupted: no new host starts; waiting for hosts already running", file=sys.stderr)
                raise
    finally:
        if progress:
            progress.stop()
    return [results[h.name] for h in hosts]
