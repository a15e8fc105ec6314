"""Draw the next batch on a helper thread while the device computes the current step.

Batches are cut from token tensors on the CPU; on CUDA they are also copied into pinned (page-locked)
memory, from which the copy to the device runs asynchronously (``non_blocking=True``). The queue holds
at most ``depth`` batches, so the thread runs ahead by that much and no more.

``samples_drawn`` counts the samples handed to the consumer (not those waiting in the queue), so a
checkpoint taken while batches wait records only what was trained on; :meth:`Prefetcher.give_back`
returns the last batch handed out, like :meth:`swarm.learning.TrainBatches.give_back`, and it is
drawn again next.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch

from swarm.learning.evaluation import Interrupted

Batch = tuple[torch.Tensor, torch.Tensor]

_END = object()
WAIT_S = 0.1
"""How often a wait for the next batch looks at the stop event."""


class Prefetcher:
    """An iterator of ``(x, y)`` batches drawn from ``source`` on a background thread.

    Call :meth:`close` (or use it as a context manager) to stop the thread; it does not outlive that
    call by more than one draw of ``source`` (the call waits at most 5 s for it).
    """

    def __init__(self, source: Iterator[Batch], *, pin_memory: bool = False, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, not {depth}")
        self.source = source
        self.pin_memory = pin_memory
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._returned: Batch | None = None
        self._last: Batch | None = None
        self._done = False
        self.samples_drawn = int(getattr(source, "samples_drawn", 0))
        self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            for x, y in self.source:
                if self.pin_memory:
                    x, y = x.pin_memory(), y.pin_memory()
                if not self._put((x, y)):
                    return
        except BaseException as error:  # handed to the consumer, raised there
            self._put(error)
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        return self.draw()

    def draw(self, stop: threading.Event | None = None) -> Batch:
        """The next batch; a set ``stop`` (or :meth:`close`) ends the wait for a source that stalls
        (a streamed dataset that stopped answering): :class:`~swarm.learning.evaluation.Interrupted`,
        nothing handed out."""
        if self._returned is not None:
            batch, self._returned = self._returned, None
        else:
            batch = self._take(stop)
        self._last = batch
        self.samples_drawn += len(batch[0])
        return batch

    def _take(self, stop: threading.Event | None) -> Batch:
        if self._done or self._closed.is_set():
            raise StopIteration
        item = self._wait(stop)
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def _wait(self, stop: threading.Event | None) -> Any:
        while True:
            try:
                return self._queue.get(timeout=WAIT_S)
            except queue.Empty:
                pass
            if self._closed.is_set() or (stop is not None and stop.is_set()):
                self._last = None  # nothing handed out: a give_back() hands nothing out again
                raise Interrupted("waiting for a batch abandoned: stopping")

    def give_back(self) -> None:
        """The last batch handed out was not trained on: hand it out again next."""
        if self._last is not None:
            self._returned, self._last = self._last, None
            self.samples_drawn -= len(self._returned[0])

    def close(self) -> None:
        """Stop the thread and drop the batches it drew ahead."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
