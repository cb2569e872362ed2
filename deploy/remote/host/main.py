"""The agent's entry point inside the zipapp: one request in, one envelope out (see envelope.py).

serve() is called by the loader once the state directory and the zipapp have been checked. It imports the op
modules (OP_MODULES), takes or checks the host lock for a mutating op, runs the op and replies; every failure
becomes one error reply with a kind. It then exits at once (os._exit): a command the deadline abandoned (a
driver call that cannot be killed) must not keep the agent alive.
"""
import importlib
import os
import signal
import sys

from . import locks
from .fsutil import Unsafe, describe
from .registry import OPS, Context, Failure

# Which module registers the ops of each area ("facts.probe" -> probe.py). Only the module of the op asked
# for is imported: a facts probe never loads tarfile or urllib. A new op: a function decorated with @op in one
# of these modules, or a new area here (one line); helper modules (dists.py, elfsyms.py) are imported by ops.
OP_MODULES = {"facts": "probe", "lock": "lockops", "provision": "provision", "release": "release", "smoke": "smoke",
              "bench": "bench"}


class PastDeadline(Exception):
    pass


def _past_deadline(signum, frame):
    raise PastDeadline("the op did not finish within its deadline")


def load_ops(name=None):
    area = (name or "").split(".", 1)[0]
    for m in [OP_MODULES[area]] if area in OP_MODULES else sorted(set(OP_MODULES.values())):
        importlib.import_module(__package__ + "." + m)
    return OPS


def handle(ctx):
    """Run ctx.req's op in `ctx`: lock handling, the op, the reply. Returns the final reply object."""
    req = ctx.req
    o = load_ops(req.get("op")).get(req.get("op"))
    acquired = None
    try:
        if o is None:
            raise Failure("unknown-op", "no op %r on this agent (ops: %s)" % (req.get("op"),
                                                                            ", ".join(sorted(load_ops()))))
        if o.mutating:
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a dropped SSH session must not stop a change half-way
            lk = ctx.lock
            if not lk or not lk.get("token"):
                raise Failure("no-lock", "%s changes the host and runs only under the host lock" % o.name)
            if lk.get("mode") == "once":
                got = locks.acquire(ctx.state, lk, agent_pid=os.getpid(), extend=ctx.deadline.left())
                if not got["ok"]:
                    raise Failure("locked", "host locked", holder=got["holder"])
                acquired = lk["token"]
                ctx.took_over = got.get("took_over")
            else:
                locks.check(ctx.state, lk["token"], extend=ctx.deadline.left())
        elif ctx.deadline.end is not None:
            # a read-only op ends at its deadline whatever it waits on (a change runs to its end or rollback)
            signal.signal(signal.SIGALRM, _past_deadline)
            signal.setitimer(signal.ITIMER_REAL, max(0.5, ctx.deadline.left() + 1.0))
        if o.mutating or (ctx.deadline.left() or 0) > 60:
            ctx.heartbeat()  # long calls say they are alive: the client tells a slow host from a dead link
        result = o.fn(ctx, req.get("args") or {})
        reply = {"type": "result", "result": result}
    except Failure as f:
        reply = dict(f.extra, type="error", kind=f.kind, error=str(f))
    except locks.LockLost as exc:
        reply = {"type": "error", "kind": "lock-lost", "error": str(exc), "holder": exc.current}
    except Unsafe as exc:
        reply = {"type": "error", "kind": "unsafe", "error": str(exc)}
    except PastDeadline as exc:
        reply = {"type": "error", "kind": "timeout", "error": str(exc)}
    except Exception as exc:  # reported with the host's name by the client; never a bare traceback
        import traceback
        reply = {"type": "error", "kind": "exception", "error": describe(exc),
                 "trace": traceback.format_exc()[-2000:]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        ctx.close()
        if acquired:
            locks.release(ctx.state, acquired)
    if not (o is not None and o.raw and reply["type"] == "result"):
        ctx.emit(reply)
    return reply


def serve(req, state):
    ctx = Context(req, state, stdout=sys.stderr if req.get("raw") else None)
    try:
        handle(ctx)
    finally:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os._exit(0)
