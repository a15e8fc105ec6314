"""Stochastic wiring: which live peer of a stage gets the next micro-batch.

Each micro-batch goes to one peer per stage, drawn at random with weight ``rate / (1 + queue)``: ``rate``
is the peer's throughput as we measured it (samples per second from our sending a request to our
having its answer, timed here; the ``compute_s`` a server reports can only make it slower, never
faster); before the first answer, the capacity its record announces, capped by the low median measured
rate of its stage. ``queue`` is our requests in flight to it plus the queue it reported last. A slow
peer therefore gets proportionally fewer micro-batches and a busy one fewer still, with no
coordination and no barrier.

A measured rate is not proof of work: a server that skips its compute and answers at once (garbage
we cannot check) would measure as the fastest peer by far and take nearly every micro-batch. So a
measured rate counts for at most :data:`RATE_FACTOR` times the stage's low median measured rate: an
honest peer up to that much faster than the typical one keeps its full share, and a peer that answers
instantly gets what one that much faster would (with one other peer in the stage, at most
``RATE_FACTOR / (1 + RATE_FACTOR)`` of the micro-batches; the gradient it answers is clipped by the
data holder, :mod:`swarm.pipeline._driver`). A peer that failed is
avoided for ``PENALTY_S`` (unless it is the only one). ``fixed`` routing (the benchmark's baseline)
always takes the same peer per stage: the data holder's rank among data holders, modulo the stage's
size, like a static pipeline.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

EMA = 0.2
PENALTY_S = 10.0
RATE_FACTOR = 4.0
"""A measured rate counts for at most this many times the stage's low median measured rate."""
ACTIVE = ("idle", "training", "syncing")


@dataclass
class PeerStat:
    rate: float | None = None
    hint: float = 0.0
    inflight: int = 0
    queue: int = 0
    failed_at: float = -1e9
    served: int = 0
    failures: int = 0


@dataclass(frozen=True)
class StageMember:
    """What routing needs from a membership record."""

    peer_id: str
    stage: int
    capacity: float


@dataclass
class Router:
    """Chooses peers per stage; thread-safe (the roster updates on one thread, chains run on another)."""

    num_stages: int
    me: str
    policy: str = "stochastic"
    seed: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _roster: dict[int, list[str]] = field(default_factory=dict)
    _stats: dict[str, PeerStat] = field(default_factory=dict)
    _rank: int = 0

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def update(self, members: Iterable[StageMember], holders: Iterable[str] = ()) -> None:
        """The live, compatible stage peers (from the membership records) and the data holders."""
        roster: dict[int, list[str]] = {k: [] for k in range(self.num_stages)}
        with self._lock:
            for m in members:
                if 0 < m.stage < self.num_stages and m.peer_id != self.me:
                    roster[m.stage].append(m.peer_id)
                    self._stats.setdefault(m.peer_id, PeerStat()).hint = m.capacity
            self._roster = {k: sorted(v) for k, v in roster.items()}
            ranked = sorted({*holders, self.me})
            self._rank = ranked.index(self.me)

    def peers(self, stage: int) -> list[str]:
        with self._lock:
            return list(self._roster.get(stage, ()))

    def choose(self, stage: int, exclude: Iterable[str] = ()) -> str | None:
        """A peer of ``stage`` for the next request, or None when the stage has no live peer left."""
        excluded = set(exclude)
        with self._lock:
            candidates = [p for p in self._roster.get(stage, ()) if p not in excluded]
            if not candidates:
                return None
            if self.policy == "fixed":
                pinned = self._roster[stage][self._rank % len(self._roster[stage])]
                if pinned in candidates:
                    return pinned
            now = time.monotonic()
            healthy = [p for p in candidates if now - self._stats[p].failed_at > PENALTY_S] or candidates
            weights = [self._weight(p, stage) for p in healthy]
            return self._rng.choices(healthy, weights=weights)[0]

    def _weight(self, peer: str, stage: int) -> float:
        stat = self._stats[peer]
        typical = self._typical_rate(stage)
        if stat.rate is None:
            announced = stat.hint if stat.hint > 0 else None
            rate = min(announced or typical or 1.0, typical or math.inf)
        else:
            rate = min(stat.rate, RATE_FACTOR * (typical or math.inf))
        return rate / (1.0 + stat.inflight + stat.queue)

    def _typical_rate(self, stage: int) -> float | None:
        """The low median measured rate of the stage's peers (of two, the slower: one fast liar cannot
        raise it), or None before any answered."""
        known = [rate for p in self._roster.get(stage, ()) if (rate := self._stats[p].rate)]
        return statistics.median_low(known) if known else None

    def started(self, peer: str) -> None:
        with self._lock:
            self._stats.setdefault(peer, PeerStat()).inflight += 1

    def finished(
        self,
        peer: str,
        samples: int,
        elapsed_s: float | None,
        queue: int | None,
        reported_s: float | None = None,
    ) -> None:
        """A request to ``peer`` ended: when it answered, with the seconds we measured it took, its queue
        and the compute time it reported; else a failure. The rate is ``samples`` over the longer of the
        measured and the reported time, so a server that claims to be fast gains nothing."""
        with self._lock:
            stat = self._stats.setdefault(peer, PeerStat())
            stat.inflight = max(0, stat.inflight - 1)
            if elapsed_s is None or queue is None:
                stat.failed_at, stat.failures = time.monotonic(), stat.failures + 1
                return
            stat.served += 1
            stat.queue = queue
            rate = samples / max(elapsed_s, reported_s or 0.0, 1e-6)
            stat.rate = rate if stat.rate is None else (1 - EMA) * stat.rate + EMA * rate

    def served(self) -> Counter[str]:
        """Requests each peer answered for us (any stage)."""
        with self._lock:
            return Counter({peer: stat.served for peer, stat in self._stats.items() if stat.served})

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {p: vars(s).copy() for p, s in self._stats.items()}
