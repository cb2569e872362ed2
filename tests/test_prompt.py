"""The confirmation question (deploy/prompt.py): Ctrl-C is a no even when the signal lands on another thread."""
import io
import os
import signal
import threading
import time

from deploy.prompt import NOT_CONFIRMED, ask_yes_no


def _pipe_with(text: str):
    r, w = os.pipe()
    os.write(w, text.encode())
    os.close(w)
    return os.fdopen(r)


def test_answers():
    for text, want in (("y\n", True), ("yes\n", True), ("n\n", False), ("\n", False), ("maybe\n", False)):
        out = io.StringIO()
        assert ask_yes_no("go?", _pipe_with(text), out) is want
        assert out.getvalue().startswith("go? [y/N] ")


def test_end_of_input_is_a_no():
    out = io.StringIO()
    assert ask_yes_no("go?", _pipe_with(""), out) is False and NOT_CONFIRMED in out.getvalue()


def test_ctrl_c_delivered_to_another_thread_still_ends_the_question():
    """The kernel may hand a terminal's SIGINT to any thread; with a plain blocking read in the main thread
    the question would hang forever (what the lab's Ctrl-C test once caught under load)."""
    r, w = os.pipe()  # nobody ever answers
    stream = os.fdopen(r)

    def other_thread_gets_sigint():
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)

    t = threading.Thread(target=other_thread_gets_sigint)
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError("the question hung")))
    signal.alarm(10)
    try:
        t.start()
        out = io.StringIO()
        t0 = time.monotonic()
        assert ask_yes_no("go?", stream, out) is False
        assert time.monotonic() - t0 < 5 and NOT_CONFIRMED in out.getvalue()
    finally:
        signal.alarm(0)
        t.join()
        os.close(w)
