"""The swarm's progress as one peer can vouch for it: samples the run's trainers plausibly trained.

Progress drives the learning-rate schedule and ends a run at ``run.target_samples``, and each trainer
announces its own ``samples_total``. Two things would make a plain sum of the live records wrong:

- **Peers leave.** Their work stays in the model, so the sum must not drop when their records
  expire: the ledger keeps every trainer it has seen, with the most it was credited.
- **Peers lie.** A record can claim any count, and a record costs one key. A claim is credited only
  as far as it is plausible:

  * a peer already there when we looked first (within ``settle_s`` of our start) is credited at
    first sight at most the *low* median of the counts then visible, ours included: as many fake
    records as honest trainers cannot lift it above an honest count;
  * a peer that appears later did its work while we watched, so it starts from nothing: fresh
    identities claiming huge counts bring in nothing at once;
  * from then on, a peer gains at most ``rate_slack`` times the low median of the rates we have
    watched (ours included, which we know to be true; a newcomer's own claim does not count until
    we have seen it grow).

  A liar therefore adds at most what ``rate_slack`` typical peers could have done while we watched
  it, and a minority of liars cannot move the medians that bound them. The price: an honest peer
  more than ``rate_slack`` times faster than the median, or one whose record we missed at first, is
  under-counted for a while, so the run lasts longer than it had to; never shorter.

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
    initial: int  # credited at first sight
    first_claim: int  # claimed at first sight: its growth since is the peer's rate
    credited: int
    claimed: int


class SwarmLedger:
    """Credited samples per trainer ever seen; :meth:`total` is the swarm's plausible progress."""

    def __init__(
        self,
        *,
        rate_slack: float = 8.0,
        settle_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_slack = rate_slack
        self.settle_s = settle_s
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
            settling = now - self._started <= self.settle_s
            typical = self._typical(own_samples, claims) if settling else 0
            for peer, samples in newcomers:
                credited = min(samples, typical)
                self._entries[peer] = _Entry(now, credited, samples, credited, samples)
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

    def _typical(self, own_samples: int, claims: list[tuple[str, int]]) -> int:
        """The low median of the visible counts, ours included, known peers at what they were credited:
        with an honest half, an honest count (an even split cannot average in a liar's)."""
        counts = [own_samples]
        for peer, samples in claims:
            entry = self._entries.get(peer)
            counts.append(samples if entry is None else entry.credited)
        return int(statistics.median_low(counts))

    def credited(self, peer_id: str) -> int:
        entry = self._entries.get(peer_id)
        return entry.credited if entry is not None else 0

    def _plausible_rate(self, now: float, own_growth: int, live: list[str]) -> float:
        """``rate_slack`` x the low median of the rates we watched (samples per second since first
        seen), ours included: with an honest half, a typical honest peer's rate."""
        rates = [own_growth / max(now - self._started, 1e-3)]
        for peer in live:
            entry = self._entries[peer]
            if now > entry.first_seen:
                rates.append(max(0, entry.claimed - entry.first_claim) / (now - entry.first_seen))
        return self.rate_slack * statistics.median_low(rates)
