"""Which stage a peer serves: the under-served one when it joins (``--stage auto``), and later moves.

Every micro-batch passes through every stage, so the demand on each stage is the same and the swarm
trains at the pace of the stage that can process the fewest samples per second: its *capacity*, the sum
of its peers' announced ``stage_capacity`` (samples per second of device time). A joiner takes the
stage with the lowest capacity (an empty stage first, stage 0 (the data holders) first among equals).

:class:`Rebalancer` moves a running peer when the bottleneck would clearly gain: from stage ``a`` to
the bottleneck ``b`` if ``min(C_a - c, C_b + c) > (1 + hysteresis) * min(C_a, C_b)`` (``c`` our own
capacity), the same proposal held for ``patience`` checks in a row, our stage keeps at least one
other peer, and at most one move per ``min_interval_s`` (unless ``b`` has no peer left: an empty stage
halts the whole swarm, so refilling it cannot wait).

So that the peers of a stage do not all move at once (each seeing the others stay), a move is taken
only by the peer the records *elect* for it: among the peers of ``a`` whose own move would pass the
rule above, the one with the lowest hash of ``(peer id, a, b, epoch)``, the epoch being wall-clock time
in units of ``epoch_s``. Every peer reads the same records and elects the same one, with no message
exchanged; a new epoch elects another peer when the last one did not move (it does not rebalance, or
moved too recently). Views that differ for a moment (a record not yet refreshed across an epoch
boundary) can elect two, so the elected peer first *claims* the move: it announces itself ``joining``,
reads the records again and goes only if no other peer of its stage is moving (:meth:`Rebalancer.confirm`).
Should two claims still pass, the refill rule repairs a stage left empty.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ACTIVE = ("idle", "training", "syncing")


@dataclass(frozen=True)
class StageLoad:
    """One stage as the records show it."""

    stage: int
    peers: int
    capacity: float
    samples_per_s: float
    unknown: int


def stage_loads(records: Iterable[Any], num_stages: int, config_hash: str | None = None) -> list[StageLoad]:
    """Per-stage peers, capacity and throughput of the live pipeline trainers among ``records``.

    A peer that has not measured its capacity yet counts with the median of those that have.
    """
    live = [
        r
        for r in records
        if r.role == "trainer"
        and r.state in ACTIVE
        and 0 <= r.stage < num_stages
        and (config_hash is None or r.config_hash == config_hash)
    ]
    known = [r.stage_capacity for r in live if r.stage_capacity > 0]
    typical = statistics.median(known) if known else 1.0
    loads = []
    for stage in range(num_stages):
        peers = [r for r in live if r.stage == stage]
        loads.append(
            StageLoad(
                stage=stage,
                peers=len(peers),
                capacity=sum(r.stage_capacity or typical for r in peers),
                samples_per_s=sum(r.samples_per_s for r in peers),
                unknown=sum(r.stage_capacity <= 0 for r in peers),
            )
        )
    return loads


def choose_stage(loads: list[StageLoad]) -> int:
    """The stage with the lowest capacity (empty ones first); the lowest index among equals."""
    return min(loads, key=lambda load: (load.peers > 0, load.capacity, load.stage)).stage


def bottleneck(loads: list[StageLoad]) -> int | None:
    """The stage that limits the swarm's throughput, None when a stage has no peer at all."""
    if not loads or any(load.peers == 0 for load in loads):
        return None
    return min(loads, key=lambda load: (load.capacity, load.stage)).stage


