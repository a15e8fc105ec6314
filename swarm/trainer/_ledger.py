"""The swarm's progress as one peer can vouch for it: samples the run's trainers plausibly trained.

Progress drives the learning-rate schedule and ends a run at ``run.target_samples``, and each trainer
announces its own ``samples_total``. Two things would make a plain sum of the live records wrong:

- **Peers leave.** Their work stays in the model, so the sum must not drop when their records
  expire: the ledger keeps every trainer it has seen, with the most it was credited.
- **Peers lie.** A record can claim any count, and a record costs one key, so liars may be most of
  the records we see. A claim is credited only as far as it is plausible, and the bounds rest on
  what this peer measured itself, never on other claims alone:

  * a peer already there when we looked first (within ``settle_s`` of our start) is credited at
    first sight at most the *low* median of the counts then visible, ours included (as many fake
    records as honest trainers cannot lift it above an honest count), and never more than our own
    count (a majority of fakes cannot lift it above what we trained);
  * a peer that appears later did its work while we watched, so it starts from nothing: fresh
    identities claiming huge counts bring in nothing at once;
  * from then on, a peer gains at most ``rate_slack`` times the lower of our own rate and the low
    median of the rates we have watched (ours included; a newcomer's own claim does not count
    until we have seen it grow). The median keeps a minority of liars at a typical honest rate; our
    own rate caps what a majority can make of it, so the bound never compounds.

  Each live record therefore adds at most our own count once plus ``rate_slack`` times our own rate
  for as long as we watch it, however many of them lie together. The price: an honest peer more than
  ``rate_slack`` times faster than us or the median, or one whose record we missed at first, is
  under-counted for a while, so the run lasts longer than it had to; never shorter.

  Until our own count has grown there is no rate of ours to cap with, and the median alone bounds
  the rates. A pipeline stage past the first passes 0 for good: it credits nothing at first sight,
  and a majority of lying data holders is bounded there only by the watched median.

Counts, never the schedule: the caller adds its own samples, which it knows.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MAX_CLAIM = 2**63 - 1
"""The most a record may claim (``PeerRecord.samples_total``): larger counts are read as this."""


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
        self._own_grew = False
        self._entries: dict[str, _Entry] = {}

    def observe(self, claims: Iterable[tuple[str, int]], own_samples: int) -> int:
        """Book the live trainers' claims (``(peer_id, samples_total)``, ours excluded); return
        :meth:`total`. ``own_samples``: this peer's own count, which it knows to be true (it bounds
        first-sight credits, and its growth is the rate that bounds everyone's)."""
        now = self._clock()
        own_samples = max(0, int(own_samples))
        if self._own_start is None:
            self._own_start = own_samples
        self._own_grew = self._own_grew or own_samples > self._own_start
        claims = [(peer, min(max(0, int(samples)), MAX_CLAIM)) for peer, samples in claims]
        newcomers = [claim for claim in claims if claim[0] not in self._entries]
        if newcomers:
            settling = now - self._started <= self.settle_s
            typical = min(self._typical(own_samples, claims), own_samples) if settling else 0
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

    def credited(self, peer_id: str) -> int:
        entry = self._entries.get(peer_id)
        return entry.credited if entry is not None else 0

    def _typical(self, own_samples: int, claims: list[tuple[str, int]]) -> int:
        """The low median of the visible counts, ours included, known peers at what they were credited:
        with an honest half, an honest count (an even split cannot average in a liar's)."""
        counts = [own_samples]
        for peer, samples in claims:
            entry = self._entries.get(peer)
            counts.append(samples if entry is None else entry.credited)
        return int(statistics.median_low(counts))

    def _plausible_rate(self, now: float, own_growth: int, live: list[str]) -> float:
        """``rate_slack`` x the low median of the rates we watched (samples per second since first
        seen), ours included, and never more than ``rate_slack`` x ours once we have one: with an
        honest half, a typical honest peer's rate; with a lying majority, at most ours."""
        own_rate = max(0, own_growth) / max(now - self._started, 1e-3)
        rates = [own_rate]
        for peer in live:
            entry = self._entries[peer]
            if now > entry.first_seen:
                rates.append(max(0, entry.claimed - entry.first_claim) / (now - entry.first_seen))
        median = statistics.median_low(rates)
        return self.rate_slack * (min(median, own_rate) if self._own_grew else median)
