"""Build a release locally: the plugin wheel from `overlays/<package>/` with the release id in its version,
guarded file overlays, and the per-host bundle (manifest + wheel + unit + env files + helpers) as a tarball.

The mechanism does not look inside the plugin: it copies the project, rewrites `version` in its
pyproject.toml to `<base>+<release-local-label>`, builds with pip (offline, no build isolation) and reads
`*/capabilities.json` from the wheel if there is one.
"""
from __future__ import annotations

import functools
import getpass
import hashlib
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import contract, values
from ..inventory import Host
from . import render
from . import router as routermod

REPO = render.REPO
DEFAULT_PLUGIN_DIR = REPO / "overlays" / "sglang-ddtree"
DEFAULT_OVERLAY_SPEC = REPO / "overlays" / "file-overlays.yaml"
LABSERVER = REPO / "deploy" / "labserver" / "server.py"
WAIT_READY = Path(__file__).parent / "wait_ready.py"
SERVER_SECRETS = REPO / "deploy" / "remote" / "host" / "server_secrets.py"  # also the agent's own check
SITECUSTOMIZE = Path(__file__).parent / "sitecustomize.py"  # masks the API key in the service's logs
SKIP_DIRS = {"__pycache__", "build", "dist", ".pytest_cache", ".git"}


class BuildError(RuntimeError):
    pass


def new_release_id(now: float | None = None, salt: str = "") -> str:
    """`20251129T083000Z-1a2b3c`: sortable by time, unique per build."""
    t = time.gmtime(now if now is not None else time.time())
    h = hashlib.sha256(f"{time.time_ns()}{os.getpid()}{salt}".encode()).hexdigest()[:6]
    return time.strftime("%Y%m%dT%H%M%SZ", t) + "-" + h


def local_version_label(release_id: str) -> str:
    """PEP 440 local label for a release id: lower-case alphanumerics joined by dots."""
    return "r" + ".".join(p for p in re.split(r"[^a-z0-9]+", release_id.lower()) if p)


def tree_digest(root: Path) -> str:
    """sha256 over a source tree's relative paths and contents (build outputs and egg-info skipped)."""
    h = hashlib.sha256()
    for p in sorted(_source_files(root)):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _source_files(root: Path):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        for f in filenames:
            if not f.endswith((".pyc", ".pyo")):
                yield Path(dirpath) / f


def set_pyproject_version(text: str, version: str) -> tuple[str, str]:
    """Rewrite `version = "..."` in the [project] table; returns (new text, old version)."""
    m = re.search(r'(?ms)^\[project\]\s*$(.*?)(?=^\[|\Z)', text)
    if not m:
        raise BuildError("pyproject.toml has no [project] table")
    body = m.group(1)
    vm = re.search(r'(?m)^version[ \t]*=[ \t]*"([^"]+)"[ \t]*$', body)
    if not vm:
        raise BuildError('pyproject.toml [project] has no static `version = "..."` line')
    new_body = body[:vm.start()] + f'version = "{version}"' + body[vm.end():]
    return text[:m.start(1)] + new_body + text[m.end(1):], vm.group(1)


@dataclass
class Plugin:
    dist: str
    version: str
    wheel: Path
    source_digest: str
    capabilities: dict = field(default_factory=dict)


