"""A training peer: the library's composition of network, membership, averaging and training.

:class:`TrainingPeer` is the core (model, data, inner loop, progress, node, status, checkpoints);
an :class:`AveragingBackend` (gossip, the hivemind baseline, solo) keeps it in agreement with the swarm.
"""

from swarm.trainer._backend import (
    AveragingBackend,
    BackendContext,
    JoinResult,
    PeerGroup,
    RoundOutcome,
    RoundResult,
    RoundRole,
)
from swarm.trainer._factory import make_backend
from swarm.trainer._ledger import SwarmLedger
from swarm.trainer._peer import TrainingPeer
from swarm.trainer._progress import Progress
from swarm.trainer._report import SyncReport

__all__ = [
    "AveragingBackend",
    "BackendContext",
    "JoinResult",
    "PeerGroup",
    "Progress",
    "RoundOutcome",
    "RoundResult",
    "RoundRole",
    "SwarmLedger",
    "SyncReport",
    "TrainingPeer",
    "make_backend",
]
