"""peers._signals: the first SIGINT/SIGTERM sets the shutdown event, a second interrupts at once, and
neither can hang the process.

Each case runs in its own interpreter, because a handler that deadlocks hangs the process it runs in,
and signals reach only the main thread. The old handler called ``Event.set`` and so took the event's
lock. A signal that landed while that lock was held (the main thread inside ``stop.wait``, or a first
handler still inside ``set``) then waited on itself forever. These cases hold that lock on purpose:
against the old handler they hang, and hit the deadline.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HANG_S = 60.0  # a deadline for a hang, not synchronisation: each case takes well under a second

PRELUDE = """
import signal, threading
from peers._signals import shutdown_on_signals

def watchers():
    return [t for t in threading.enumerate() if t.name == "swarm-signals"]

original = signal.getsignal(signal.SIGTERM)
"""


def _run(body: str) -> list[str]:
    """Run ``body`` after PRELUDE in a fresh interpreter; return what it printed, line by line."""
    script = PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_sets_the_event_and_leaving_restores_the_handlers(signum: str) -> None:
    printed = _run(f"""
        with shutdown_on_signals() as stop:
            print("before", stop.is_set(), len(watchers()))
            signal.raise_signal(signal.{signum})
            print("after", stop.wait({HANG_S}))
        print("left", signal.getsignal(signal.SIGTERM) is original, len(watchers()))
    """)
    assert printed == ["before", "False", "1", "after", "True", "left", "True", "0"]


def test_a_signal_while_the_main_thread_holds_the_events_lock_still_sets_it() -> None:
    """The main thread of `while not stop.wait(1.0)` holds the event's lock for a moment on every
    call: a signal landing there must not wait on it."""
    printed = _run(f"""
        with shutdown_on_signals() as stop:
            with stop._cond:  # the lock Event.wait and Event.set take
                signal.raise_signal(signal.SIGTERM)
                print("handled")
            print("set", stop.wait({HANG_S}))
    """)
    assert printed == ["handled", "set", "True"]


def test_a_second_signal_before_the_event_is_set_interrupts_at_once() -> None:
    """The window where a first handler is still setting the event: the second signal must raise
    KeyboardInterrupt there, not wait for the first."""
    printed = _run("""
        try:
            with shutdown_on_signals() as stop:
                with stop._cond:
                    signal.raise_signal(signal.SIGTERM)
                    signal.raise_signal(signal.SIGTERM)
                    print("not-interrupted")
        except KeyboardInterrupt:
            print("interrupted")
        print("left", signal.getsignal(signal.SIGTERM) is original, len(watchers()))
    """)
    assert printed == ["interrupted", "left", "True", "0"]


def test_a_forked_child_ignores_the_handler_it_inherits() -> None:
    """hivemind's DHT worker is forked while the handler is installed; its owner shuts it down."""
    printed = _run("""
        import os
        with shutdown_on_signals() as stop:
            pid = os.fork()
            if pid == 0:
                signal.raise_signal(signal.SIGTERM)
                signal.raise_signal(signal.SIGTERM)  # would raise KeyboardInterrupt in the owner
                os._exit(7)
            _, status = os.waitpid(pid, 0)
        # leaving joins the watcher after it read every byte written before: a byte from the child too
        print("child", os.waitstatus_to_exitcode(status), "owner", stop.is_set())
    """)
    assert printed == ["child", "7", "owner", "False"]
