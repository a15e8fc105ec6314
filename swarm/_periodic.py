"""Background threads of a peer: a task run every few seconds (:class:`PeriodicTask`), and a watcher
that calls an action as soon as a stop event is set (:func:`calling_on`)."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)


class PeriodicTask:
    """Calls ``action`` synchronously on :meth:`start`, then every ``interval_s`` until :meth:`stop`.

    The first call is synchronous so that what it publishes is visible when ``start`` returns; later
    failures are logged and the loop goes on (a DHT hiccup must not end a peer's announcements).
    """

    def __init__(self, action: Callable[[], object], interval_s: float, name: str):
        self._action, self._interval_s, self._name = action, interval_s, name
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> object:
        result = self._action()
        self._thread.start()
        return result

    def trigger(self) -> None:
        """Run the action on the task's thread as soon as it is free, without waiting for it (the
        interval restarts from there). Triggers that arrive while it runs make one more call."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval_s + 5)

    def _run(self) -> None:
        while True:
            self._wake.wait(self._interval_s)
            if self._stop.is_set():
                return
            self._wake.clear()
            try:
                self._action()
            except Exception:
                logger.exception("%s failed", self._name)


@contextlib.contextmanager
def calling_on(stop: threading.Event, action: Callable[[], object], period_s: float = 0.5) -> Iterator[None]:
    """While inside, a watcher thread calls ``action`` once as soon as ``stop`` is set; for aborting
    the blocking work inside (a stalled partner must not hold a shutdown past its grace period)."""
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            if stop.wait(period_s):
                action()
                return

    watcher = threading.Thread(target=watch, name="abort-on-stop", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()
