"""The transport layer under gossip, state transfer and the reachability check.

What every swarm protocol on a raw hivemind binary stream shares:

- :class:`LoopThread`: a private event loop in a daemon thread, the blocking bridge into it;
- framing (:func:`write_message`, :func:`read_message`, the strict :func:`parse_json`),
  :class:`ProtocolError` and :class:`StalledError` (timeouts bound progress, not a message's size);
- the swarm key handshake (:func:`authenticate_stream`, :class:`AuthError`, :func:`swarm_key_of`);
- :class:`StreamService`, the serving side (own replica, handler, handshake, fault logging, close);
- :func:`dial` (open a stream, then authenticate) and :func:`run_with_replica` (a one-shot replica for a
  blocking call), the asking side;
- relays for peers behind NAT (:mod:`swarm.p2p._forward`): :class:`RelayForwarder`, the relay, and its
  :class:`RelayLimits`;
  :func:`note_relay_addresses`, the address book :func:`dial` forwards through; :func:`trust_relays`,
  whose forwarded streams a service serves; :data:`RELAYED` and :data:`FORWARDED`, their bytes;
- :data:`PEER_FAULTS`, what a peer can make a stream fail with; :data:`RUN_ID` and :func:`check_run_id`.

Nothing here imports torch: hivemind (which does) is imported inside the functions that use it.
"""

from swarm.p2p._auth import AuthError, StreamKey, authenticate_stream, swarm_key_of
from swarm.p2p._client import dial, run_with_replica
from swarm.p2p._forwarder import RelayForwarder, RelayLimits
from swarm.p2p._framing import (
    HEADER_LEN,
    ProtocolError,
    StalledError,
    dump_json,
    parse_json,
    read_message,
    write_message,
)
from swarm.p2p._loop import LoopThread
from swarm.p2p._relay import (
    FORWARDED,
    RELAYED,
    RelayedBytes,
    note_relay_addresses,
    relays_of,
    split_circuit,
    trust_relays,
)
from swarm.p2p._service import PEER_FAULTS, P2PFactory, StreamService
from swarm.p2p._setup import RUN_ID, check_run_id, daemon_maddr

__all__ = [
    "FORWARDED",
    "HEADER_LEN",
    "PEER_FAULTS",
    "RELAYED",
    "RUN_ID",
    "AuthError",
    "LoopThread",
    "P2PFactory",
    "ProtocolError",
    "RelayForwarder",
    "RelayLimits",
    "RelayedBytes",
    "StalledError",
    "StreamKey",
    "StreamService",
    "authenticate_stream",
    "check_run_id",
    "daemon_maddr",
    "dial",
    "dump_json",
    "note_relay_addresses",
    "parse_json",
    "read_message",
    "relays_of",
    "run_with_replica",
    "split_circuit",
    "swarm_key_of",
    "trust_relays",
    "write_message",
]
