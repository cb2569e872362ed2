"""Wheel transfers over SFTP: resumable, atomic on arrival, with progress.

Fabric's `put` has no progress callback; the paramiko SFTPClient underneath has, and it lets us
resume: an upload goes to `NAME.part`, continues from the part's size when it exists, and only the
remote `finalize` (agent.py) renames it after its sha256 matches. Downloads land in the control cache's
`.part` and are committed by WheelCache.commit after the same check.
"""
from __future__ import annotations

import posixpath
import stat
import time
from dataclasses import dataclass
from typing import Callable

import paramiko

from ..ssh import open_root_sftp

WINDOW = 64 * 1024 * 1024     # SSH channel window: keep the link busy while acks travel
REQUEST = 255 * 1024          # SFTP write size; OpenSSH's sftp-server takes messages up to 256 KiB
READ_REQUEST = 32 * 1024
PREFETCH_REQUESTS = 256


@dataclass
class TransferStats:
    bytes: int = 0
    resumed_from: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        return self.bytes / self.seconds if self.seconds > 0 else 0.0


def open_sftp(conn) -> paramiko.SFTPClient:
    """An SFTP session with root's file access (sudo for a non-root SSH user) and a large window."""
    return open_root_sftp(conn, WINDOW)


def makedirs(sftp: paramiko.SFTPClient, path: str) -> None:
    parts = []
    while path not in ("", "/"):
        try:
            if stat.S_ISDIR(sftp.stat(path).st_mode):
                break
        except FileNotFoundError:
            parts.append(path)
            path = posixpath.dirname(path)
            continue
        break
    for p in reversed(parts):
        try:
            sftp.mkdir(p, 0o755)
        except OSError:
            if not stat.S_ISDIR(sftp.stat(p).st_mode):
                raise


def _copy(src, dst, block_size: int, st: "TransferStats", progress) -> None:
    """Copy src to dst in blocks, counting bytes into `st` and reporting each block to `progress`."""
    while True:
        block = src.read(block_size)
        if not block:
            return
        dst.write(block)
        st.bytes += len(block)
        if progress:
            progress(len(block))


def put(sftp: paramiko.SFTPClient, local: str, remote_final: str, size: int,
        progress: Callable[[int], None] | None = None, resume: bool = True) -> TransferStats:
    """Upload `local` to `remote_final + '.part'`, resuming a previous partial upload."""
    part = remote_final + ".part"
    makedirs(sftp, posixpath.dirname(remote_final))
    offset = 0
    if resume:
        try:
            offset = sftp.stat(part).st_size
        except FileNotFoundError:
            offset = 0
        if offset > size:
            offset = 0
    st = TransferStats(resumed_from=offset)
    t0 = time.time()
    with open(local, "rb") as src:
        src.seek(offset)
        with sftp.open(part, "r+b" if offset else "wb") as dst:
            dst.MAX_REQUEST_SIZE = REQUEST
            dst.set_pipelined(True)
            if offset:
                dst.seek(offset)
            if progress and offset:
                progress(offset)
            _copy(src, dst, REQUEST * 8, st, progress)
    st.seconds = time.time() - t0
    return st


def get(sftp: paramiko.SFTPClient, remote: str, local_part, size: int,
        progress: Callable[[int], None] | None = None) -> TransferStats:
    """Download `remote` into `local_part`, appending to what an earlier attempt left."""
    offset = local_part.stat().st_size if local_part.exists() else 0
    if offset > size:
        local_part.unlink()
        offset = 0
    st = TransferStats(resumed_from=offset)
    t0 = time.time()
    with sftp.open(remote, "rb") as src, open(local_part, "ab") as dst:
        if progress and offset:
            progress(offset)
        if offset < size:
            src.seek(offset)
            # bounded read-ahead: paramiko's default queues every request of the file at once, which
            # slows a multi-GB download to a crawl (its prefetch buffer is scanned per read)
            src.prefetch(size, max_concurrent_requests=PREFETCH_REQUESTS)
            _copy(src, dst, 1024 * 1024, st, progress)
    st.seconds = time.time() - t0
    return st
