"""Running commands on the host: every command has a deadline and runs in its own process group, which is
killed whole (children included) when the deadline passes. A command that cannot be killed (a driver call in
uninterruptible sleep) is abandoned after a short grace, never waited for."""
import os
import signal
import subprocess
import threading
import time

GRACE = 2.0


class Deadline(object):
    """A point in time (monotonic) that every step of one call shares."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds if seconds else None

    def left(self, cap=None, floor=0.0):
        if self.end is None:
            return cap
        left = max(floor, self.end - time.monotonic())
        return min(left, cap) if cap is not None else left

    def expired(self):
        return self.end is not None and time.monotonic() >= self.end


def kill_group(p):
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run(argv, timeout, input=None, env=None, cwd=None, merge=True, cap=6000):
    """Run `argv` with a deadline; returns {argv, rc, out, err, seconds, timed_out}. rc is None when the program
    does not exist or was killed at the deadline. Output is captured (the last `cap` characters kept)."""
    t0 = time.monotonic()
    res = {"argv": list(argv), "rc": None, "out": "", "err": "", "timed_out": False}
    try:
        p = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                             env=env, cwd=cwd, start_new_session=True, universal_newlines=True,
                             errors="replace")
    except (FileNotFoundError, PermissionError) as exc:
        res.update(err=str(exc), missing=True, seconds=0.0)
        return res
    try:
        out, err = p.communicate(input, timeout=timeout)
        res["rc"] = p.returncode
    except subprocess.TimeoutExpired:
        kill_group(p)
        res["timed_out"] = True
        try:
            out, err = p.communicate(timeout=GRACE)
        except subprocess.TimeoutExpired:  # unkillable (D state): leave it, never wait on it
            out, err = "", ""
        res["err"] = "timed out after %.0fs (process group killed)" % timeout
    except BaseException:  # the op's own deadline (or anything else) interrupted us: leave nothing running
        kill_group(p)
        raise
    res["out"] = (out or "")[-cap:]
    if err:
        res["err"] = ((res["err"] + "; ") if res["err"] else "") + err[-cap:]
    res["seconds"] = round(time.monotonic() - t0, 3)
    return res


def run_all(jobs, deadline):
    """Run several commands at once, each under the one shared deadline: {key: run() result}. Used by the
    probe so a hung command costs one deadline, not one per command."""
    out = {}

    def one(key, argv):
        out[key] = run(argv, max(0.1, deadline.left(floor=0.1)))

    threads = [threading.Thread(target=one, args=(k, a), daemon=True) for k, a in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline.left(floor=0.0) + GRACE + 1 if deadline.end else None)
    for k in jobs:
        out.setdefault(k, {"argv": list(jobs[k]), "rc": None, "out": "", "err": "did not finish", "timed_out": True})
    return out
