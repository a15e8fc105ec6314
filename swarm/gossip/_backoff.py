"""Backoff after syncs whose partners failed or refused: what keeps peers that call ``sync`` in a
loop from storming partners that are busy, gone, or refusing them.

A sync that failed or was rejected makes the next one wait a randomized, exponential pause (from
``base_s``, doubling, up to ``max_s``); a committed exchange resets it. Nothing else changes it: a
BUSY sync already waited ``busy_patience_s`` inside; one that found no partner dialled nobody (a
lone trainer's rounds must not wait for it); a cancelled or skipped one says nothing about the
partners; and one that ran its whole data phase but was not committed (another exchange of ours
committed first: our own race, :data:`NOT_COMMITTED`) met a partner that answered. The pause is
randomized in ``[b/2, b]`` so that peers that failed together do not all come back at once.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from swarm.gossip._metrics import SyncOutcome

BACKING_OFF = frozenset({SyncOutcome.FAILED, SyncOutcome.REJECTED})
"""The outcomes that make the next sync wait."""
NOT_COMMITTED = "not committed"
"""How the reason of an exchange that the gate kept from committing starts (``swarm.gossip._exchange``)."""


class Backoff:
    """When the next sync may start. Thread-safe."""

    def __init__(
        self,
        base_s: float,
        max_s: float,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._base, self._max, self._rng, self._clock = base_s, max(base_s, max_s), rng, clock
        self._failures = 0
        self._not_before = 0.0
        self._lock = threading.Lock()

    def remaining(self) -> float:
        """Seconds the next sync should wait (0: go)."""
        with self._lock:
            return max(0.0, self._not_before - self._clock())

    def after(self, outcome: SyncOutcome, reason: str = "") -> None:
        """Count a sync's outcome (and its reason): OK resets the backoff, a failure doubles it."""
        if reason.startswith(NOT_COMMITTED):
            return
        with self._lock:
            if outcome is SyncOutcome.OK:
                self._failures, self._not_before = 0, 0.0
            elif outcome in BACKING_OFF and self._base > 0:
                pause = min(self._base * 2**self._failures, self._max)
                self._failures = min(self._failures + 1, 32)
                self._not_before = self._clock() + self._rng.uniform(pause / 2, pause)

    @property
    def failures(self) -> int:
        """Syncs in a row that ended in a backing-off outcome."""
        with self._lock:
            return self._failures
