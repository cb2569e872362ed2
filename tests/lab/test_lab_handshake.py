"""sshd cutting an SSH handshake (end of file before it answered our authentication) is retried on a new
connection; nothing that sshd refused is.

CI once failed `fab inventory` as the lab's `deploy` user with paramiko's "Authentication failed: transport
shut down or saw EOF": sshd ended the connection before answering, which it does to shed load (MaxStartups),
when the process serving the connection dies, or while it restarts, and which a new connection a moment later
gets past. Here a second, real sshd on a lab host (its own port, the host's own key) is made to do exactly
that: its AuthorizedKeysCommand kills the sshd process serving the connection for the first N connections
(the same paramiko error, reproduced), then prints the user's authorized_keys."""
from __future__ import annotations

import dataclasses
import subprocess

import pytest

from deploy.lab import fleet
from deploy.ssh import HostError, open_checked

pytestmark = pytest.mark.lab

PORT = 2201
CUT = """#!/bin/sh
# AuthorizedKeysCommand of the test sshd: the first $(cat cuts) calls kill the sshd process that runs it
d=/run/ddtree-cut; n=$(cat $d/count 2>/dev/null || echo 0); echo $((n+1)) > $d/count
[ "$n" -lt "$(cat $d/cuts)" ] && kill -9 $PPID
cat "$1/.ssh/authorized_keys"
"""


