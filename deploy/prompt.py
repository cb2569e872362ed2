"""The yes/no question before a change: Ctrl-C and end of input are a no, wherever the signal lands.

Python runs signal handlers in the main thread, but the kernel may deliver a terminal's SIGINT to any thread
that does not block it (a pool worker, an SSH transport thread). A main thread blocked in a plain read() on the
terminal then never returns to the interpreter and Ctrl-C is lost: the question hangs. So the answer is read
with select() in short slices; between slices the interpreter runs and a pending KeyboardInterrupt is raised.
"""
from __future__ import annotations

import select
import sys

NOT_CONFIRMED = "not confirmed: nothing changed, no host locked"


def ask_yes_no(question: str, stream_in=None, out=None, slice_s: float = 0.2) -> bool:
    """Ask `question [y/N]` on `out`, read one line from `stream_in`; only y/yes is a yes."""
    stream_in = sys.stdin if stream_in is None else stream_in
    out = sys.stderr if out is None else out
    out.write(f"{question} [y/N] ")
    out.flush()
    try:
        while True:
            ready, _, _ = select.select([stream_in], [], [], slice_s)
            if ready:
                line = stream_in.readline()
                if not line:
                    raise EOFError
                return line.strip().lower() in ("y", "yes")
    except (KeyboardInterrupt, EOFError):
        out.write(f"\n{NOT_CONFIRMED}\n")
        out.flush()
        return False
