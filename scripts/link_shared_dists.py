"""Hard-link installed distributions from this interpreter's venv into another venv's site-packages.

Why: the two test venvs (.venv with SGLang 0.5.23, .venv-sglang-0.5.17) both need the same torch 2.14.1 build, and
that build with its CUDA libraries (torch, triton, nvidia-*, cuda-*) is about 5.5 GB. Installed twice it filled a
CI machine's disk; hard links make the second copy free. pip then finds those distributions installed at the
pinned versions and installs only the rest; a pin that differs makes pip replace the linked copy (uninstalling a
hard link leaves the source venv's file alone).

Usage (run with the SOURCE venv's interpreter):
    .venv/bin/python scripts/link_shared_dists.py TARGET_VENV NAME_OR_PREFIX...
A NAME_OR_PREFIX ending in '-' matches every distribution whose normalized name starts with it (nvidia-).
Only files inside the source site-packages are linked (console scripts in bin/ carry the source interpreter's path);
a distribution already present in the target is left alone, so a second run links nothing.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _wanted(name: str, patterns: list[str]) -> bool:
    n = _norm(name)
    return any(n.startswith(p) if p.endswith("-") else n == p for p in patterns)


def _target_site(venv: Path) -> Path:
    py = venv / "bin" / "python"
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    return Path(out)


def link(target_venv: Path, patterns: list[str]) -> tuple[int, int]:
    src_site = Path(sysconfig.get_paths()["purelib"]).resolve()
    dst_site = _target_site(target_venv).resolve()
    if src_site == dst_site:
        raise SystemExit("source and target venv are the same")
    if os.stat(src_site).st_dev != os.stat(dst_site).st_dev:
        return 0, 0  # different filesystems: no hard links; pip installs normally
    present = {_norm(d.metadata["Name"]) for d in md.distributions(path=[str(dst_site)])}
    dists = files = 0
    for dist in md.distributions(path=[str(src_site)]):
        name = dist.metadata["Name"]
        if not name or not _wanted(name, patterns) or _norm(name) in present:
            continue
        for rel in dist.files or ():
            src = (src_site / rel).resolve()
            # RECORD entries come from a wheel: never follow one outside site-packages.
            if not src.is_relative_to(src_site) or not src.is_file():
                continue
            dst = dst_site / src.relative_to(src_site)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                os.link(src, dst)
                files += 1
        dists += 1
    return dists, files


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    patterns = [_norm(p.rstrip("-")) + ("-" if p.endswith("-") else "") for p in argv[1:]]
    dists, files = link(Path(argv[0]), patterns)
    print(f"linked {dists} distributions ({files} files) into {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
