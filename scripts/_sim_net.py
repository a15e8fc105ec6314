"""The simulator's clock and links (``scripts/simulate.py``).

:class:`Clock` is a discrete-event queue: callbacks run in order of their simulated time (ties in the
order they were scheduled). :class:`Network` decides when a message lands: each peer has one uplink
and one downlink of ``rate`` goodput bytes per second; a message of ``n`` bytes from ``a`` to ``b``
starts once both ``a``'s uplink and ``b``'s downlink are free, holds both for ``n / rate`` seconds,
and lands ``latency`` seconds after its last byte left. So a peer's messages queue behind each other
and a bigger message lands later: lag emerges from bytes, it is not imposed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MESSAGE_OVERHEAD = 256
"""Bytes every message carries besides its payload (headers, frame and tensor descriptors)."""


@dataclass(order=True)
class _Event:
    time: float
    seq: int
    fn: Callable[..., None] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)


class Clock:
    """A discrete-event clock: :meth:`at` schedules, :meth:`run` dispatches in time order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[_Event] = []
        self._seq = itertools.count()
        self.stopped = False

    def at(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < {self.now}")
        heapq.heappush(self._queue, _Event(time, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def stop(self) -> None:
        self.stopped = True

    def run(self, until: float = float("inf")) -> None:
        """Dispatch events until the queue is empty, :meth:`stop` is called or ``until`` passes."""
        while self._queue and not self.stopped:
            if self._queue[0].time > until:
                self.now = until
                return
            event = heapq.heappop(self._queue)
            self.now = event.time
            event.fn(*event.args)
        if not self.stopped and until != float("inf"):
            self.now = max(self.now, until)


@dataclass
class Network:
    """Full-duplex links of ``rate`` bytes/s each way per peer, ``latency`` seconds one way."""

    rate: float
    latency: float
    _up_free: dict[str, float] = field(default_factory=dict)
    _down_free: dict[str, float] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=dict)

    def send(self, src: str, dst: str, nbytes: int, now: float) -> float:
        """Queue ``nbytes`` (plus :data:`MESSAGE_OVERHEAD`) from ``src`` to ``dst`` at ``now``; return
        when the message lands."""
        if nbytes < 0 or self.rate <= 0:
            raise ValueError(f"need nbytes >= 0 and rate > 0, got {nbytes} and {self.rate}")
        total = nbytes + MESSAGE_OVERHEAD
        start = max(now, self._up_free.get(src, 0.0), self._down_free.get(dst, 0.0))
        end = start + total / self.rate
        self._up_free[src] = end
        self._down_free[dst] = end
        self.sent[src] = self.sent.get(src, 0.0) + total
        return end + self.latency

    def ring_allreduce_s(self, peers: int, nbytes: int) -> float:
        """Seconds a ring all-reduce of ``nbytes`` per peer takes over these links: each peer sends
        and receives ``2 (n - 1) / n`` of it, in ``2 (n - 1)`` steps of one latency each."""
        if peers < 2:
            return 0.0
        share = 2 * (peers - 1) / peers * (nbytes + MESSAGE_OVERHEAD)
        return share / self.rate + 2 * (peers - 1) * self.latency
