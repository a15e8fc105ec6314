"""Putting a peer on the network: address validation, persistent identity, DHT start-up, swarm keys and
the reachability dial-back.

The names are imported lazily (PEP 562), like :mod:`swarm`'s: importing hivemind imports torch, so
``import swarm.network`` stays light and each name loads only the module that defines it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.network._addresses import (
        AddressError,
        ListenOptions,
        expand_listen_options,
        parse_maddr,
        parse_maddrs,
    )
    from swarm.network._dht import NetworkError, NetworkOptions, connect_out, rejoin_initial_peers, start_dht
    from swarm.network._identity import (
        IDENTITY_FILE_MODE,
        IdentityError,
        ensure_identity,
        load_identity,
        peer_id_of,
        peer_id_of_identity,
    )
    from swarm.network._reachability import ANNOUNCED_LOOKUP_TIMEOUT_S, ReachabilityChecker
    from swarm.network._reachability_ask import ReachabilityResult, ReachabilityStatus, check_reachability
    from swarm.network._startup import start_shm_manager_first
    from swarm.network._swarm_key import SwarmKey, SwarmKeyError, load_swarm_key, write_new_key

_EXPORTS = {
    "AddressError": "_addresses",
    "ListenOptions": "_addresses",
    "expand_listen_options": "_addresses",
    "parse_maddr": "_addresses",
    "parse_maddrs": "_addresses",
    "NetworkError": "_dht",
    "NetworkOptions": "_dht",
    "rejoin_initial_peers": "_dht",
    "connect_out": "_dht",
    "start_dht": "_dht",
    "IDENTITY_FILE_MODE": "_identity",
    "IdentityError": "_identity",
    "ensure_identity": "_identity",
    "load_identity": "_identity",
    "peer_id_of": "_identity",
    "peer_id_of_identity": "_identity",
    "ANNOUNCED_LOOKUP_TIMEOUT_S": "_reachability",
    "ReachabilityChecker": "_reachability",
    "ReachabilityResult": "_reachability_ask",
    "ReachabilityStatus": "_reachability_ask",
    "check_reachability": "_reachability_ask",
    "start_shm_manager_first": "_startup",
    "SwarmKey": "_swarm_key",
    "SwarmKeyError": "_swarm_key",
    "load_swarm_key": "_swarm_key",
    "write_new_key": "_swarm_key",
}

__all__ = [
    "ANNOUNCED_LOOKUP_TIMEOUT_S",
    "IDENTITY_FILE_MODE",
    "AddressError",
    "IdentityError",
    "ListenOptions",
    "NetworkError",
    "NetworkOptions",
    "ReachabilityChecker",
    "ReachabilityResult",
    "ReachabilityStatus",
    "SwarmKey",
    "SwarmKeyError",
    "check_reachability",
    "connect_out",
    "ensure_identity",
    "expand_listen_options",
    "load_identity",
    "load_swarm_key",
    "parse_maddr",
    "parse_maddrs",
    "peer_id_of",
    "peer_id_of_identity",
    "rejoin_initial_peers",
    "start_dht",
    "start_shm_manager_first",
    "write_new_key",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'swarm.network' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
