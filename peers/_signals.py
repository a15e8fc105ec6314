"""SIGINT/SIGTERM as a clean shutdown: the first one sets an event, a second one interrupts at once.

A Python signal handler runs in the main thread between two bytecodes of whatever it was doing, and
it can run again inside itself when a second signal lands. So the handler here takes no lock. It used
to call ``threading.Event.set``, which takes the event's lock. A signal that landed while that lock was
held then waited on itself forever, and so did every later SIGTERM. The lock is held by the main
thread's own ``stop.wait(...)`` loop or by a first handler still inside ``set``. Instead, the handler
writes a byte to a pipe, and a watcher thread sets the event.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SIGNALLED = b"s"
_DONE = b"d"


def _set_when_signalled(wake: int, stop: threading.Event) -> None:
    """The watcher thread: set ``stop`` when the handler writes to ``wake``; end when told to."""
    while (byte := os.read(wake, 1)) and byte != _DONE:
        if byte == _SIGNALLED:
            stop.set()


@contextmanager
def shutdown_on_signals() -> Iterator[threading.Event]:
    """Turn the first SIGINT/SIGTERM into a set event (clean shutdown); a second one raises
    KeyboardInterrupt in the main thread, wherever it is.

    The event is set by a watcher thread a moment after the signal, not inside the handler (see the
    module docstring). Processes forked while the handler is installed (hivemind's DHT worker) inherit
    it. There it does nothing, because their owner shuts them down in order.
    """
    stop = threading.Event()
    owner_pid = os.getpid()
    received: list[int] = []  # list.append is one step: a nested handler cannot lose a signal
    wake_read, wake_write = os.pipe()
    watcher = threading.Thread(
        target=_set_when_signalled, args=(wake_read, stop), name="swarm-signals", daemon=True
    )

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner_pid:
            return
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt
        os.write(wake_write, _SIGNALLED)

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