class Rebalancer:
    """Decides, check by check, whether this peer should move to another stage."""

    def __init__(
        self,
        *,
        hysteresis: float = 0.25,
        patience: int = 3,
        min_interval_s: float = 300.0,
        epoch_s: float = 90.0,
    ) -> None:
        self.hysteresis, self.patience, self.min_interval_s = hysteresis, patience, min_interval_s
        self.epoch_s = epoch_s
        self._proposal: int | None = None
        self._streak = 0
        self._last_move = -float("inf")

    def consider(
        self, me: str, stage: int, capacity: float, records: list[Any], num_stages: int, now: float
    ) -> int | None:
        """The stage to move to now, or None.

        ``me``, ``stage`` and ``capacity`` (samples per device second) describe this peer; ``records``
        are the run's live trainer records (ours among them or not: ours counts with ``capacity``);
        ``now`` is wall-clock time (the same on every peer, give or take its clock's error).
        """
        others, loads = _view(me, stage, capacity, records, num_stages)
        target = self._proposal_of(stage, capacity, loads)
        self._streak = (
            self._streak + 1 if target is not None and target == self._proposal else int(target is not None)
        )
        self._proposal = target
        if target is None or self._streak < self.patience:
            return None
        if loads[target].peers > 0 and now - self._last_move < self.min_interval_s:
            return None
        candidates = [(me, capacity)] + [
            (r.peer_id, r.stage_capacity)
            for r in others
            if r.role == "trainer" and r.state in ACTIVE and r.stage == stage
        ]
        movers = [peer for peer, cap in candidates if self._proposal_of(stage, cap, loads) == target]
        epoch = int(now // self.epoch_s)
        if min(movers, key=lambda peer: _ballot(peer, stage, target, epoch)) != me:
            return None
        self._proposal, self._streak = None, 0
        return target

    def confirm(
        self, me: str, stage: int, capacity: float, records: list[Any], num_stages: int, target: int
    ) -> bool:
        """Whether the move :meth:`consider` proposed still holds on ``records`` read *after* this peer
        announced it (its record saying ``joining``): no other peer of ``stage`` is moving, and the move
        still passes the rule.

        Two peers elected in neighbouring epochs from views a moment apart both announce, then both read:
        the later reader sees the earlier one moving and stays (or both stay, and a later epoch elects
        again), so that one claim at most goes through.
        """
        others, loads = _view(me, stage, capacity, records, num_stages)
        if any(r.role == "trainer" and r.stage == stage and r.state == "joining" for r in others):
            return False
        return self._proposal_of(stage, capacity, loads) == target

    def moved(self, now: float) -> None:
        """Record a completed move at wall-clock ``now``: the next waits ``min_interval_s``."""
        self._last_move = now

    def _proposal_of(self, stage: int, capacity: float, loads: list[StageLoad]) -> int | None:
        ours = loads[stage]
        if ours.peers < 2 or capacity <= 0:
            return None
        empty = [load.stage for load in loads if load.peers == 0]
        if empty:
            return empty[0]
        if any(load.unknown for load in loads):
            return None  # someone has not measured yet: wait rather than move on a guess
        target = min(loads, key=lambda load: (load.capacity, load.stage))
        if target.stage == stage:
            return None
        before = min(ours.capacity, target.capacity)
        after = min(ours.capacity - capacity, target.capacity + capacity)
        return target.stage if after > (1 + self.hysteresis) * before else None


def _view(
    me: str, stage: int, capacity: float, records: list[Any], num_stages: int
) -> tuple[list[Any], list[StageLoad]]:
    """The other peers' records, and the stage loads with us counted at our current ``capacity``."""
    others = [r for r in records if r.peer_id != me]
    return others, stage_loads([*others, _Self(me, stage, capacity)], num_stages)


@dataclass(frozen=True)
class _Self:
    """This peer as a record, with its current capacity (its announced record may be older)."""

    peer_id: str
    stage: int
    stage_capacity: float
    role: str = "trainer"
    state: str = "training"
    samples_per_s: float = 0.0


def _ballot(peer_id: str, stage: int, target: int, epoch: int) -> bytes:
    """The order in which the peers of ``stage`` are elected to move to ``target`` during ``epoch``: the same
    on every peer."""
    return hashlib.sha256(f"{peer_id}:{stage}:{target}:{epoch}".encode()).digest()
