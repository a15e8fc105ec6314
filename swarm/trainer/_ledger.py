"""The swarm's progress as one peer can vouch for it: samples the run's trainers plausibly trained.

Progress drives the learning-rate schedule and ends a run at ``run.target_samples``, and each trainer
announces its own ``samples_total``. Two things would make a plain sum of the live records wrong:

- **Peers leave.** Their work stays in the model, so the sum must not drop when their records
  expire: the ledger keeps every trainer it has seen, with the most it was credited.
- **Peers lie.** A record can claim any count. A claim is credited only as far as it is plausible:
  at first sight, at most the median of the counts then visible, ours included (a newcomer cannot
  bring in more than a typical member has done); from then on, at most ``rate_slack`` times the
  median rate of the live trainers over the time we have watched them (ours included, which we know
  to be true). A peer that lies therefore moves the total by at most what ``rate_slack`` typical
  peers could have done, and a minority of liars cannot move the medians that bound them. The price:
  an honest peer more than ``rate_slack`` times faster than the median is under-counted, so the run
  lasts longer than it had to; never shorter.

Counts, never the schedule: the caller adds its own samples, which it knows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class _Entry:
    first_seen: float
    initial: int
    credited: int
    claimed: int


class SwarmLedger:
    """Credited samples per trainer ever seen; :meth:`total` is the swarm's plausible progress."""

    def __init__(self, *, rate_slack: float = 8.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate_slack = rate_slack
        self._clock = clock
        self._started = clock()
        self._own_start: int | None = None
        self._entries: dict[str, _Entry] = {}

    def observe(self, claims: Iterable[tuple[str, int]], own_samples: int) -> int:
        """Book the live trainers' claims (``(peer_id, samples_total)``, ours excluded); return
        :meth:`total`. ``own_samples``: this peer's own count (only its growth is used, as a rate)."""
        now = self._clock()
        if self._own_start is None:
            self._own_start = own_samples
        claims = [(peer, max(0, int(samples))) for peer, samples in claims]
        newcomers = [claim for claim in claims if claim[0] not in self._entries]
        if newcomers:
            typical = int(statistics.median([own_samples, *(samples for _, samples in claims)]))
            for peer, samples in newcomers:
                credited = min(samples, typical)
                self._entries[peer] = _Entry(now, credited, credited, credited)
        for peer, samples in claims:
            self._entries[peer].claimed = samples
        rate = self._plausible_rate(now, own_samples - self._own_start, [peer for peer, _ in claims])
        for peer, _ in claims:
            entry = self._entries[peer]
            bound = entry.initial + rate * (now - entry.first_seen)
            entry.credited = max(entry.credited, int(min(entry.claimed, bound)))
        return self.total()

    def total(self) -> int:
        """Samples credited to every trainer seen so far, those that left included."""
        return sum(entry.credited for entry in self._entries.values())

    def credited(self, peer_id: str) -> int:
        entry = self._entries.get(peer_id)
        return entry.credited if entry is not None else 0

    def _plausible_rate(self, now: float, own_growth: int, live: list[str]) -> float:
        """``rate_slack`` x the median of the live trainers' claimed rates, ours included (samples per
        second since first seen): with an honest majority, a typical honest peer's rate."""
        rates = [own_growth / max(now - self._started, 1e-3)]
        for peer in live:
            entry = self._entries[peer]
            if now > entry.first_seen:
                rates.append((entry.claimed - entry.initial) / (now - entry.first_seen))
        return self.rate_slack * statistics.median(rates)
