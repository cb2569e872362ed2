"""Run the real agent locally, as a host runs it: the loader in argv under the system python3 (stdlib only, -I -S),
the zipapp shipped into a private state directory, the request on stdin, the reply parsed from the envelope."""
from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

from deploy.remote import client, zipapp
from deploy.remote.host import envelope

SYSTEM_PYTHON = "/usr/bin/python3"


def call(op: str, args: dict | None, state: Path | str, lock: dict | None = None, data: bytes = b"",
         deadline: float = 300, env: dict | None = None, raw: bool = False) -> tuple[dict, list[dict], subprocess.CompletedProcess]:
    """(final reply, every reply, the process). The zipapp is sent along whenever the state dir lacks it."""
    app = zipapp.build()
    argv = client.loader_argv(str(state), app.sha256)
    argv[0] = SYSTEM_PYTHON
    held = (Path(state) / f"agent-{app.sha256}.pyz").exists()
    req = envelope.request_line(op, args, deadline, lock, ship=None if held else app.size, raw=raw)
    stdin = req.encode() + b"\n" + (b"" if held else app.data) + data
    p = subprocess.run(argv, input=stdin, capture_output=True, timeout=deadline + 30, env=env)
    out = (p.stderr if raw else p.stdout).decode("utf-8", "replace")
    replies = envelope.parse_output(out)
    if envelope.final(replies) and envelope.final(replies)["type"] == "ship":
        raise AssertionError("the loader asked for the zipapp it was sent")
    return envelope.final(replies) or {"type": "none", "stderr": p.stderr.decode()[-2000:]}, replies, p


def result(op: str, args: dict | None, state: Path | str, **kw) -> dict:
    """The op's result; fails the test on an error reply."""
    fin, _replies, p = call(op, args, state, **kw)
    assert fin.get("type") == "result", (fin, p.stderr.decode()[-2000:])
    return fin["result"]


def once(holder: str = "test") -> dict:
    """A lock request for one call."""
    return {"token": uuid.uuid4().hex, "holder": holder, "command": "pytest", "mode": "once"}
