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

__all__ = [
    "IDENTITY_FILE_MODE",
    "AddressError",
    "IdentityError",
    "ListenOptions",
    "NetworkError",
    "NetworkOptions",
    "ensure_identity",
    "expand_listen_options",
    "load_identity",
    "parse_maddr",
    "parse_maddrs",
    "peer_id_of",
    "peer_id_of_identity",
    "start_dht",
]
