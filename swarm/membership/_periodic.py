"""A task that runs once now and then every few seconds in a daemon thread, until stopped."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


class PeriodicTask:
    """Calls ``action`` synchronously on :meth:`start`, then every ``interval_s`` until :meth:`stop`.

    The first call is synchronous so that what it publishes is visible when ``start`` returns; later
    failures are logged and the loop goes on (a DHT hiccup must not end a peer's announcements).
    """

    def __init__(self, action: Callable[[], object], interval_s: float, name: str):
        self._action, self._interval_s, self._name = action, interval_s, name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> object:
        result = self._action()
        self._thread.start()
        return result

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._interval_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._action()
            except Exception:
                logger.exception("%s failed", self._name)
