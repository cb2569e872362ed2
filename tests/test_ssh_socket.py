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
