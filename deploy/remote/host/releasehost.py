"""What one release.apply works on: its context (events, lock steps, deadline), its arguments, the host's release
root, state directory, venv and unit directory, and the one way it runs a command. The modules that change a
host's releases and services (releasedir.py, activation.py, unitfiles.py, routerunit.py, services.py,
rollback.py) each take a ReleaseHost."""
from .fsutil import free_bytes, size_text
from .proc import run


class ReleaseHost(object):
    """One apply on this host: the paths it works on, the commands it runs, the events it sends, and the GPUs it
    holds out of the router."""

    def __init__(self, ctx, a):
        self.ctx, self.a = ctx, a
        self.root, self.sdir, self.venv = a["root"], a["state_dir"], a["venv"]
        self.unit_dir = a.get("unit_dir") or "/etc/systemd/system"
        self.unit_file = a.get("unit_file") or "sglang-ddtree@.service"
        self.out = set()   # the GPUs this run holds out of the router (recorded in the lock)

    def run(self, argv, step, timeout=600, check=True):
        r = run(argv, max(5.0, self.ctx.deadline.left(cap=timeout, floor=5)))
        if check and r["rc"] != 0:
            text = (r["out"] + r["err"]).strip()
            raise RuntimeError("%s: %s exited %s: %s%s" % (step, " ".join(argv[:4]), r["rc"], text[-1500:],
                                                           self.space_note(text)))
        return r

    def space_note(self, text):
        """A command that ran out of space (pip's own OSError names no file): how much is free where this run
        writes (the venv, the releases)."""
        if "No space left on device" not in text and "Disk quota exceeded" not in text:
            return ""
        free = [f for f in (free_bytes(p) for p in (self.venv, self.root)) if f]
        return " (free: %s)" % ", ".join("%s on %s" % (size_text(f["free"]), f["path"]) for f in free)
