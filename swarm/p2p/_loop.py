"""A private event loop in a daemon thread: where a service's P2P replica and stream handlers live."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """Runs an event loop forever in a background thread; ``run`` is the blocking bridge into it."""

    def __init__(self, name: str) -> None:
        self.loop = _new_loop()
        self.loop.set_exception_handler(_quiet_cancellations)
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from any thread except the loop's)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is still running on the loop, stop it, and join the thread."""
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(Exception):  # best effort at shutdown
                self.run(_cancel_other_tasks(), timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def _quiet_cancellations(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Stream callbacks cancelled by our own shutdown are expected; report anything else as usual."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        logger.debug("cancelled at shutdown: %s", context.get("message"))
        return
    loop.default_exception_handler(context)


async def _cancel_other_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
