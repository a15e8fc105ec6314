"""Mutual challenge-response authentication of a p2p stream with the swarm key (private swarms).

Every swarm protocol on a raw stream (gossip, state transfer, reachability dial-back) calls
:func:`authenticate_stream` first, before reading anything else, when a swarm key is configured::

    initiator                                   responder
    NONCE n_i  ───────────────────────────────▶
               ◀─────────────────────────────── NONCE n_r   (sent at once: random, says nothing)
    PROOF p_i  ───────────────────────────────▶   (checked before anything key-dependent is sent)
               ◀─────────────────────────────── PROOF p_r
    (then the protocol's own first message)

``p = HMAC-SHA256(sub-key, role | protocol | initiator id | responder id | n_i | n_r)``. The dialler
proves first: anyone can open a stream to a peer, and one without the key gets only a random nonce back,
nothing it could test key guesses against offline. The dialler only dials peers it chose (from the
key-authenticated DHT, or the initial peers its user named), and still sends no protocol data before
the responder has proved too. Fresh nonces from both sides stop replays; the role stops reflecting one
side's proof back to it; the peer ids (which libp2p authenticates) and the protocol name stop relaying
a handshake to another peer or protocol. Without a key nothing of this is sent: the wire is unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import hashlib
import hmac
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from swarm._errors import SwarmError
from swarm.p2p._framing import ProtocolError, read_message, write_message

if TYPE_CHECKING:
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

NONCE_BYTES = 32
PROOF_BYTES = 32
_DOMAIN = b"swarm-stream-auth-v2"


class StreamKey(Protocol):
    """What the handshake needs of a swarm key (:class:`swarm.network.SwarmKey`): derived sub-keys."""

    def derive(self, purpose: str) -> bytes: ...


def swarm_key_of(source: DHT | P2P | None) -> StreamKey | None:
    """The swarm key a DHT was started with (:func:`swarm.network.start_dht`); None for a public swarm
    (and for anything else: only our own ``start_dht`` records a key on the DHT)."""
    return getattr(source, "swarm_key", None)


class AuthError(SwarmError):
    """The other side of a stream did not prove that it holds the swarm key (or broke the handshake)."""


class AuthKind(enum.IntEnum):
    """Message kinds outside every protocol's own kinds, so a peer without a key fails on the first one."""

    NONCE = 0x61
    PROOF = 0x62
    REFUSED = 0x63
    """The responder's answer to a wrong proof (empty: it tells nothing but that the proof was wrong)."""


async def authenticate_stream(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    key: StreamKey,
    initiator: bool,
    protocol: str,
    local_peer: str,
    remote_peer: str,
    timeout: float,
) -> None:
    """Run the handshake within ``timeout`` seconds; raise :class:`AuthError` naming the peer if it fails.

    On failure the caller closes the stream and reads nothing more from it.
    """
    mac_key = key.derive("stream-auth-v2")
    ids = (local_peer, remote_peer) if initiator else (remote_peer, local_peer)
    prove = functools.partial(_proof, mac_key, protocol, ids)
    try:
        async with asyncio.timeout(timeout):
            if initiator:
                await _initiate(reader, writer, prove, remote_peer, timeout)
            else:
                await _respond(reader, writer, prove, remote_peer, timeout)
    except AuthError:
        raise
    except TimeoutError:
        raise AuthError(
            f"peer {remote_peer} did not complete the swarm key handshake within {timeout}s"
        ) from None
    except (ProtocolError, ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
        raise AuthError(
            f"swarm key handshake with peer {remote_peer} failed ({type(exc).__name__}: {exc}); "
            "does it hold the swarm key?"
        ) from None


Prove = Callable[[bytes, bytes, bytes], bytes]
"""(role, initiator nonce, responder nonce) -> proof, for one stream's key, protocol and peers."""


async def _initiate(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prove: Prove, peer: str, timeout: float
) -> None:
    nonce_i, nonce_r = await _swap_nonces(reader, writer, timeout)
    await write_message(writer, AuthKind.PROOF, prove(b"initiator", nonce_i, nonce_r), timeout)
    try:
        kind, proof_r = await read_message(reader, AuthKind, lambda kind: PROOF_BYTES, timeout)
    except (ProtocolError, ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
        raise AuthError(
            f"peer {peer} did not prove the swarm key after our proof ({type(exc).__name__}); "
            "does it hold the same swarm key?"
        ) from None
    if kind is AuthKind.REFUSED:
        raise AuthError(
            f"peer {peer} refused our proof: wrong swarm key proof (it holds another key, or none)"
        )
    if kind is not AuthKind.PROOF or len(proof_r) != PROOF_BYTES:
        raise ProtocolError(f"expected a {PROOF_BYTES}-byte PROOF, got {kind.name} ({len(proof_r)} bytes)")
    _check(proof_r, prove(b"responder", nonce_i, nonce_r), peer)


async def _respond(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prove: Prove, peer: str, timeout: float
) -> None:
    nonce_r, nonce_i = await _swap_nonces(reader, writer, timeout)
    proof_i = await _read(reader, AuthKind.PROOF, timeout)
    try:
        _check(proof_i, prove(b"initiator", nonce_i, nonce_r), peer)  # before we reveal anything keyed
    except AuthError:
        with contextlib.suppress(Exception):
            await write_message(writer, AuthKind.REFUSED, b"", timeout)
        raise
    await write_message(writer, AuthKind.PROOF, prove(b"responder", nonce_i, nonce_r), timeout)


async def _swap_nonces(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float
) -> tuple[bytes, bytes]:
    """Send a fresh nonce and read the peer's (both sides do, in this order): ``(ours, theirs)``."""
    ours = secrets.token_bytes(NONCE_BYTES)
    await write_message(writer, AuthKind.NONCE, ours, timeout)
    return ours, await _read(reader, AuthKind.NONCE, timeout)


async def _read(reader: asyncio.StreamReader, expected: AuthKind, timeout: float) -> bytes:
    size = NONCE_BYTES if expected is AuthKind.NONCE else PROOF_BYTES
    kind, payload = await read_message(reader, AuthKind, lambda kind: size, timeout)
    if kind is not expected or len(payload) != size:
        raise ProtocolError(f"expected a {size}-byte {expected.name}, got {kind.name} ({len(payload)} bytes)")
    return payload


def _proof(
    mac_key: bytes, protocol: str, ids: tuple[str, str], role: bytes, nonce_i: bytes, nonce_r: bytes
) -> bytes:
    fields = (_DOMAIN, role, protocol.encode(), ids[0].encode(), ids[1].encode(), nonce_i, nonce_r)
    message = b"".join(len(field).to_bytes(4, "big") + field for field in fields)
    return hmac.new(mac_key, message, hashlib.sha256).digest()


def _check(received: bytes, expected: bytes, peer: str) -> None:
    if not hmac.compare_digest(received, expected):
        raise AuthError(f"peer {peer} sent a wrong swarm key proof (it holds another key, or none)")


async def authenticate_dialled(
    p2p: Any,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    key: StreamKey | None,
    protocol: str,
    remote_peer: str,
    timeout: float,
) -> None:
    """The dialler's side of the handshake on a stream ``p2p`` opened (nothing without a key); on
    failure the stream is closed before the error propagates."""
    if key is None:
        return
    try:
        await authenticate_stream(
            reader,
            writer,
            key=key,
            initiator=True,
            protocol=protocol,
            local_peer=p2p.peer_id.to_base58(),
            remote_peer=remote_peer,
            timeout=timeout,
        )
    except BaseException:
        writer.close()
        raise