def build_plugin(release_id: str, src: Path = DEFAULT_PLUGIN_DIR, out_dir: Path | None = None) -> Plugin:
    """Build the plugin wheel with `+<release label>` appended to its version (offline)."""
    src = Path(src)
    if not (src / "pyproject.toml").exists():
        raise BuildError(f"{src}: no pyproject.toml (the plugin project to build)")
    out_dir = Path(out_dir or tempfile.mkdtemp(prefix="ddtree-wheel-")).resolve()  # the build runs elsewhere
    with tempfile.TemporaryDirectory(prefix="ddtree-build-") as tmp:
        work = Path(tmp) / src.name
        shutil.copytree(src, work, ignore=lambda d, names: [n for n in names if n in SKIP_DIRS
                                                             or n.endswith(".egg-info")])
        text, base = set_pyproject_version((work / "pyproject.toml").read_text(), "0")
        base = base.split("+")[0]
        version = f"{base}+{local_version_label(release_id)}"
        (work / "pyproject.toml").write_text(set_pyproject_version(text, version)[0])
        cmd = wheel_build_argv(sys.executable, work, out_dir)
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if r.returncode != 0:
            raise BuildError(f"wheel build failed ({' '.join(cmd)}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    wheels = sorted(out_dir.glob("*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise BuildError(f"wheel build produced nothing in {out_dir}")
    wheel = wheels[-1]
    dist, wversion = wheel_name_version(wheel)
    return Plugin(dist, wversion, wheel, tree_digest(src), read_capabilities(wheel))


def wheel_build_argv(python: str, project: Path, out_dir: Path) -> list[str]:
    return [python, "-m", "pip", "wheel", "--no-deps", "--no-index", "--no-build-isolation", "--quiet",
            "--wheel-dir", str(out_dir), str(project)]


def wheel_name_version(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return name.replace("_", "-"), version


def read_capabilities(wheel: Path) -> dict:
    """`<pkg>/capabilities.json` from the wheel (no import of the plugin or SGLang); {} if absent."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith("/capabilities.json")]
        if not names:
            return {}
        try:
            return json.loads(z.read(names[0]))
        except ValueError as exc:
            raise BuildError(f"{wheel.name}: {names[0]} is not valid JSON: {exc}") from None


# ---------------------------------------------------------------- guarded file overlays

OVERLAY_KEYS = {"package", "version", "path", "sha256", "source"}


def load_overlay_spec(path: Path | None = DEFAULT_OVERLAY_SPEC) -> list[dict]:
    """File overlays: each replaces `path` (relative to site-packages) of `package==version`, only if the file
    on the host has `sha256`; `source` is the patched file (relative to the spec). Missing spec: none."""
    if path is None or not Path(path).exists():
        return []
    doc = yaml.safe_load(Path(path).read_text()) or []
    if not isinstance(doc, list):
        raise BuildError(f"{path}: must be a list of overlays")
    out = []
    for i, o in enumerate(doc):
        if not isinstance(o, dict) or set(o) != OVERLAY_KEYS:
            raise BuildError(f"{path}: overlay {i}: needs exactly the keys {sorted(OVERLAY_KEYS)}")
        if not re.fullmatch(r"[0-9a-f]{64}", str(o["sha256"])):
            raise BuildError(f"{path}: overlay {i}: sha256 must be 64 hex digits")
        if o["path"].startswith("/") or ".." in Path(o["path"]).parts:
            raise BuildError(f"{path}: overlay {i}: path must be relative to site-packages")
        src = (Path(path).parent / o["source"]).resolve()
        if not src.is_file():
            raise BuildError(f"{path}: overlay {i}: source {src} does not exist")
        data = src.read_bytes()
        out.append({"package": o["package"], "version": str(o["version"]), "path": o["path"],
                    "sha256": o["sha256"], "new_sha256": hashlib.sha256(data).hexdigest(), "data": data})
    return out


# ---------------------------------------------------------------- the per-host bundle

@functools.lru_cache(maxsize=1)  # one checkout per run: asked once, not once per host's manifest
def _git_commit() -> tuple[str, bool]:
    def git(*a):  # a checkout without git (a copied tree, a control machine without it): commit "none"
        try:
            r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=60)
        except OSError:
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""
    return git("rev-parse", "HEAD") or "none", bool(git("status", "--porcelain"))


def git_commit() -> dict:
    commit, dirty = _git_commit()
    return {"commit": commit, "dirty": dirty}


def host_files(host: Host, plugin: Plugin, overlays: list[dict]) -> tuple[dict[str, bytes], dict]:
    """Relative path -> bytes for everything in this host's release, and the per-service records."""
    payload = hashlib.sha256((plugin.source_digest + "".join(o["new_sha256"] + o["path"] for o in overlays)
                              + (render.sha256(LABSERVER.read_bytes()) if host.vars.get("server") == "labserver"
                                 else "")).encode()).hexdigest()
    unit = render.render_unit(host)
    files: dict[str, bytes] = {f"systemd/{render.UNIT_FILE}": unit.encode(),
                               f"wheels/{plugin.wheel.name}": plugin.wheel.read_bytes(),
                               "bin/wait_ready.py": WAIT_READY.read_bytes(),
                               "bin/server_secrets.py": SERVER_SECRETS.read_bytes(),
                               "site/sitecustomize.py": SITECUSTOMIZE.read_bytes()}
    if host.vars.get("server") == "labserver":
        files["labserver/server.py"] = LABSERVER.read_bytes()
    for o in overlays:
        files[f"overlays/new/{o['path']}"] = o["data"]
    router = {"enabled": False}
    if routermod.enabled(host):
        try:
            w = routermod.wheel()
        except routermod.RouterError as exc:
            raise render.RenderError(f"{host.name}: router: {exc}") from None
        rfiles = routermod.files(host, w)
        files.update(rfiles)
        router = routermod.manifest_entry(host, w, rfiles)
    services = {}
    for s in host.services:
        env = render.render_env(s, plugin.capabilities, payload)
        dropin = render.render_dropin(s, routermod.settings(host)["drain_timeout"])
        files[f"env/{s.instance}.env"] = env.encode()
        files[f"systemd/{render.dropin_path(s.instance)}"] = dropin.encode()
        services[s.instance] = {
            "gpu": s.gpu, "gpus": list(s.gpus), "tp": s.tp, "port": s.port, "unit": render.unit_name(s.instance),
            "enabled": s.enabled, "mode": s.mode, "algorithm": render.ALGORITHM[s.mode],
            "budget": s.budget if type(s.budget) is int else contract.budget_text(s.budget), "block_size": s.block_size,
            "model": s.model, "draft_model": s.draft_model, "served_model_name": s.served_model_name,
            # how the gate and status reach it from the host itself; the key file's path (never the key)
            "listen": s.listen, "address": values.connect_address(s.listen),
            "api_key_file": host.vars.get("api_key_file"), "dropin": render.dropin_path(s.instance),
            "auto": s.auto,  # mode auto: what bench measured (None: the inventory's own mode)
            "digest": render.service_digest(unit, env, payload, dropin)}
    return files, {"services": services, "payload_digest": payload, "router": router}


def make_manifest(release_id: str, host: Host, plugin: Plugin, overlays: list[dict], files: dict[str, bytes],
                  svc: dict, command: str, params: dict) -> dict:
    router = svc.get("router") or {"enabled": False}
    content = render.sha256("\0".join(sorted(f"{k}={v['digest']}" for k, v in svc["services"].items()))
                            + svc["payload_digest"] + (router.get("digest") or ""))
    return {
        "release": release_id, "host": host.name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "created_by": f"{getpass.getuser()}@{socket.gethostname()}", "toolkit": git_commit(), "command": command,
        "params": params,
        "plugin": {"dist": plugin.dist, "version": plugin.version, "wheel": f"wheels/{plugin.wheel.name}",
                   "source_digest": plugin.source_digest, "capabilities": plugin.capabilities},
        "overlays": [{k: o[k] for k in ("package", "version", "path", "sha256", "new_sha256")} for o in overlays],
        "services": svc["services"], "router": router, "payload_digest": svc["payload_digest"],
        "content_digest": content,
        "files": {k: hashlib.sha256(v).hexdigest() for k, v in sorted(files.items())},
        "venv": host.vars["venv"], "service_user": host.vars["service_user"], "server": host.vars.get("server"),
        "allow_hybrid_unsafe": False, "unsafe": {},
    }


def bundle(release_id: str, files: dict[str, bytes], manifest: dict) -> bytes:
    """A gzip tarball `<release_id>/...` with every file and manifest.json (mode 0644, dirs 0755)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        items = dict(files)
        items["manifest.json"] = json.dumps(manifest, indent=1, sort_keys=True).encode()
        for rel, data in sorted(items.items()):
            ti = tarfile.TarInfo(f"{release_id}/{rel}")
            ti.size, ti.mode, ti.mtime = len(data), 0o644, int(time.time())
            tar.addfile(ti, io.BytesIO(data))
    return buf.getvalue()
