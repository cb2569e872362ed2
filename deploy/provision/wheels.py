"""Wheels rebuilt from installed distributions (PEP 427 / PEP 376), and their checks.

The repacking code itself lives in agent.py, because it runs on the reference and target hosts
(stdlib only); this module is its control-side face plus the validators used by tests and the cache.
"""
from __future__ import annotations

import csv
import io
import zipfile
from pathlib import Path

from . import agent

repack = agent.repack
verify_record = agent.verify_record
record_hash = agent.record_hash
sha256_file = agent.sha256_file
wheel_filename = agent.wheel_filename


class WheelError(ValueError):
    pass


def check_wheel(path: str | Path) -> dict:
    """Validate a wheel against PEP 427: one .dist-info with METADATA, WHEEL (Wheel-Version 1.x, Tag
    lines) and RECORD; every archive member listed in RECORD with a matching sha256 and size, and
    nothing listed that is absent. Returns {name, version, tags, files}; raises WheelError."""
    path = Path(path)
    nv = agent.parse_wheel_filename(path.name)
    if nv is None:
        raise WheelError(f"{path.name}: not a wheel file name")
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        dis = sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})
        if len(dis) != 1:
            raise WheelError(f"{path.name}: expected one .dist-info directory, found {dis}")
        di = dis[0]
        for req in ("METADATA", "WHEEL", "RECORD"):
            if f"{di}/{req}" not in names:
                raise WheelError(f"{path.name}: {di}/{req} missing")
        wheel = zf.read(f"{di}/WHEEL").decode()
        if not any(line.strip().startswith("Wheel-Version: 1.") for line in wheel.splitlines()):
            raise WheelError(f"{path.name}: WHEEL has no Wheel-Version 1.x")
        tags = agent.wheel_tags(wheel)
        if not tags:
            raise WheelError(f"{path.name}: WHEEL has no Tag lines")
        rows = {p: (h, s) for p, h, s in agent.parse_record(zf.read(f"{di}/RECORD").decode())}
        for n in names:
            if n.endswith("/"):
                continue
            if n not in rows:
                raise WheelError(f"{path.name}: {n} is not listed in RECORD")
            h, size = rows[n]
            if n == f"{di}/RECORD":
                continue
            data = zf.read(n)
            if h != agent.record_hash(data) or (size is not None and size != len(data)):
                raise WheelError(f"{path.name}: {n} does not match its RECORD hash/size")
        absent = [p for p in rows if p not in names]
        if absent:
            raise WheelError(f"{path.name}: RECORD lists absent files {absent[:3]}")
    return {"name": nv[0], "version": nv[1], "tags": tags, "files": len(names)}


def record_text(rows: list[tuple[str, str, str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for r in rows:
        w.writerow(r)
    return buf.getvalue()
