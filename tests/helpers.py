"""Shared helpers for the deploy tests: inventories derived from inventory/lab.yaml and lab-host SSH."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import yaml
from labstate import CLEAN, ssh  # noqa: F401 (re-exported for the deploy tests)

ROOT = Path(__file__).resolve().parents[1]
from deploy.lab.fleet import lab_inventory_path  # noqa: E402

LAB_YAML = lab_inventory_path()  # inventory/lab.yaml, or this lab id's copy (DDTREE_LAB_ID)


def lab_inventory(tmp: Path, name: str = "lab.yaml", hosts: dict | None = None, vars: dict | None = None,
                  keep: list[str] | None = None) -> Path:
    """A copy of inventory/lab.yaml with `server: labserver`, only `keep` hosts, and per-host overrides."""
    doc = yaml.safe_load(LAB_YAML.read_text())
    doc["vars"] = dict(doc.get("vars") or {}, server="labserver", **(vars or {}))
    if keep is not None:
        doc["hosts"] = {h: v for h, v in doc["hosts"].items() if h in keep}
        doc["reference"] = keep[0]
        for g in (doc.get("groups") or {}).values():
            g["hosts"] = [h for h in g.get("hosts", []) if h in keep]
    for h, extra in (hosts or {}).items():
        doc["hosts"][h].update(extra)
    path = Path(tmp) / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def write_model(inv, host: str, path: str, config: dict) -> None:
    import json
    ssh(inv, host, f"mkdir -p {shlex.quote(path)} && printf %s {shlex.quote(json.dumps(config))} > "
                   f"{shlex.quote(path)}/config.json")


KEY = "Kx9fTq2LmZ7wP4sR8vB1nY6h"  # an API key of the accepted form, for the secrets tests


def public_dir(path: Path) -> Path:
    """A directory made 0755 whatever the umask (a root-owned /etc/ddtree-like parent of secrets files)."""
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    return path


def secret_file(d: Path, name: str, text: str, mode: int = 0o600) -> str:
    """A secrets file as an operator writes it: `text` in d/name, mode `mode` (a test loosens it on purpose)."""
    p = Path(d) / name
    p.write_text(text)
    os.chmod(p, mode)
    return str(p)


def strip_ansi(s: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", s)


def agent_call(inv, host: str, op: str, args: dict, **kw) -> dict:
    """One agent call on a lab host through the real client (root state directory)."""
    from deploy.remote.client import Remote
    from deploy.ssh import open_checked
    conn = open_checked(inv, inv.hosts[host])
    try:
        return Remote(conn, host).call(op, args, deadline=kw.pop("deadline", 60), **kw)
    finally:
        conn.close()


def host_lock(inv, host: str):
    return agent_call(inv, host, "lock.read", {})["lock"]
