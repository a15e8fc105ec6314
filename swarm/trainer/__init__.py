"""A training peer: the library's composition of network, membership, gossip and training."""

from swarm.trainer._factory import make_training_peer
from swarm.trainer._peer import SyncReport, TrainingPeer
from swarm.trainer._progress import Progress

__all__ = ["Progress", "SyncReport", "TrainingPeer", "make_training_peer"]
