"""A training peer: the library's composition of network, membership, averaging and training.

:class:`PeerCore` is every trainer (device, data, progress, node, status, stop path, phase timers,
the loop, round booking, checkpoints, summary); what it trains is a :class:`Trainee` handed to it: the
whole model (:class:`WholeModel`, with :class:`TrainingPeer` the core built with it) or one pipeline
stage (:mod:`swarm.pipeline`). An :class:`AveragingBackend` (gossip, the hivemind baseline, solo) keeps
a peer in agreement with the swarm.
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
from swarm.trainer._checkpoints import AUTO, checkpoint_dir_of, claim_checkpoint_dir, config_yaml
from swarm.trainer._core import PeerCore, Trainee
from swarm.trainer._factory import make_backend
from swarm.trainer._ledger import SwarmLedger
from swarm.trainer._peer import TrainingPeer, WholeModel
from swarm.trainer._phases import PHASES, PhaseTimers
from swarm.trainer._progress import Progress
from swarm.trainer._report import SyncReport
from swarm.trainer._rollback import roll_back

__all__ = [
    "AUTO",
    "PHASES",
    "AveragingBackend",
    "BackendContext",
    "JoinResult",
    "PeerCore",
    "PeerGroup",
    "PhaseTimers",
    "Progress",
    "RoundOutcome",
    "RoundResult",
    "RoundRole",
    "SwarmLedger",
    "SyncReport",
    "Trainee",
    "TrainingPeer",
    "WholeModel",
    "checkpoint_dir_of",
    "claim_checkpoint_dir",
    "config_yaml",
    "make_backend",
    "roll_back",
]
