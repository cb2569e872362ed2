"""Content-addressed wheel cache on the control machine: ROOT/ab/<sha256>/<wheel file name>.

A wheel is looked up by its sha256 and re-hashed on every lookup: a file corrupted on disk is refused,
removed, and reported, so the caller fetches it again. New entries arrive as `.part` files (resumable) and
are renamed into place only after their sha256 matches and the wheel passes check_wheel (every member against
its RECORD, no stray .pth). A wheel name is matched whole (wheels.WHEEL_NAME) before it becomes a path.
"""
from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from .wheels import WheelError, check_wheel, checked_filename, sha256_file

ENV = "DDTREE_WHEEL_CACHE"


def default_root() -> Path:
    return Path(os.environ.get(ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "ddtree-deploy" / "wheels")


class CacheError(RuntimeError):
    pass


class WheelCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root else default_root()
        self.events: list[str] = []
        self._verified: dict[str, Path] = {}
        self._lock = threading.Lock()

    def dir_for(self, sha256: str) -> Path:
        if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
            raise CacheError(f"not a sha256: {sha256!r}")
        return self.root / sha256[:2] / sha256

    def get(self, sha256: str) -> Path | None:
        """The cached wheel with this sha256, verified now; None if absent or corrupted (then removed)."""
        with self._lock:
            if sha256 in self._verified and self._verified[sha256].exists():
                return self._verified[sha256]
            d = self.dir_for(sha256)
            if not d.is_dir():
                return None
            for p in sorted(d.glob("*.whl")):
                actual = sha256_file(p)
                if actual == sha256:
                    self._verified[sha256] = p
                    return p
                self.events.append(f"cache: {p.name} is corrupted (sha256 {actual[:12]}..., expected "
                                   f"{sha256[:12]}...); removed, fetching again")
                p.unlink()
            return None

    def part_path(self, sha256: str, filename: str) -> Path:
        try:
            checked_filename(filename)
        except WheelError as exc:
            raise CacheError(f"refusing to cache it: {exc}") from None
        d = self.dir_for(sha256)
        d.mkdir(parents=True, exist_ok=True)
        return d / (filename + ".part")

    def commit(self, sha256: str, filename: str, allow_pth: list[str] | tuple = ()) -> Path:
        """Move a finished `.part` into place after checking its sha256 and the wheel itself (a bad one is
        deleted)."""
        part = self.part_path(sha256, filename)
        actual = sha256_file(part)
        if actual != sha256:
            part.unlink()
            raise CacheError(f"{filename}: downloaded sha256 {actual[:12]}... is not {sha256[:12]}...; removed")
        try:
            check_wheel(str(part), allow_pth, name=filename)
        except WheelError as exc:
            part.unlink()
            raise CacheError(f"{filename}: refused: {exc}; removed") from None
        final = part.with_name(filename)
        os.replace(part, final)
        with self._lock:
            self._verified[sha256] = final
        return final

    def add_file(self, path: str | Path, sha256: str | None = None, allow_pth: list[str] | tuple = ()) -> Path:
        """Copy a local wheel into the cache (verified)."""
        path = Path(path)
        sha256 = sha256 or sha256_file(path)
        part = self.part_path(sha256, path.name)
        shutil.copyfile(path, part)
        return self.commit(sha256, path.name, allow_pth)

    def size(self) -> int:
        return sum(p.stat().st_size for p in self.root.rglob("*.whl")) if self.root.exists() else 0
