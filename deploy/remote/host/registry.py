"""The op registry and the context every op runs in.

An op is a function `fn(ctx, args) -> dict` registered with @op("area.name", mutating=...). A mutating op runs
only under the host lock (the runtime refuses it otherwise), checks the lock's token again before each of its
steps (ctx.step), survives its client going away (SIGHUP ignored, replies to a closed stdout dropped) and sends
heartbeats while it runs. A read-only op never takes the lock. A raw op writes bulk bytes to stdout itself
(no envelope after the data). Adding an op: a function here-registered in a module listed in main.OP_MODULES.
"""
import sys
import threading

from . import envelope, locks
from .proc import Deadline

OPS = {}


class Op(object):
    def __init__(self, name, fn, mutating, raw):
        self.name, self.fn, self.mutating, self.raw = name, fn, mutating, raw


def op(name, mutating=False, raw=False):
    def register(fn):
        if name in OPS:
            raise ValueError("op %s registered twice" % name)
        OPS[name] = Op(name, fn, mutating, raw)
        return fn
    return register


class Failure(Exception):
    """An op's own refusal: reported as an error with `kind`, and any extra fields."""

    def __init__(self, kind, message, **extra):
        Exception.__init__(self, message)
        self.kind, self.extra = kind, extra


class Context(object):
    def __init__(self, req, state, stdin=None, stdout=None):
        self.req = req
        self.state = state
        self.deadline = Deadline(req.get("deadline"))
        self.stdin = stdin if stdin is not None else sys.stdin.buffer
        self.stdout = stdout if stdout is not None else sys.stdout
        self.lock = req.get("lock") or None
        self.took_over = None          # the stale lock this call took over (the run that held it is dead)
        self.orphaned = False          # the client went away; the op carries on to its end
        self._out = threading.Lock()
        self._hb = None

    def emit(self, obj):
        if self.orphaned:
            return
        with self._out:
            try:
                self.stdout.write(envelope.encode(obj))
                self.stdout.flush()
            except (OSError, ValueError):
                self.orphaned = True

    def event(self, kind, **fields):
        self.emit(dict(fields, type="event", event=kind))

    def step(self, name, seconds=None):
        """Before a step of a mutating op: the lock must still be ours (locks.LockLost otherwise); its expiry
        is moved past the step's own deadline and the step is recorded in it."""
        if self.lock:
            locks.check(self.state, self.lock["token"], extend=(seconds or 0) + 60, step=name)

    def progress(self, **fields):
        """Record where the run is in the host lock (out: the GPUs it holds out of the router). A lock lost meanwhile
        is left to the next step's check: a batch half-way through still puts its GPUs back."""
        if self.lock:
            try:
                locks.check(self.state, self.lock["token"], renew=False, **fields)
            except locks.LockLost:
                pass

    def heartbeat(self, every=envelope.HEARTBEAT):
        stop = threading.Event()

        def beat():
            while not stop.wait(every):
                self.emit({"type": "hb"})
        self._hb = (stop, threading.Thread(target=beat, daemon=True))
        self._hb[1].start()

    def close(self):
        if self._hb:
            self._hb[0].set()
