"""swarm: decentralized training with quantized gossip averaging.

The public API is re-exported here and imported lazily, so that light commands (``swarm config``)
do not pay for importing torch and hivemind. Everything not listed here is private to its module.
"""

from __future__ import annotations

from typing import Any

from swarm._lazy import load_export

__version__ = "0.1.0"

_EXPORTS = {
    "describe_device": "swarm._device",
    "NodeInfo": "swarm._node",
    "SwarmNode": "swarm._node",
    "PROTOCOL_VERSION": "swarm.membership",
    "Member": "swarm.membership",
    "PeerRecord": "swarm.membership",
    "list_members": "swarm.membership",
    "AddressError": "swarm.network",
    "NetworkError": "swarm.network",
    "NetworkOptions": "swarm.network",
    "ConfigError": "swarm.config",
    "SwarmError": "swarm._errors",
    "RunConfig": "swarm.config",
    "load_config": "swarm.config",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    return load_export(__name__, _EXPORTS, name, globals())
