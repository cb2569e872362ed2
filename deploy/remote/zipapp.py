"""The host package as one zipapp: deploy/remote/host/*.py under `ddtree_agent/`, entries sorted, times fixed,
so the same sources always give the same bytes and the same sha256 -- the name it is shipped and invoked by.

It also carries the control machine's own prometheus_client package (pure Python, stdlib-only imports, all
relative) as `ddtree_agent/vendor/prometheus_client/`: the drain reads a GPU server's /metrics on the host with
prometheus_client's own text parser (deploy/remote/host/metrics.py), not a hand-written one."""
from __future__ import annotations

import functools
import hashlib
import io
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .host.loader import PACKAGE

HOST_DIR = Path(__file__).resolve().parent / "host"
EPOCH = (1980, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class Zipapp:
    data: bytes
    sha256: str

    @property
    def size(self) -> int:
        return len(self.data)


VENDORED = ("prometheus_client",)
VENDOR_SKIP = {"aiohttp", "django", "twisted"}  # optional integrations; prometheus_client imports none of them


def vendored() -> dict[str, bytes]:
    """`vendor/<package>/<module>.py` -> bytes for each package of VENDORED, from this machine's installation."""
    import importlib.util
    out = {}
    for name in VENDORED:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin:
            raise RuntimeError(f"{name} is not installed on this machine; the agent carries it (scripts/bootstrap "
                               "installs it with the toolkit)")
        root = Path(spec.origin).parent
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(root)
            if rel.parts[0] not in VENDOR_SKIP:
                out["/".join(("vendor", name) + rel.parts)] = p.read_bytes()
    if out:
        out["vendor/__init__.py"] = b""
    return out


def sources(host_dir: Path = HOST_DIR) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(host_dir.glob("*.py"))} | vendored()


def build_from(files: dict[str, bytes]) -> Zipapp:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(files.items()):
            zi = zipfile.ZipInfo(f"{PACKAGE}/{name}", EPOCH)
            zi.external_attr = 0o100644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
    data = buf.getvalue()
    return Zipapp(data, hashlib.sha256(data).hexdigest())


_build_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _build() -> Zipapp:
    return build_from(sources())


def build() -> Zipapp:
    """The zipapp of this checkout's host package, built once per process: the first host thread to ask builds
    it, the others wait for that one (lru_cache alone let every thread of the pool build its own copy)."""
    with _build_lock:
        return _build()
