"""Swarm metrics: one place that turns membership records into a snapshot (rates, states, totals,
warnings), and a JSON-lines history of snapshots. Sinks (table, JSON, Prometheus, plots) live in
``peers/``; nothing here prints.
"""

from swarm.metrics._history import HistoryWriter, read_history
from swarm.metrics._peer import PeerView, connectivity_of
from swarm.metrics._policy import DEFAULT_MAX_DRIFT
from swarm.metrics._run import RunChange, RunWatch, peer_name
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
    "RunChange",
    "RunWatch",
    "SnapshotPolicy",
    "StageView",
    "SwarmSnapshot",
    "SwarmTotals",
    "SwarmWarning",
    "build_snapshot",
    "connectivity_of",
    "peer_name",
    "read_history",
]
