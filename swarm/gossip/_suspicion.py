"""How suspicious a partner's committed exchanges make it: the robust clip's verdicts over time.

Two kinds of evidence, both per partner (docs/gossip.md, "Malicious partners"):

- a *hard* clip (an excess over ``clip_hard_factor`` plausible radii) adds :data:`HARD_SUSPICION`,
  and every ordinary exchange (an excess up to :data:`MEDIAN_LIMIT`) takes :data:`DECAY` away:
  ``clip_strikes`` hard clips in a row ban, one clean exchange in between forgives nothing (about 7
  wear one hard clip down), so an attacker alternating hard clips with clean exchanges is banned at
  its third;
- a *consistent* excess: the median excess of the partner's last :data:`WINDOW` judged exchanges
  over :data:`MEDIAN_LIMIT` bans it. A negated update, or a push of twice our update's norm, has an
  excess of about 0.9 in every exchange and is never hard; honest excesses are mostly far smaller
  (median 0.18, p99 0.71 measured in a clean swarm), and the median ignores the runs of large ones
  an honest pair shows after an attacker pulled its models apart (excesses of 1.4-2.2 were seen).
  What counts as consistent is judged against the swarm too: the limit is the larger of
  :data:`MEDIAN_LIMIT` and :data:`RELATIVE_LIMIT` times the median excess of the last
  :data:`SWARM_WINDOW` exchanges with *other* partners (at least :data:`MIN_OTHERS` of them). When
  every partner looks far (our lagging exchanges on a loaded machine, a partition healing, the
  shared-base rule's wider honest spread), honest medians of 0.70-0.98 were seen, and no one partner
  stands out; an attacker among honest partners still meets 2.5 times their median.

After a ban the hard count restarts at half the limit and the window empties; the partner's strikes
(the ban backoff) are forgiven only once its hard count is zero and its recent median is ordinary.
"""

from __future__ import annotations

import collections
import statistics
import threading
from dataclasses import dataclass, field
from enum import Enum

from swarm.gossip._partners import MAX_TRACKED

HARD_SUSPICION = 1.0
"""What a hard clip adds; ``clip_strikes`` (2) of them ban."""
DECAY = 0.15
"""What every ordinary exchange takes away from the hard count."""
WINDOW = 8
"""Judged exchanges per partner whose median excess is watched."""
MEDIAN_LIMIT = 0.7
"""A median excess over this bans: at the p99 of honest excesses in a clean swarm, under a negated
update's (about 0.9)."""
RELATIVE_LIMIT = 2.5
"""... unless the other partners' median excess, times this, is higher."""
SWARM_WINDOW = 32
"""Judged exchanges with all partners whose median sets the relative limit."""
MIN_OTHERS = 4
"""Judged exchanges with other partners the relative limit needs. With fewer, only
:data:`MEDIAN_LIMIT` holds: in a 3-trainer swarm a partner's 8th exchange often came while the other
partner had fewer than 8, and honest medians of 0.72 were banned by the bare limit."""


class Verdict(Enum):
    NONE = "none"
    BAN = "ban"
    FORGIVE = "forgive"


@dataclass
class _Record:
    hard: float = 0.0
    recent: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=WINDOW))


class Suspicions:
    """Per-partner evidence, bounded to ``MAX_TRACKED`` partners (the least suspect forgotten first, so
    throwaway identities cannot flush a real suspect's record). Thread-safe."""

    def __init__(self, limit: float) -> None:
        self._limit = limit
        self._records: dict[str, _Record] = {}
        self._swarm: collections.deque[tuple[str, float]] = collections.deque(maxlen=SWARM_WINDOW)
        self._lock = threading.Lock()

    def hard_count(self, peer: str) -> float:
        with self._lock:
            record = self._records.get(peer)
            return record.hard if record is not None else 0.0

    def judge(self, peer: str, excess: float, hard: bool, blame: bool) -> tuple[Verdict, str]:
        """Count one judged exchange of ``peer``; ``blame`` False (we do not know our own norm yet)
        counts nothing against it. Returns the verdict and, for a ban, why."""
        with self._lock:
            record = self._records.pop(peer, None) or _Record()
            if hard:
                record.hard += HARD_SUSPICION if blame else 0.0
            else:
                if excess <= MEDIAN_LIMIT:  # an ordinary exchange; a large one (cut softly) keeps it
                    record.hard = max(0.0, record.hard - DECAY)
                if blame:
                    record.recent.append(excess)
            limit = self._median_limit(peer)
            if blame:
                self._swarm.append((peer, excess))
            verdict, why = self._verdict(record, limit)
            if record.hard > 0 or record.recent:
                self._records[peer] = record
                while len(self._records) > MAX_TRACKED:
                    del self._records[min(self._records, key=lambda p: self._records[p].hard)]
        return verdict, why

    def _median_limit(self, peer: str) -> float:
        """The median limit for ``peer``: :data:`MEDIAN_LIMIT`, raised when the other partners' recent
        excesses are high too (module docstring)."""
        others = [excess for who, excess in self._swarm if who != peer]
        if len(others) < MIN_OTHERS:
            return MEDIAN_LIMIT
        return max(MEDIAN_LIMIT, RELATIVE_LIMIT * statistics.median(others))

    def _verdict(self, record: _Record, limit: float) -> tuple[Verdict, str]:
        median = statistics.median(record.recent) if record.recent else 0.0
        if record.hard >= self._limit:
            why = f"{record.hard:.2f} hard clips' worth, the limit is {self._limit:g}"
            record.hard, record.recent = self._limit / 2, collections.deque(maxlen=WINDOW)
            return Verdict.BAN, why
        if len(record.recent) == WINDOW and median > limit:
            why = f"a median excess of {median:.2f} over its last {WINDOW}, the limit is {limit:.2g}"
            record.recent.clear()
            return Verdict.BAN, why
        if record.hard == 0 and median <= limit:
            return Verdict.FORGIVE, ""
        return Verdict.NONE, ""
