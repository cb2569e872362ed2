"""The one envelope every agent call speaks, on both sides (stdlib only: the control side imports it too).

Request: one JSON object {"op", "args", "deadline", "lock", "ship"} -- the first line of the agent's stdin, or
the loader's last argument when stdin carries bulk data (a wheel). Reply: lines `@@DDTREE@@ {json}` on stdout,
each with a "type":

  event   progress of a long op, printed by the client as it arrives
  hb      heartbeat: a long op is alive (every HEARTBEAT seconds; the client treats silence as a lost link)
  ship    the host does not hold the zipapp with the requested hash: send it after the request
  result  the op's answer {"result": ...}; the last line
  error   the op failed {"kind", "error", ...}; the last line

Other stdout (there should be none: every command's output is captured) is ignored.
"""
import json

from .loader import MARK

HEARTBEAT = 10.0
FINAL = ("result", "error", "ship")


def encode(obj):
    """One reply line."""
    return "\n" + MARK + json.dumps(obj, sort_keys=True, default=str) + "\n"


def request_line(op, args, deadline, lock=None, ship=None, raw=False):
    """The request: `ship` (the zipapp's size) when its bytes follow; `raw` when the op's stdout carries data."""
    req = {"op": op, "args": args or {}, "deadline": deadline}
    if lock:
        req["lock"] = lock
    if ship:
        req["ship"] = ship
    if raw:
        req["raw"] = True
    return json.dumps(req, sort_keys=True)


def parse_line(line):
    """The reply object on one line of output, or None for a line that is not part of the envelope."""
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    line = line.strip()
    if not line.startswith(MARK.strip()):
        return None
    try:
        obj = json.loads(line[len(MARK.strip()):])
    except ValueError:
        return None
    return obj if isinstance(obj, dict) and "type" in obj else None


def parse_output(text):
    """All reply objects in a whole output, in order (tests and one-shot readers)."""
    out = []
    for line in text.splitlines():
        obj = parse_line(line)
        if obj is not None:
            out.append(obj)
    return out


def final(objs):
    """The last final reply (result, error or ship) of a list of replies, or None."""
    for obj in reversed(objs):
        if obj.get("type") in FINAL:
            return obj
    return None
