"""Swarm metrics: one place that turns membership records into a snapshot (rates, states, totals,
warnings), and a JSON-lines history of snapshots. Sinks (table, JSON, Prometheus, plots) live in
``peers/``; nothing here prints.
"""

from swarm.metrics._history import HistoryWriter, read_history
from swarm.metrics._peer import PeerView, connectivity_of
from swarm.metrics._policy import DEFAULT_MAX_DRIFT
from swarm.metrics._snapshot import (
    SCHEMA_VERSION,
    SnapshotPolicy,
    SwarmSnapshot,
    SwarmTotals,
    SwarmWarning,
    build_snapshot,
)
from swarm.metrics._stages import StageView

__all__ = [
    "DEFAULT_MAX_DRIFT",
    "SCHEMA_VERSION",
    "HistoryWriter",
    "PeerView",
    "SnapshotPolicy",
    "StageView",
    "SwarmSnapshot",
    "SwarmTotals",
    "SwarmWarning",
    "build_snapshot",
    "connectivity_of",
    "read_history",
]
