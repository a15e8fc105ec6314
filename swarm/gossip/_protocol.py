"""Message framing and handshake for one gossip exchange over a hivemind binary stream.

Every message on the stream is ``kind (1 byte) | length (4 bytes, big endian) | payload``.
Control messages carry a small JSON object (never pickle); ``DATA`` messages carry one codec frame
from :mod:`swarm.compression`, which is self-describing and validated by its own decoder.

Sequence (both sides run the data phase concurrently, in both directions at once)::

    initiator                      responder
    HELLO  ───────────────────────▶
           ◀─────────────────────── ACCEPT | BUSY | REJECT
    DATA* , END  ─────────────────▶   (concurrently)
           ◀─────────────────────── DATA* , END
    ACK | NACK ───────────────────▶   (concurrently)
           ◀─────────────────────── ACK | NACK

A side commits only after it validated everything it received, sent its ACK, and received the
partner's ACK (see docs/gossip.md, "Commit rule").

In a private swarm (a swarm key is set) both sides first run the swarm key handshake of
:mod:`swarm.p2p` on the stream; HELLO is only sent and read once both proved the key.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from swarm._protocol import PROTOCOL_VERSION, protocol_id
from swarm.gossip._bases import BASE_ID
from swarm.p2p import ProtocolError, dump_json, parse_json, read_message, write_message

__all__ = [
    "CONTROL_MAX_BYTES",
    "PROTOCOL_VERSION",
    "Channel",
    "Hello",
    "MsgKind",
    "ProtocolError",
    "handler_name",
    "parse_json",
]

CONTROL_MAX_BYTES = 64 * 1024
MAX_PROBE = 1024
"""Most values a HELLO's ``probe`` may carry (a sample of the sender's state, see docs/gossip.md)."""


class MsgKind(enum.IntEnum):
    HELLO = 1
    ACCEPT = 2
    BUSY = 3
    REJECT = 4
    DATA = 5
    END = 6
    ACK = 7
    NACK = 8


# A base push (``push`` in HELLO) runs HELLO, ACCEPT, the pusher's DATA* and END, then the receiver's
# ACK or NACK: nothing comes back but the verdict, and nothing is mixed.


def handler_name(run_id: str) -> str:
    """The libp2p protocol id of the gossip handler: namespaced by protocol version and run."""
    return protocol_id("gossip", run_id)


class Channel:
    """A framed, byte-counted, timeout-guarded view of one bidirectional p2p stream. The byte counts
    move with every piece of a message, not once it is whole: the rate floor reads them mid-message,
    along with :meth:`read_wait_s`, the time we spent waiting on the partner's bytes."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        chunk_timeout_s: float,
        max_data_bytes: int,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._timeout = chunk_timeout_s
        self._max_data_bytes = max_data_bytes
        self.bytes_sent = 0
        self.bytes_received = 0
        self._read_wait_s = 0.0
        self._reading_since: float | None = None

    async def send(self, kind: MsgKind, payload: bytes | memoryview = b"") -> None:
        await write_message(self._writer, kind, payload, self._timeout, self._sent)

    async def send_json(self, kind: MsgKind, obj: dict[str, Any]) -> None:
        await self.send(kind, dump_json(obj))

    async def recv(self) -> tuple[MsgKind, bytes]:
        """Read one message; raises ProtocolError on an unknown kind or an oversized length."""
        self._reading_since = time.monotonic()
        try:
            return await read_message(self._reader, MsgKind, self._limit, self._timeout, self._received)
        finally:
            self._read_wait_s += time.monotonic() - self._reading_since
            self._reading_since = None

    def read_wait_s(self) -> float:
        """Seconds spent inside :meth:`recv` so far, a read in progress included: waiting on the
        partner's bytes, not on our own work (decoding, mixing) between two reads."""
        ongoing = 0.0 if self._reading_since is None else time.monotonic() - self._reading_since
        return self._read_wait_s + ongoing

    def _sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes

    def _received(self, nbytes: int) -> None:
        self.bytes_received += nbytes

    def _limit(self, kind: MsgKind) -> int:
        return self._max_data_bytes if kind is MsgKind.DATA else CONTROL_MAX_BYTES

    async def recv_expect(self, *kinds: MsgKind) -> tuple[MsgKind, bytes]:
        kind, payload = await self.recv()
        if kind not in kinds:
            expected = "/".join(k.name for k in kinds)
            raise ProtocolError(f"expected {expected}, got {kind.name}")
        return kind, payload

    def close(self) -> None:
        self._writer.close()


@dataclass(frozen=True)
class Hello:
    """What each side states about itself before any tensor data moves (HELLO and ACCEPT)."""

    version: int
    run_id: str
    config_hash: str
    schema_hash: str
    codec: str
    block_size: int
    weight: float
    probe: tuple[float, ...] = ()
    base: str = ""
    """The shared base (:mod:`swarm.gossip._bases`) this side holds with the partner and proposes to
    send relative to ("": none); the exchange uses one only when both HELLOs name the same."""
    push: bool = False
    """A base push instead of an exchange: the sender's frames become the base named ``base``."""

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["probe"] = list(self.probe)
        return body

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Hello:
        try:
            hello = cls(
                version=_typed(obj, "version", int),
                run_id=_typed(obj, "run_id", str),
                config_hash=_typed(obj, "config_hash", str),
                schema_hash=_typed(obj, "schema_hash", str),
                codec=_typed(obj, "codec", str),
                block_size=_typed(obj, "block_size", int),
                weight=float(_typed(obj, "weight", (int, float))),
                probe=_probe(obj.get("probe", [])),
                base=_base_id(obj.get("base", "")),
                push=_flag(obj.get("push", False), "push"),
            )
        except KeyError as exc:
            raise ProtocolError(f"handshake lacks field {exc}") from None
        _weight(hello.weight, "weight")
        return hello

    def mismatch(self, other: Hello) -> str | None:
        """Why ``other`` cannot exchange with us, or None if it can."""
        if self.version != other.version:
            return (
                f"version differs (ours {self.version!r}, theirs {other.version!r}): protocol version "
                f"{other.version} is not spoken here; run the same swarm release on every peer"
            )
        for name in ("run_id", "config_hash", "schema_hash", "codec", "block_size"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{name} differs (ours {mine!r}, theirs {theirs!r})"
        if self.push != other.push:
            return "one side pushes a base, the other exchanges"
        return None


def _weight(value: float, what: str) -> float:
    value = float(value)
    if not (math.isfinite(value) and 0.0 < value < 1e30):
        raise ProtocolError(f"handshake {what} {value!r} is not a finite positive number")
    return value


def _base_id(value: Any) -> str:
    """The optional base name: "" or :data:`~swarm.gossip._bases.BASE_ID`'s 16 hex digits."""
    if not isinstance(value, str) or (value and not BASE_ID.fullmatch(value)):
        raise ProtocolError("handshake field 'base' must be empty or 16 lowercase hex digits")
    return value


def _flag(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ProtocolError(f"handshake field {key!r} must be true or false")
    return value


def _probe(value: Any) -> tuple[float, ...]:
    """The optional probe: a list of at most MAX_PROBE numbers (parse_json already refused NaN/Inf)."""
    if not isinstance(value, list) or len(value) > MAX_PROBE:
        raise ProtocolError(f"handshake field 'probe' must be a list of at most {MAX_PROBE} numbers")
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in value):
        raise ProtocolError("handshake field 'probe' holds something other than numbers")
    return tuple(float(v) for v in value)


def _typed(obj: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, types):
        raise ProtocolError(f"handshake field {key!r} has the wrong type")
    return value
