"""Benchmark: time to build the lab's Debian base (first run) and to boot 3 hosts from the cached base.

Tears the lab down first (it is rebuilt from scratch: containers, overlays, keys, venvs).
`--rebuild-base` also deletes the cached base so the debootstrap time is measured.
Run as root: .venv/bin/python benchmarks/lab_boot.py [--rebuild-base]
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.lab import fleet  # noqa: E402


def main() -> None:
    fleet.down()
    if "--rebuild-base" in sys.argv:
        shutil.rmtree(fleet.base_path(), ignore_errors=True)
    t0 = time.perf_counter()
    report = fleet.up(log=lambda *_: None)
    total = time.perf_counter() - t0
    base = report["base_build_seconds"]
    print(f"base build (debootstrap):      {'%.1f s' % base if base is not None else 'cached'}")
    print(f"3 hosts created and booted:    {report['boot_seconds']:.1f} s (to sshd answering)")
    print(f"lab.up total:                  {total:.1f} s")
    t1 = time.perf_counter()
    fleet.down()
    t2 = time.perf_counter()
    fleet.up(log=lambda *_: None)
    print(f"lab.down:                      {t2 - t1:.1f} s")
    print(f"lab.up again (fresh hosts):    {time.perf_counter() - t2:.1f} s")


if __name__ == "__main__":
    main()