def root_ssh(h, cmd: str, stdin: str = "") -> str:
    p = subprocess.run(["ssh", "-F", "/dev/null", "-o", f"UserKnownHostsFile={fleet.known_hosts()}",
                        "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-i", str(fleet.control_key()),
                        f"root@{h.address}", cmd], input=stdin, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def cutting(lab, tmp_path_factory):
    """(inventory, host) for ct129's cutting sshd on PORT, and set(n) -> calls() to arm it for n cuts."""
    h = lab.hosts["ct129"]
    root_ssh(h, "mkdir -p /run/ddtree-cut && cat > /usr/local/sbin/ddtree-cut && chmod 755 /usr/local/sbin/ddtree-cut"
                " && echo 0 > /run/ddtree-cut/cuts && systemctl stop ddtree-cut-sshd 2>/dev/null;"
                f" systemd-run --quiet --unit=ddtree-cut-sshd /usr/sbin/sshd -D -e -p {PORT} -o PidFile=none"
                " -o AuthorizedKeysFile=none -o 'AuthorizedKeysCommand=/usr/local/sbin/ddtree-cut %h'"
                " -o AuthorizedKeysCommandUser=root && for i in $(seq 50); do ss -Hltn | grep -q ':2201 ' && break;"
                " sleep 0.1; done", stdin=CUT)
    # the test sshd serves the host's own key; known_hosts names it by [address]:port
    line = next(ln for ln in fleet.known_hosts().read_text().splitlines() if ln.split()[0] == h.address)
    kh = tmp_path_factory.mktemp("kh") / "known_hosts"
    kh.write_text(f"[{h.address}]:{PORT} {line.split(None, 1)[1]}\n")
    inv = dataclasses.replace(lab, ssh=dict(lab.ssh, known_hosts=str(kh)))
    host = dataclasses.replace(h, port=PORT)

    def arm(cuts: int):
        root_ssh(h, f"echo {cuts} > /run/ddtree-cut/cuts; rm -f /run/ddtree-cut/count")
        return lambda: int(root_ssh(h, "cat /run/ddtree-cut/count 2>/dev/null || echo 0"))

    yield inv, host, arm
    root_ssh(h, "systemctl stop ddtree-cut-sshd; rm -rf /run/ddtree-cut /usr/local/sbin/ddtree-cut")


def test_a_cut_handshake_is_retried_on_a_new_connection(cutting, capsys):
    inv, host, arm = cutting
    calls = arm(1)
    conn = open_checked(inv, host)
    try:
        assert conn.run("hostname", hide=True, in_stream=False).stdout.strip() == "ct129"
    finally:
        conn.close()
    assert calls() == 2  # cut once, answered on the second connection
    err = capsys.readouterr().err
    assert "ct129: sshd closed the connection during the SSH handshake" in err and "(1 of 2)" in err
    assert "transport shut down or saw EOF" in err


def test_cuts_past_the_retries_fail_as_a_cut_handshake(cutting):
    inv, host, arm = cutting
    calls = arm(5)
    with pytest.raises(HostError) as e:
        open_checked(inv, host)
    assert e.value.kind == "handshake-cut" and calls() == 3, e.value
    assert "closed the connection during the SSH handshake (authenticating as root) (3 connections)" in str(e.value)
    calls = arm(1)
    with pytest.raises(HostError) as e:  # connect_retries: 0 -> one connection only
        open_checked(dataclasses.replace(inv, ssh=dict(inv.ssh, connect_retries=0)), host)
    assert e.value.kind == "handshake-cut" and calls() == 1


def test_a_refused_key_is_not_retried(cutting, tmp_path):
    inv, host, arm = cutting
    calls = arm(0)
    key = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    with pytest.raises(HostError) as e:
        open_checked(dataclasses.replace(inv, ssh=dict(inv.ssh, identity_file=str(key))), host)
    assert e.value.kind == "auth" and calls() == 1, e.value


def test_lab_journal_shows_warnings_and_sshd_lines_not_routine_logins(lab, fab):
    """`fab lab.journal` (printed by .ci/run when a run failed): read from outside the host, so it works even
    when the host's sshd does not answer."""
    import os
    import re
    h = lab.hosts["ct200"]
    mark = f"ddtree-journal-{os.getpid()}"
    root_ssh(h, f"logger -p daemon.warning -t ddtree-test {mark}; logger -p daemon.info -t ddtree-test {mark}-info")
    r = fab("lab.journal", "--host", "ct200", "--lines", "400")
    assert r.returncode == 0, r.stderr
    assert re.search(rf"ddtree-test\[\d+\]: {mark}\n", r.stdout) and f"{mark}-info" not in r.stdout
    assert "== ct200: " in r.stdout and "== ct129" not in r.stdout
    assert "sshd[" in r.stdout and "Accepted publickey" not in r.stdout and "pam_env(" not in r.stdout


def test_an_openssh_stream_cut_in_its_handshake_is_made_again(cutting, tmp_path, capsys):
    """Wheel transfers run through OpenSSH's own `ssh` (provision/transfer.py): a stream that sshd cut before
    anything ran is made again the same way; past the retries it fails as a cut (LinkLost.handshake_cut)."""
    import hashlib

    from deploy.provision import transfer
    from deploy.remote.client import LinkLost, Remote
    inv, host, arm = cutting
    name, size = "ddtree_cut_demo-1.0-py3-none-any.whl", 300_000
    path = f"/root/cut-demo/{name}"
    digest = root_ssh(host, f"mkdir -p /root/cut-demo && head -c {size} /dev/urandom > {path} && sha256sum {path}")
    arm(0)
    conn = open_checked(inv, host)
    try:
        remote = Remote(conn, host.name)
        remote.call("lock.read", {}, deadline=30)  # the agent's zipapp is on the host: streams can run it
        calls = arm(1)
        part = tmp_path / "demo.part"
        st = transfer.fetch(remote, inv, host, [(path, part, size)])
        assert st.bytes == size and hashlib.sha256(part.read_bytes()).hexdigest() == digest.split()[0]
        assert calls() == 3  # cut once; then OpenSSH asks about its key before signing with it: two calls
        err = capsys.readouterr().err
        assert "ct129: sshd closed the connection during the SSH handshake (OpenSSH: ssh exited 255 after 0 of " \
               f"{size} bytes: Connection closed by {host.address} port {PORT})" in err and "(1 of 2)" in err
        calls = arm(5)
        again = tmp_path / "again.part"
        with pytest.raises(LinkLost) as e:
            transfer.fetch(remote, inv, host, [(path, again, size)])
        assert e.value.handshake_cut and calls() == 3 and (not again.exists() or again.stat().st_size == 0)
    finally:
        conn.close()
        root_ssh(host, "rm -rf /root/cut-demo")


def test_openssh_handshake_cut_in_ssh_s_own_words():
    from deploy.ssh import openssh_handshake_cut as cut
    assert cut(255, "Connection closed by 10.231.77.129 port 2201\n")
    assert cut(255, "kex_exchange_identification: Connection closed by remote host\r\n")
    assert cut(255, "Connection reset by 10.0.0.1 port 22\n")
    for rc, err in ((0, "Connection closed by 10.0.0.1 port 22\n"),
                    (255, "Connection to 10.0.0.1 closed by remote host.\n"),
                    (255, "root@10.0.0.1: Permission denied (publickey).\n"), (255, "Host key verification failed.\n"),
                    (255, "ssh: connect to host 10.0.0.1 port 22: Connection refused\n"), (255, ""), (None, "")):
        assert not cut(rc, err), (rc, err)
