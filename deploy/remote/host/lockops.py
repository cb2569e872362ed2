"""The host lock as ops, for runs of several calls (provision: acquire, upload, apply, release). A call that
presents the token with mode "held" renews it; see locks.py for the rules."""
import os

from . import locks
from .registry import Failure, op


@op("lock.acquire")
def acquire(ctx, a):
    got = locks.acquire(ctx.state, a)
    if not got["ok"]:
        raise Failure("locked", "host locked", holder=got["holder"])
    return got


@op("lock.release")
def release(ctx, a):
    return {"released": locks.release(ctx.state, a["token"])}


@op("lock.read")
def read(ctx, a):
    cur = locks.read(ctx.state)
    return {"lock": cur, "stale": locks.stale(cur) if cur else None, "agent_pid": os.getpid()}
