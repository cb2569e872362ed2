"""Where a host keeps its releases, as the agent's release ops take it: one reader that rollout, status, smoke and
bench share (each asks `release.probe` with it), so none of them imports another for it."""
from __future__ import annotations

from ..inventory import Host
from . import render


def host_args(host: Host) -> dict:
    return {"root": host.vars["release_root"], "state_dir": render.state_dir(host), "venv": host.vars["venv"],
            "secrets_file": render.SECRETS_FILE}
