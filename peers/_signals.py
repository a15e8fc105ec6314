"""SIGINT/SIGTERM: during start-up they end the program at once; while it runs, the first one is a
clean shutdown (an event is set) and a second one interrupts at once.

Start-up (:func:`install_startup_handler`, the first thing `swarm` does): from the first import on, a
signal writes one line (:data:`STARTUP_LINE`) and ends the program with :data:`EXIT_INTERRUPTED`.
Before the command runs (imports) it exits on the spot; once the command runs (:func:`enter_command`)
it raises KeyboardInterrupt, so the ``with`` blocks on the way out close what start-up opened (the
DHT and its daemon), and typer turns it into exit 130 with no traceback. A second signal while that
unwinds exits on the spot.

Running (:func:`shutdown_on_signals`, around the loop that watches the event): a Python signal
handler runs in the main thread between two bytecodes of whatever it was doing, and it can run again
inside itself when a second signal lands. So the handler here takes no lock. It used to call
``threading.Event.set``, which takes the event's lock. A signal that landed while that lock was held
then waited on itself forever, and so did every later SIGTERM. The lock is held by the main thread's
own ``stop.wait(...)`` loop or by a first handler still inside ``set``. Instead, the handler writes a
byte to a pipe, and a watcher thread sets the event. For the same reason every line a handler prints
goes straight to file descriptor 2 (``sys.stderr.write`` would re-enter the stream's lock).

A start-up interrupt is raised between two bytecodes of whatever the main thread runs, so it can be
lost: raised into an at-fork hook, a finalizer or a callback whose errors Python only prints ("Exception
ignored in ..."). Raised into logging's or threading's own lock handling (logging's at-fork hook runs
right after hivemind forks its DHT worker), it would leave a lock held that the next log line waits on
forever. So the handler never raises there, and start-up never relies on the raise alone: the handler
marks the event (:attr:`ShutdownEvent.interrupted`) before anything else, and each boundary between two
start-up phases (:func:`end_if_stopped`, :func:`mark_started`) ends the program if it is marked.

Processes forked while a handler is installed (hivemind's DHT worker) inherit it; there it does
nothing, because their owner shuts them down in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
EXIT_INTERRUPTED = 130
"""The exit status of a program interrupted before it ran (128 + SIGINT, the shell's convention)."""
STARTUP_LINE = "swarm: interrupted, exiting"
AGAIN_LINE = "swarm: interrupted again, exiting at once"
_SIGNALLED = b"s"
_DONE = b"d"
_HOLDS_LOCKS = frozenset({logging.__file__, threading.__file__})
"""Where a start-up interrupt is never raised: these modules' lock handling is not interrupt-safe."""


class _Startup:
    """The start-up handler's state: whose it is, whether the command runs yet, how many signals."""

    owner_pid = 0
    in_command = False
    received = 0


def launched_as_program(module_name: str) -> bool:
    """Whether this process is the ``swarm`` program (the console script, or ``python -m peers.cli``
    when ``module_name`` is ``__main__``), not a test or a script that imports the CLI."""
    main = sys.modules.get("__main__")
    return module_name == "__main__" or Path(getattr(main, "__file__", None) or "").name == "swarm"


def install_startup_handler() -> None:
    """From now on a SIGINT/SIGTERM ends start-up at once, with one line and no traceback (see the
    module docstring). Call it before anything slow is imported."""
    _Startup.owner_pid, _Startup.in_command, _Startup.received = os.getpid(), False, 0
    for signum in SIGNALS:
        signal.signal(signum, _startup_handler)


def enter_command() -> None:
    """The command runs: a start-up signal now unwinds it (KeyboardInterrupt) instead of exiting."""
    _Startup.in_command = True


def _startup_handler(signum: int, frame: FrameType | None) -> None:
    if os.getpid() != _Startup.owner_pid:
        return
    _Startup.received += 1
    if _Startup.received == 1:
        _say(STARTUP_LINE)
    if not _Startup.in_command or _Startup.received > 1:
        os._exit(EXIT_INTERRUPTED)  # imports only, or the unwinding was interrupted: nothing else to do
    raise KeyboardInterrupt


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # stderr closed: the line is lost, the signal still counts
        os.write(2, (line + "\n").encode())


class ShutdownEvent(threading.Event):
    """The event a first signal sets. While ``starting``, that signal also interrupts the start-up at
    once (KeyboardInterrupt), wherever it is: nobody waits for a DHT to come up, or imports to end,
    only to leave. The program calls :func:`mark_started` where a clean shutdown starts to matter."""

    def __init__(self, starting: bool = False):
        super().__init__()
        self.starting = starting
        self.interrupted = False
        """A signal came while starting. Set in the handler itself (a plain attribute: no lock), so a
        boundary sees it even before the watcher thread sets the event, and when the raise was lost."""


def mark_started(stop: threading.Event) -> None:
    """Start-up is over: from now on a first signal only sets ``stop`` (a clean shutdown). A signal
    that came during start-up, and whose interrupt was lost, ends the program here instead."""
    end_if_stopped(stop)
    if isinstance(stop, ShutdownEvent):
        stop.starting = False


def end_if_stopped(stop: threading.Event) -> None:
    """A point between two start-up phases: if a signal already asked to stop, end the program here
    (KeyboardInterrupt: the ``with`` blocks close what is open, typer exits 130) instead of starting
    the next phase, and so on to a run nobody wants."""
    if stop.is_set() or getattr(stop, "interrupted", False):
        raise KeyboardInterrupt


def _set_when_signalled(wake: int, stop: threading.Event) -> None:
    """The watcher thread: set ``stop`` when the handler writes to ``wake``; end when told to."""
    while (byte := os.read(wake, 1)) and byte != _DONE:
        if byte == _SIGNALLED:
            stop.set()


@contextmanager
def shutdown_on_signals(acknowledge: str | None = None, *, starting: bool = False) -> Iterator[ShutdownEvent]:
    """Turn the first SIGINT/SIGTERM into a set event (clean shutdown); a second one raises
    KeyboardInterrupt in the main thread, wherever it is. ``acknowledge``: a line printed (stderr) the
    moment the first signal lands. ``starting``: until :func:`mark_started`, the first signal raises
    KeyboardInterrupt as well (start-up is interrupted, not finished; see :class:`ShutdownEvent`).

    The event is set by a watcher thread a moment after the signal, not inside the handler (see the
    module docstring). Leaving restores the handlers that were there before (the start-up one).
    """
    stop = ShutdownEvent(starting)
    owner_pid = os.getpid()
    received: list[int] = []  # list.append is one step: a nested handler cannot lose a signal
    wake_read, wake_write = os.pipe()
    watcher = threading.Thread(
        target=_set_when_signalled, args=(wake_read, stop), name="swarm-signals", daemon=True
    )

    def handler(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != owner_pid:
            return
        received.append(signum)
        if len(received) > 1:
            _say(AGAIN_LINE)
            raise KeyboardInterrupt
        os.write(wake_write, _SIGNALLED)
        if acknowledge:
            _say(acknowledge)
        if stop.starting:
            stop.interrupted = True
            if frame is None or frame.f_code.co_filename not in _HOLDS_LOCKS:
                raise KeyboardInterrupt  # else the next start-up boundary ends the program

    watcher.start()
    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield stop
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
        os.write(wake_write, _DONE)
        watcher.join()
        os.close(wake_read)
        os.close(wake_write)
