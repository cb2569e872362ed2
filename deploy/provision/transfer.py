"""Wheel transfers through OpenSSH's own `ssh` (paramiko's SFTP tops out at half of what OpenSSH moves on the
same link): resumable, checked on arrival, with progress.

A download runs the reference's `provision.send` op, which streams the file with sendfile(2) into the control
cache's `.part` (appended to what an earlier attempt left); WheelCache.commit checks it. An upload runs a
target's `provision.receive` op with the wheel on stdin from the offset its partial upload reached; the agent
hashes it as it arrives and renames it into the private staging directory only when the sha256 matches.
Every transfer has a deadline and a stall limit, and uses the inventory's known_hosts and key. A stream that sshd
cut in its handshake (nothing ran, no byte moved) is made again, as a connection is (ssh.retry_cut_streams).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..inventory import Host, Inventory
from ..remote import client
from ..ssh import openssh_argv, retry_cut_streams

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


def fetch(remote: client.Remote, inv: Inventory, host: Host, items: list[tuple[str, Path, int]],
          progress: Callable[[int], None] | None = None) -> TransferStats:
    """Download wheels [(path on the reference, cache part file, size)] in one OpenSSH stream, each continuing a
    partial part. Returns the bytes moved and the time the stream took."""
    import time
    todo, resumed = [], 0
    for path, part, size in items:
        offset = part.stat().st_size if part.exists() else 0
        if offset > size:
            part.unlink()
            offset = 0
        resumed += offset
        if offset < size:
            todo.append((path, part, size, offset))
    st = TransferStats(resumed_from=resumed)
    if progress and resumed:
        progress(resumed)
    t0 = time.time()
    if todo:
        dl = deadline_for(sum(size - off for _p, _pt, size, off in todo))
        argv = remote.stream_argv(openssh_argv(inv, host), "provision.send",
                                  {"files": [{"path": path, "offset": off} for path, _pt, _s, off in todo]}, dl,
                                  raw=True)
        sinks = [(part, size - off) for _p, part, size, off in todo]
        st.bytes = retry_cut_streams(inv, host, lambda: client.download(argv, sinks, progress, dl))
    st.seconds = time.time() - t0
    return st


def send(remote: client.Remote, inv: Inventory, host: Host, items: list[dict], lock: dict,
         progress: Callable[[int], None] | None = None, started: Callable | None = None) -> tuple[dict, TransferStats]:
    """Upload cached wheels [{local, sha256, filename, size, offset}] to a target's private staging directory in one
    OpenSSH stream. Returns ({sha256: the agent's answer {status, ...}}, stats)."""
    import time
    st = TransferStats(resumed_from=sum(i["offset"] for i in items))
    if progress and st.resumed_from:
        progress(st.resumed_from)
    total = sum(i["size"] - i["offset"] for i in items)
    dl = deadline_for(total)
    argv = remote.stream_argv(openssh_argv(inv, host), "provision.receive",
                              {"wheels": [{k: i[k] for k in ("sha256", "filename", "size", "offset")} for i in items]},
                              dl, lock)
    sent = [0]

    def counted(n: int) -> None:
        sent[0] += n
        if progress:
            progress(n)
    t0 = time.time()
    sources = [(i["local"], i["offset"], i["size"]) for i in items]
    res = retry_cut_streams(inv, host, lambda: client.upload(argv, sources, counted, dl, started=started))
    st.seconds = time.time() - t0
    st.bytes = sent[0]
    return res.get("wheels") or {}, st
