"""The host lock: one per host, in the agent's private state directory, shared by every run that changes the
host (provision, deploy, rollback, restart). It names its holder and carries a token and an expiry.

  mode "once"  taken for the length of one agent call and released at its end (deploy, rollback, restart,
               undo, build): it lives exactly as long as the agent process that took it, so a lock whose
               agent process is gone is stale, whatever its expiry says.
  mode "held"  taken by `lock.acquire` for a run of several calls (provision: uploads, then apply); every call
               presents the token, which renews the expiry; a run that stops calling lets it expire.

Before each step, a run re-checks that the lock still carries its token (LockLost otherwise: someone broke it),
so a run whose lock was broken stops instead of racing the run that broke it. Every change of the lock file
happens under a flock on a mutex file beside it.
"""
import fcntl
import json
import os
import time

from .fsutil import append_jsonl, atomic_write, now_iso, read_json

LOCK = "lock.json"
MUTEX = "lock.mutex"
DEFAULT_TTL = 120.0


class LockLost(RuntimeError):
    def __init__(self, token, current):
        self.current = current
        who = "nobody (it was removed)" if not current else "%s running %r" % (current.get("holder"),
                                                                               current.get("command"))
        super(LockLost, self).__init__("this run's host lock (token %s...) is gone; the lock is now held by %s"
                                       % (token[:8], who))


class _Mutex(object):
    def __init__(self, state):
        self.fd = os.open(os.path.join(state, MUTEX), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def _proc_start(pid):
    """The start time of process `pid` (clock ticks since boot), or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % pid) as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def read(state):
    return read_json(os.path.join(state, LOCK))


def stale(cur, now=None):
    """Why the lock `cur` no longer protects anything, or None while it does."""
    now = time.time() if now is None else now
    if cur.get("expires_ts") is not None and cur["expires_ts"] < now:
        return "expired %s" % time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(cur["expires_ts"]))
    agent = cur.get("agent") or {}
    if agent.get("pid") and _proc_start(agent["pid"]) != agent.get("start"):
        return "its agent process %d is gone" % agent["pid"]
    return None


def _write(state, lock):
    atomic_write(os.path.join(state, LOCK), json.dumps(lock, sort_keys=True).encode(), 0o600)


def _journal(req, state, entry):
    path = req.get("journal") or os.path.join(state, "journal.jsonl")
    try:
        append_jsonl(path, dict(entry, time=now_iso()))
    except OSError:
        pass


def acquire(state, req, agent_pid=None, extend=None):
    """Take the lock for `req` {token, holder, command, pid, ttl, break, journal}. Returns {"ok": True, "lock"} or
    {"ok": False, "holder": the current lock}. A stale lock is taken over and a broken one (req["break"]) removed,
    both journaled."""
    now = time.time()
    ttl = float(req.get("ttl") or DEFAULT_TTL)
    with _Mutex(state):
        cur = read(state)
        if cur and cur.get("token") == req["token"]:
            return {"ok": True, "lock": cur}
        if cur:
            why = stale(cur, now)
            if req.get("break"):
                _journal(req, state, {"event": "break-lock", "broken": cur, "by": req.get("holder")})
            elif why:
                _journal(req, state, {"event": "stale-lock", "why": why, "stale": cur, "by": req.get("holder")})
            else:
                return {"ok": False, "holder": cur}
        lock = {"holder": req.get("holder"), "command": req.get("command"), "pid": req.get("pid"),
                "token": req["token"], "started": now_iso(), "started_ts": now, "ttl": ttl,
                "expires_ts": now + max(ttl, extend or 0)}
        if agent_pid:
            lock["agent"] = {"pid": agent_pid, "start": _proc_start(agent_pid)}
        _write(state, lock)
        return {"ok": True, "lock": lock, "took_over": cur}


def check(state, token, extend=None, renew=True, **progress):
    """The lock must still carry `token` (LockLost otherwise); its expiry moves to now + max(ttl, extend).
    `progress` (step: the step the run begins, out: the GPUs it holds out of the router) is recorded in the lock,
    so that a run finding the lock of a run that died says where that run stopped (renew=False: the expiry
    stays)."""
    with _Mutex(state):
        cur = read(state)
        if not cur or cur.get("token") != token:
            raise LockLost(token, cur)
        ttl = float(cur.get("ttl") or DEFAULT_TTL)
        if renew:
            cur["expires_ts"] = time.time() + max(ttl, extend or 0)
        for k, v in progress.items():
            if v is not None:
                cur[k] = v
        if progress.get("step"):
            cur["step_at"] = now_iso()
        _write(state, cur)
        return cur


def interrupted(cur):
    """What a lock taken over says about the run that held it, when that run died part-way through a change (it
    had begun a step): {holder, command, started, step, step_at, out, token}; None otherwise."""
    if not cur or not cur.get("step") or cur.get("step") == "done":
        return None
    return dict((k, cur.get(k)) for k in ("holder", "command", "started", "step", "step_at", "out", "token"))


def release(state, token):
    with _Mutex(state):
        cur = read(state)
        if cur and cur.get("token") == token:
            os.unlink(os.path.join(state, LOCK))
            return True
        return False
