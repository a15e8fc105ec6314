"""Putting a peer on the network: address validation, persistent identity, DHT start-up."""

from swarm.network._addresses import (
    AddressError,
    ListenOptions,
    expand_listen_options,
    parse_maddr,
    parse_maddrs,
)
from swarm.network._dht import NetworkError, NetworkOptions, start_dht
from swarm.network._identity import (
    IDENTITY_FILE_MODE,
    IdentityError,
    ensure_identity,
    load_identity,
    peer_id_of,
    peer_id_of_identity,
)
from swarm.network._reachability import (
    ReachabilityChecker,
    ReachabilityResult,
    check_reachability,
)
from swarm.network._swarm_key import SwarmKey, SwarmKeyError, load_swarm_key

__all__ = [
    "IDENTITY_FILE_MODE",
    "AddressError",
    "IdentityError",
    "ListenOptions",
    "NetworkError",
    "NetworkOptions",
    "ReachabilityChecker",
    "ReachabilityResult",
    "SwarmKey",
    "SwarmKeyError",
    "check_reachability",
    "ensure_identity",
    "expand_listen_options",
    "load_identity",
    "load_swarm_key",
    "parse_maddr",
    "parse_maddrs",
    "peer_id_of",
    "peer_id_of_identity",
    "start_dht",
]
