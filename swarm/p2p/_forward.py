"""Swarm's relay protocol: a public peer forwards one swarm stream to a peer behind NAT.

Why not libp2p's circuit relay: the bundled p2pd resets every relayed connection after 128 KiB in each
direction, whatever its ``-relayDataLimit`` says. Its ``EnableRelayV2`` starts a second relay service
with libp2p's default limits (2 minutes, 128 KiB) beside the one configured by the flags, and that one
serves. One int8 exchange of the tiny model is already larger.

A peer behind NAT dials out to its relays (its initial peers), so each relay holds a connection to it
over which it can open streams. One forwarded stream goes:

1. dialler -> relay, on :data:`FORWARD_HANDLER`: the swarm key handshake (private swarms), then
   ``FORWARD {"to": peer, "handler": h}``;
2. relay -> peer, on ``h`` + :data:`RELAYED_SUFFIX`: ``PREAMBLE {"from": dialler}``; or, if the relay
   will not forward, relay -> dialler: ``REFUSED {"reason": ...}`` and the stream closes;
3. the relay copies raw bytes both ways from then on, until one side closes. The first thing to cross
   is the peer's ``READY {}`` to the dialler: the peer accepted the stream (a peer that refuses it
   closes it instead). Then the dialler and the peer run the swarm key handshake end to end, under
   ``h``, naming each other, and ``h``'s protocol.

The peer believes a preamble only from the relays it trusts (:func:`swarm.p2p._relay.trust_relays`).
The relay is :class:`swarm.p2p.RelayForwarder`; this module holds the wire format and both ends.
"""

from __future__ import annotations

import asyncio
import enum
import re
from typing import TYPE_CHECKING, Any

from swarm.p2p._auth import StreamKey, authenticate_dialled
from swarm.p2p._framing import ProtocolError, dump_json, parse_json, read_message, write_message
from swarm.p2p._relay import relays_of

if TYPE_CHECKING:
    from hivemind.p2p import P2P

FORWARD_HANDLER = "swarm.relay.forward.v1"
RELAYED_SUFFIX = ".relayed"
"""A service registers ``handler + RELAYED_SUFFIX`` for streams a relay forwards to it. A relay opens only
such handlers, so forwarding reaches swarm services and nothing else on the peer's daemon."""

MAX_CONTROL_BYTES = 1024
PEER_ID = re.compile(r"^[1-9A-HJ-NP-Za-km-z]{20,80}$")
"""A base58 libp2p peer id."""
HANDLER = re.compile(r"^[A-Za-z0-9._/-]{1,200}$")


class ForwardKind(enum.IntEnum):
    FORWARD = 0x71
    PREAMBLE = 0x72
    READY = 0x73
    REFUSED = 0x74


async def read_control(reader: asyncio.StreamReader, timeout: float) -> tuple[ForwardKind, dict[str, Any]]:
    kind, payload = await read_message(reader, ForwardKind, lambda kind: MAX_CONTROL_BYTES, timeout)
    return kind, parse_json(payload)


async def send_control(
    writer: asyncio.StreamWriter, kind: ForwardKind, body: dict[str, Any], timeout: float
) -> None:
    await write_message(writer, kind, dump_json(body), timeout)


def field(body: dict[str, Any], name: str, pattern: re.Pattern[str]) -> str:
    """``body[name]`` if it is a string matching ``pattern``; ProtocolError naming the field otherwise."""
    value = body.get(name)
    if not isinstance(value, str) or not pattern.match(value):
        raise ProtocolError(f"bad {name!r} in relay message: {str(value)[:80]!r}")
    return value


async def read_preamble(reader: asyncio.StreamReader, timeout: float) -> str:
    """The peer id a relay says a forwarded stream comes from."""
    kind, body = await read_control(reader, timeout)
    if kind is not ForwardKind.PREAMBLE:
        raise ProtocolError(f"expected PREAMBLE from the relay, got {kind.name}")
    return field(body, "from", PEER_ID)


async def send_ready(writer: asyncio.StreamWriter, timeout: float) -> None:
    """The peer's answer to a preamble it accepts."""
    await send_control(writer, ForwardKind.READY, {}, timeout)


async def open_via_relays(
    p2p: P2P, peer: str, handler: str, swarm_key: StreamKey | None, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``handler`` on ``peer`` through the first of its relays that forwards it.

    The stream is ready for the end-to-end handshake; raises ConnectionError naming each relay's failure.
    """
    errors = []
    for relay_maddr, relay_id in relays_of(peer):
        try:
            return await _open_via(p2p, relay_maddr, relay_id, peer, handler, swarm_key, timeout)
        except Exception as exc:  # a broken protocol, or hivemind's P2PHandlerError: unreachable relay
            errors.append(f"relay {relay_id}: {type(exc).__name__}: {exc}")
    raise ConnectionError(
        f"peer {peer} is reachable only through relays, and none forwarded: {'; '.join(errors)}"
    )


async def _open_via(
    p2p: P2P,
    relay_maddr: str,
    relay_id: str,
    peer: str,
    handler: str,
    swarm_key: StreamKey | None,
    timeout: float,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    from hivemind.p2p import PeerID

    await _connect(p2p, relay_id, relay_maddr, timeout)
    _, reader, writer = await asyncio.wait_for(
        p2p.call_binary_stream_handler(PeerID.from_base58(relay_id), FORWARD_HANDLER), timeout
    )
    try:
        await authenticate_dialled(p2p, reader, writer, swarm_key, FORWARD_HANDLER, relay_id, timeout)
        await send_control(writer, ForwardKind.FORWARD, {"to": peer, "handler": handler}, timeout)
        kind, body = await read_control(reader, timeout)
        if kind is ForwardKind.REFUSED:
            raise ConnectionError(f"refused: {str(body.get('reason'))[:200]}")
        if kind is not ForwardKind.READY:
            raise ProtocolError(
                f"expected READY (from the peer) or REFUSED (from the relay), got {kind.name}"
            )
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _connect(p2p: P2P, peer_id: str, maddr: str, timeout: float) -> None:
    """Connect the daemon to the relay at ``maddr`` if it is not already; failures are left to the stream.

    hivemind's ``P2P`` has no public call for this; its daemon client has ``connect``.
    """
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    try:
        address = Multiaddr(maddr.rsplit("/p2p/", 1)[0])
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), [address]), timeout)
    except Exception:  # the stream open that follows fails with the daemon's own reason
        return
