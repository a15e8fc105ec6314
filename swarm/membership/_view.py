"""A peer's bounded view of a run's members, when the run spreads its records over several keys.

With ``run.member_shards = S`` every peer stores its record under the key of its shard (a hash of its
peer id, :func:`~swarm.membership.shard_of`), so each key holds about ``N / S`` records. A peer that
trains does not read them all: every :data:`SHARD_READ_EVERY` refreshes it reads one shard, the next in
a random rotation of all ``S``, and keeps what it read until those records expire, plus one read
period (its copy of a record is older than the one in the DHT, which its owner keeps refreshing). Its
view is then the few shards read within that time, about ``(record_ttl_s / (2 * record_interval_s) +
1) * N / S`` peers, and what it reads per second stays the same as the run grows if ``S`` grows with
it (docs/architecture.md, "What membership costs as the swarm grows"). A read is a DHT lookup, which
costs about what the record's store costs (hivemind's holders answer both with the shard's records):
reading every other refresh keeps reads to a third of the lookups, and a read takes the first holder's
answer (:attr:`MemberView.latest`).

With one shard (the default) every refresh reads the whole list, and the view is that list.

A shard is placed by a hash nobody chooses, and one shard's answer adds at most
:data:`SHARD_READ_LIMIT` records (picked at random): Sybil records crowded into one shard fill at most
that part of a view, which the next shard read dilutes.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

from swarm.membership._members import Member
from swarm.membership._record import shard_of

SHARD_READ_LIMIT = 32
"""The most records one shard read adds to a view (of several shards)."""
FIRST_READ_SHARDS = 4
"""Shards read at once for a first view (a joiner wants partners at once)."""
SHARD_READ_EVERY = 2
"""Refreshes between two shard reads, with several shards."""


class MemberView:
    """Which shards to read next, and the members read so far that have not expired."""

    def __init__(
        self,
        shards: int,
        rng: random.Random | None = None,
        *,
        read_every: int = 1,
        keep_s: float = 0.0,
        latest: bool = True,
    ) -> None:
        if shards < 1:
            raise ValueError(f"a run has at least one member shard, not {shards}")
        self.shards, self._read_every, self._keep_s = shards, read_every, keep_s
        self.latest = latest
        """Whether a read asks every holder of a key for its newest records (hivemind's ``latest``), or
        takes the first holder's live copy."""
        self._refreshes = 0
        self._rng = rng or random.Random()
        self._rotation: list[int] = []
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()  # the announcer thread refreshes; the first read may be elsewhere
        self.first = True

    @classmethod
    def for_run(cls, shards: int, interval_s: float, rng: random.Random | None = None) -> MemberView:
        """The view of a peer refreshing every ``interval_s`` in a run of ``shards`` shards: the whole
        list every refresh with one shard (from every holder: the schedule orders it), else a shard
        every :data:`SHARD_READ_EVERY` refreshes, from the first holder that answers (any live copy
        will do for a view, and the DHT stops asking there)."""
        if shards == 1:
            return cls(1, rng)
        keep_s = SHARD_READ_EVERY * interval_s
        return cls(shards, rng, read_every=SHARD_READ_EVERY, keep_s=keep_s, latest=False)

    def next_shards(self) -> list[int]:
        """The shards to read at this refresh: several for the first view, then one every
        ``read_every`` refreshes (none at the others)."""
        count = min(self.shards, FIRST_READ_SHARDS) if self.first else 1
        chosen: list[int] = []
        with self._lock:
            self._refreshes += 1
            if not self.first and self._refreshes % self._read_every:
                return []
            while len(chosen) < count:
                if not self._rotation:
                    self._rotation = self._rng.sample(range(self.shards), self.shards)
                shard = self._rotation.pop()
                if shard not in chosen:
                    chosen.append(shard)
        return chosen

    def update(self, read: dict[int, list[Member] | None], now: float) -> None:
        """Take in the answers of a refresh (``None``: that shard's lookup failed; its members are kept
        until they expire). A shard read replaces what the view held of that shard."""
        answered = {shard for shard, found in read.items() if found is not None}
        with self._lock:
            if answered:
                self.first = False
            kept = {
                pid: m
                for pid, m in self._members.items()
                if m.expires_at + self._keep_s > now and shard_of(pid, self.shards) not in answered
            }
            for found in read.values():
                for member in self._picked(found or []):
                    kept[member.peer_id] = member
            self._members = kept

    def _picked(self, found: Sequence[Member]) -> list[Member]:
        if self.shards == 1 or len(found) <= SHARD_READ_LIMIT:
            return list(found)
        return self._rng.sample(list(found), SHARD_READ_LIMIT)

    def members(self, now: float) -> list[Member]:
        """The members in view whose records (as read, plus ``keep_s``) have not expired, by peer id."""
        live = (m for m in self._members.values() if m.expires_at + self._keep_s > now)
        return sorted(live, key=lambda m: m.peer_id)
