"""Pick the averaging backend for ``averaging.backend``."""

from __future__ import annotations

from swarm.network import NetworkOptions
from swarm.trainer._backend import AveragingBackend, BackendContext


def make_backend(context: BackendContext, network: NetworkOptions) -> AveragingBackend:
    """The backend ``context.config.averaging.backend`` names, built on the core's parts.

    ``gossip``: quantized gossip DiLoCo (:mod:`swarm.trainer._gossip`); ``none``: a solo peer;
    ``hivemind``: the ``hivemind.Optimizer`` baseline; ``allreduce``: group all-reduce of
    pseudo-gradients (:mod:`swarm.trainer.baselines._allreduce`). Baselines are imported only when asked for.
    """
    name = context.config.averaging.backend
    if name == "gossip":
        from swarm.trainer._gossip import GossipBackend

        return GossipBackend(context)
    if name == "none":
        from swarm.trainer._solo import SoloBackend

        return SoloBackend(context)
    if name in ("hivemind", "allreduce") and network.swarm_key is not None:
        # hivemind's averaging RPCs take no authorizer: they would be open to anyone
        raise ValueError(f"averaging.backend {name!r} cannot run in a private swarm; use 'gossip'")
    if name == "hivemind":
        from swarm.trainer.baselines import HivemindBackend

        return HivemindBackend(context)
    if name == "allreduce":
        from swarm.trainer.baselines import AllReduceBackend

        return AllReduceBackend(context)
    raise ValueError(f"unknown averaging.backend {name!r}")
