"""A bootstrap's view of its run over time: who joined and left, and the totals that outlive them.

Trainers leave, and their records expire with them; a monitor started afterwards would see an empty
swarm that trained nothing. The bootstrap stays, so it keeps the count: :class:`RunWatch` builds a
snapshot from each member list (the same :func:`~swarm.metrics.build_snapshot` the monitor uses, so
departed trainers' samples are retired, not lost) and never lets the run's total, step or round go
down. The bootstrap announces them in its own record (:meth:`RunWatch.record_fields`), where a monitor
that trusts it (it is an initial peer) reads them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from swarm.metrics._peer import MemberLike, PeerView
from swarm.metrics._policy import SnapshotPolicy
from swarm.metrics._snapshot import SwarmSnapshot, build_snapshot


@dataclass(frozen=True)
class RunChange:
    """What one observation found: trainers that appeared, trainers whose record expired."""

    joined: tuple[PeerView, ...] = ()
    left: tuple[PeerView, ...] = ()


def peer_name(view: PeerView) -> str:
    """How a person reads a peer: its public name with the end of its id, or the id's end alone."""
    return f"{view.public_name} ({view.short_id})" if view.public_name else view.short_id


class RunWatch:
    """The run as its bootstrap ``self_id`` watches it; feed it :meth:`observe` every few seconds.

    Its own record is left out (it would count its own totals back in). ``clock``: DHT time.
    """

    def __init__(self, policy: SnapshotPolicy, self_id: str, clock: Callable[[], float] = time.time):
        self._policy = replace(policy, trusted_peers=frozenset())
        self._self_id, self._clock = self_id, clock
        self._snapshot: SwarmSnapshot | None = None
        self._live: dict[str, PeerView] = {}
        self.started_at = clock()
        self.samples_total = 0
        self.step = 0
        self.round = 0
        self.joins = 0
        self.seen: set[str] = set()
        self.peak_trainers = 0

    @property
    def snapshot(self) -> SwarmSnapshot | None:
        return self._snapshot

    def observe(self, members: Iterable[MemberLike]) -> RunChange:
        """Take the current member list; return who joined and who left since the last one."""
        others = [m for m in members if m.peer_id != self._self_id]
        snapshot = build_snapshot(others, self._snapshot, self._clock(), self._policy)
        self._snapshot = snapshot
        live = {p.peer_id: p for p in snapshot.peers if p.present and p.compatible and p.role == "trainer"}
        joined = tuple(p for peer_id, p in live.items() if peer_id not in self._live)
        left = tuple(p for peer_id, p in self._live.items() if peer_id not in live)
        self._live = live
        self.joins += len(joined)
        self.seen |= live.keys()
        self.peak_trainers = max(self.peak_trainers, len(live))
        self.samples_total = max(self.samples_total, snapshot.totals.samples_total)
        self.step = max([self.step, *(p.step for p in live.values())])
        self.round = max([self.round, *(p.round for p in live.values())])
        return RunChange(joined, left)

    @property
    def live_trainers(self) -> int:
        return len(self._live)

    @property
    def samples_per_s(self) -> float:
        return self._snapshot.totals.samples_per_s if self._snapshot is not None else 0.0

    def record_fields(self) -> dict[str, int]:
        """The run's totals as the bootstrap's record carries them (counters that never go down)."""
        return {"samples_total": self.samples_total, "step": self.step, "round": self.round}
