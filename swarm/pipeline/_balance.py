"""Which stage a peer serves: the under-served one when it joins (``--stage auto``), and later moves.

Every micro-batch passes through every stage, so the demand on each stage is the same and the swarm
trains at the pace of the stage that can process the fewest samples per second: its *capacity*, the sum
of its peers' announced ``stage_capacity`` (samples per second of device time). A joiner takes the
stage with the lowest capacity (an empty stage first, stage 0 (the data holders) first among equals).

:class:`Rebalancer` moves a running peer when the bottleneck would clearly gain: from stage ``a`` to
the bottleneck ``b`` if ``min(C_a - c, C_b + c) > (1 + hysteresis) * min(C_a, C_b)`` (``c`` our own
capacity), the same proposal held for ``patience`` checks in a row, our stage keeps at least one
other peer, at most one move per ``min_interval_s``, and, so that the peers of a stage do not all move
at once, with probability ``1 / peers of our stage`` per check.
"""

from __future__ import annotations

import random
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
        seed: int | None = None,
    ) -> None:
        self.hysteresis, self.patience, self.min_interval_s = hysteresis, patience, min_interval_s
        self._rng = random.Random(seed)
        self._proposal: int | None = None
        self._streak = 0
        self._last_move = -float("inf")

    def consider(self, stage: int, capacity: float, loads: list[StageLoad], now: float) -> int | None:
        """The stage to move to now, or None. ``capacity``: ours (samples per device second)."""
        target = self._proposal_of(stage, capacity, loads)
        self._streak = (
            self._streak + 1 if target is not None and target == self._proposal else int(target is not None)
        )
        self._proposal = target
        if target is None or self._streak < self.patience or now - self._last_move < self.min_interval_s:
            return None
        if self._rng.random() >= 1.0 / max(1, loads[stage].peers):
            return None
        self._last_move, self._proposal, self._streak = now, None, 0
        return target

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
