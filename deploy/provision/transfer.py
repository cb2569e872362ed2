"""Wheel transfers through OpenSSH's own `ssh` (paramiko's SFTP tops out at half of what OpenSSH moves on the
same link): resumable, checked on arrival, with progress.

A download runs the reference's `provision.send` op, which streams the file with sendfile(2) into the control
cache's `.part` (appended to what an earlier attempt left); WheelCache.commit checks it. An upload runs a
target's `provision.receive` op with the wheel on stdin from the offset its partial upload reached; the agent
hashes it as it arrives and renames it into the private staging directory only when the sha256 matches.
Every transfer has a deadline and a stall limit, and uses the inventory's known_hosts and key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..inventory import Host, Inventory
from ..remote import client
from ..ssh import openssh_argv

MIN_RATE = 5e6       # bytes/s: a transfer slower than this over its whole length is given up
SLACK = 120.0        # seconds on top of size / MIN_RATE


@dataclass
class TransferStats:
    bytes: int = 0
    resumed_from: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def deadline_for(size: int) -> float:
    return SLACK + size / MIN_RATE


def fetch(remote: client.Remote, inv: Inventory, host: Host, path: str, part: Path, size: int,
          progress: Callable[[int], None] | None = None) -> TransferStats:
    """Download `path` from the reference into the cache's `part`, continuing a partial one."""
    import time
    offset = part.stat().st_size if part.exists() else 0
    if offset > size:
        part.unlink()
        offset = 0
    st = TransferStats(resumed_from=offset)
    if progress and offset:
        progress(offset)
    t0 = time.time()
    if offset < size:
        dl = deadline_for(size - offset)
        argv = remote.stream_argv(openssh_argv(inv, host), "provision.send", {"path": path, "offset": offset}, dl,
                                  raw=True)
        st.bytes = client.download(argv, part, size, progress, dl)
    st.seconds = time.time() - t0
    return st


def send(remote: client.Remote, inv: Inventory, host: Host, local: str, sha256: str, filename: str, size: int,
         offset: int, lock: dict, progress: Callable[[int], None] | None = None,
         started: Callable | None = None) -> tuple[dict, TransferStats]:
    """Upload a cached wheel to a target's private staging directory from `offset`. Returns (the agent's
    answer {status, ...}, stats)."""
    import time
    st = TransferStats(resumed_from=offset)
    if progress and offset:
        progress(offset)
    dl = deadline_for(size - offset)
    argv = remote.stream_argv(openssh_argv(inv, host), "provision.receive",
                              {"sha256": sha256, "filename": filename, "size": size, "offset": offset}, dl, lock)
    t0 = time.time()
    sent = [0]

    def counted(n: int) -> None:
        sent[0] += n
        if progress:
            progress(n)
    res = client.upload(argv, local, offset, size, counted, dl, started=started)
    st.seconds = time.time() - t0
    st.bytes = size - offset if res.get("status") == "ok" and not res.get("already") else sent[0]
    return res, st
