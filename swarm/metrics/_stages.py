"""The pipeline's stages as the records show them: peers, throughput and capacity per stage, bottleneck.

In a pipelined run (docs/pipeline.md) every sample passes through every stage, so the swarm trains at
the pace of the stage that can process the fewest samples per second: its *capacity*, the sum of its
peers' announced ``stage_capacity``. A run without stages has no stage view.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.metrics._peer import PeerView

MAX_STAGES = 256


@dataclass(frozen=True)
class StageView:
    """One stage: how many active peers serve it, what they process and could process (samples/s)."""

    stage: int
    peers: int
    samples_per_s: float
    capacity: float
    bottleneck: bool = False


def stage_views(peers: Sequence[PeerView]) -> tuple[StageView, ...]:
    """Per-stage numbers over the active trainers; empty unless some peer serves a stage beyond 0."""
    trainers = [p for p in peers if p.active and p.role == "trainer" and p.present]
    top = max((min(p.stage, MAX_STAGES - 1) for p in trainers), default=0)
    if top == 0:
        return ()
    views = []
    for stage in range(top + 1):
        serving = [p for p in trainers if p.stage == stage]
        views.append(
            StageView(
                stage=stage,
                peers=len(serving),
                samples_per_s=round(sum(p.samples_per_s for p in serving), 3),
                capacity=round(sum(p.stage_capacity for p in serving), 3),
            )
        )
    slowest = min(views, key=lambda v: (v.capacity, v.stage))
    return tuple(StageView(**{**vars(v), "bottleneck": v is slowest}) for v in views)
