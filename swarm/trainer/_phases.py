"""PhaseTimers: where a trainer's training loop spends its wall time, measured by the loop itself.

A peer's summary reports the totals (``phase_seconds``), and the benchmarks read them there: the
split is the library's own number, not something a benchmark patches into private functions.
Phases nest, and each second is booked once, to the innermost phase open at the time: an evaluation
inside a round's booking counts as ``evaluate``, not also as the round's ``sync``. Only the thread
that opened the loop (:meth:`PhaseTimers.loop`) books; calls from other threads are not timed.

A stop is timed too (:class:`StopTimes`, the summary's ``stop``): where it found the peer, and how
long the loop took to end after it and each part of the way out (checkpoint, leaving the swarm, the
summary's final evaluation), so that a benchmark of shutdowns reads them there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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
        self._names: list[str] = []  # the open phases, innermost last
        self.stop = StopTimes(clock)

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
            self.stop.loop_ended()

    def current(self) -> str | None:
        """The innermost phase open now (``loop`` inside the loop but in no phase); None outside the
        loop. Any thread may ask (a stop arrives on another one)."""
        if self._thread is None:
            return None
        names = list(self._names)
        return names[-1] if names else "loop"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Book the time inside, less that of nested phases, to ``name`` (one of :data:`PHASES`)."""
        if name not in self.totals:
            raise ValueError(f"unknown phase {name!r}; the phases are {', '.join(PHASES)}")
        if threading.current_thread() is not self._thread:
            yield
            return
        self._open.append([self._clock(), 0.0])
        self._names.append(name)
        try:
            yield
        finally:
            self._names.pop()
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


class StopTimes:
    """How this peer's stop went: the step, round and phase (:meth:`PhaseTimers.current`) it found,
    the seconds from it to the loop's end, and each part of the way out that the program driving it
    timed with :meth:`part` (``swarm join``: ``checkpoint``, ``leave``, ``final_eval``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seen_at: float | None = None
        self._where: dict[str, Any] = {}
        self._loop_ended_at: float | None = None
        self.seconds: dict[str, float] = {}

    def seen(self, step: int, round_: int, phase: str | None) -> None:
        """The stop arrived (its first sighting counts)."""
        if self.seen_at is None:
            self.seen_at = self._clock()
            self._where = {"at_step": step, "at_round": round_, "in_phase": phase}

    def loop_ended(self) -> None:
        self._loop_ended_at = self._clock()

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time one part of the way out as ``<name>_s``."""
        started = self._clock()
        try:
            yield
        finally:
            self.seconds[name] = self._clock() - started

    def summary(self) -> dict[str, Any] | None:
        """None without a stop; else ``at_step``, ``at_round``, ``in_phase`` (None: outside the loop,
        joining or already leaving), ``loop_s`` (None: the loop had not ended after the stop) and a
        ``<part>_s`` for each part timed so far."""
        if self.seen_at is None:
            return None
        ended = self._loop_ended_at
        loop_s = None if ended is None or ended < self.seen_at else ended - self.seen_at
        return {**self._where, "loop_s": loop_s, **{f"{k}_s": v for k, v in self.seconds.items()}}
