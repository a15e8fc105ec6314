"""PhaseTimers: where a trainer's training loop spends its wall time, measured by the loop itself.

A peer's summary reports the totals (``phase_seconds``), and the benchmarks read them there: the
split is the library's own number, not something a benchmark patches into private functions.
Phases nest, and each second is booked once, to the innermost phase open at the time: an evaluation
inside a round's booking counts as ``evaluate``, not also as the round's ``sync``. Only the thread
that opened the loop (:meth:`PhaseTimers.loop`) books; calls from other threads are not timed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PHASES = ("device", "step_other", "sync", "apply", "dht", "evaluate", "checkpoint", "finish")
"""The loop's parts: ``device`` the (emulated) device time of the inner steps and ``step_other`` the
rest of them (a hivemind step's all-reduce, drawing a batch); ``sync`` the backend's round (an
all-reduce barrier, or gossip waiting on an exchange that lags too far); ``apply`` the backend's work
after each step (applying exchanged updates, publishing the state for joiners); ``dht`` the DHT reads
the loop makes itself; ``evaluate`` the held-out loss; ``checkpoint`` the periodic checkpoints;
``finish`` the backend's last round on the way out. What none of them took is ``other``."""


class PhaseTimers:
    """Exclusive wall-time totals of the training loop's phases (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.loop_seconds = 0.0
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._thread: threading.Thread | None = None
        self._open: list[list[float]] = []  # [started, seconds taken by nested phases]

    @contextmanager
    def loop(self) -> Iterator[None]:
        """The training loop: its wall time, and the thread whose phases count."""
        self._thread = threading.current_thread()
        started = self._clock()
        try:
            yield
        finally:
            self.loop_seconds += self._clock() - started
            self._thread = None

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book the time inside, less that of nested phases, to ``name`` (one of :data:`PHASES`)."""
        if name not in self.totals:
            raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(PHASES)}")
        if threading.current_thread() is not self._thread:
            yield
            return
        self._open.append([self._clock(), 0.0])
        try:
            yield
        finally:
            started, nested = self._open.pop()
            elapsed = self._clock() - started
            self.totals[name] += elapsed - nested
            if self._open:
                self._open[-1][1] += elapsed

    def move(self, seconds: float, source: str, target: str) -> None:
        """Rebook up to ``seconds`` already booked to ``source`` as ``target`` (the device time an inner
        step reported, out of the step's wall time)."""
        moved = min(max(seconds, 0.0), self.totals[source])
        self.totals[source] -= moved
        self.totals[target] += moved

    def summary(self) -> dict[str, float]:
        """``loop`` (the loop's wall time), each phase's seconds, and ``other`` (the rest)."""
        other = max(0.0, self.loop_seconds - sum(self.totals.values()))
        return {"loop": self.loop_seconds, **self.totals, "other": other}
