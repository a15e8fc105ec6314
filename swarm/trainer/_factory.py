"""Pick the training peer class for the configured averaging backend."""

from __future__ import annotations

from typing import Any

from swarm.config import RunConfig
from swarm.network import NetworkOptions
from swarm.trainer._peer import TrainingPeer


def make_training_peer(config: RunConfig, network: NetworkOptions, **kwargs: Any):
    """A :class:`TrainingPeer` (``gossip``, ``none``) or a ``HivemindTrainingPeer`` (``hivemind``).

    ``kwargs`` are the peers' shared keyword arguments (``public_name``, ``resume``, ``on_sync``).
    The hivemind module is imported only when asked for: it is a baseline, not the normal path.
    """
    if config.averaging.backend == "hivemind":
        from swarm.trainer._hivemind import HivemindTrainingPeer

        return HivemindTrainingPeer(config, network, **kwargs)
    return TrainingPeer(config, network, **kwargs)
