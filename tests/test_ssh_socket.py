"""The SSH client socket (deploy/ssh.py), on a real loopback TCP connection: no Nagle on our writes, and every
read acknowledged at once, so sshd's Nagle-held replies (the first channel's confirmation) are not left waiting
~40 ms for our delayed ACK. Speed itself is measured in benchmarks/inventory_scale.py, not here."""
from __future__ import annotations

import socket

import pytest

from deploy.ssh import QuickAckSocket, tcp_connect

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux only")


@pytest.fixture
def server():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    yield srv
    srv.close()


def test_every_read_leaves_the_socket_in_quick_ack_mode(server):
    c = tcp_connect("127.0.0.1", server.getsockname()[1], timeout=5)
    peer, _ = server.accept()
    try:
        assert isinstance(c, QuickAckSocket) and isinstance(c, socket.socket)
        assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert c.gettimeout() == 5
        for _ in range(2):  # the kernel clears the mode on its own: set again on every read
            # delayed ACKs, the mode the kernel falls back to; a plain socket stays in it after the read below
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 0)
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 0
            peer.sendall(b"hostkeys-00")
            assert c.recv(64) == b"hostkeys-00"
            assert c.getsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK) == 1
        c.sendall(b"ok")
        assert peer.recv(8) == b"ok"
    finally:
        c.close()
        peer.close()


def test_connect_refused_is_an_oserror_not_a_hang():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    with pytest.raises(OSError):
        tcp_connect("127.0.0.1", port, timeout=2)


def _raised_in(context: BaseException, outer: BaseException) -> BaseException:
    """`outer` as paramiko raises it: inside an except block, so `context` is its __context__."""
    try:
        try:
            raise context
        except BaseException:
            raise outer
    except BaseException as e:
        return e


def test_handshake_cut_is_an_end_of_file_or_reset_never_a_refusal():
    import paramiko
    from paramiko.ssh_exception import AuthenticationException, BadAuthenticationType, BadHostKeyException

    from deploy.ssh import handshake_cut
    key = paramiko.Ed25519Key.from_private_key_file(_a_key())
    banner = "Error reading SSH protocol banner"
    cut = [EOFError(), ConnectionResetError(104, "reset"), BrokenPipeError(),
           AuthenticationException("Authentication failed: transport shut down or saw EOF"),
           _raised_in(EOFError(), paramiko.SSHException(banner)),
           _raised_in(ConnectionResetError(), paramiko.SSHException(banner + "[Errno 104] reset"))]
    not_cut = [AuthenticationException("Authentication failed."), BadAuthenticationType("bad", ["password"]),
               AuthenticationException("Authentication timeout."), BadHostKeyException("h", key, key),
               paramiko.SSHException("Server '[h]:22' not found in known_hosts"), ConnectionRefusedError(),
               socket.timeout("timed out"), _raised_in(socket.timeout(), paramiko.SSHException(banner)),
               paramiko.SSHException("Negotiation failed."), ValueError("a bug")]
    assert [handshake_cut(e) for e in cut] == [True] * len(cut)
    assert [handshake_cut(e) for e in not_cut] == [False] * len(not_cut)


def _a_key() -> str:
    import subprocess
    import tempfile
    d = tempfile.mkdtemp()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", f"{d}/k"], check=True)
    return f"{d}/k"
