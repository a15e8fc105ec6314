"""Length-prefixed messages on a p2p stream, shared by swarm's protocols (gossip, state transfer).

A message is one kind byte, a 4-byte big-endian payload length, then the payload. The reader checks
the kind and bounds the length before reading the payload, so a peer cannot make us allocate more
than the limit, and every read and write has a timeout.
"""

from __future__ import annotations

import asyncio
import enum
import json
from collections.abc import Callable
from typing import Any, TypeVar

HEADER_LEN = 5

K = TypeVar("K", bound=enum.IntEnum)


class ProtocolError(Exception):
    """The other side broke the protocol: unexpected message, malformed header or payload."""


async def write_message(
    writer: asyncio.StreamWriter, kind: enum.IntEnum, payload: bytes | memoryview, timeout: float
) -> int:
    """Send one message; return the bytes it put on the stream."""
    writer.write(bytes([kind]) + len(payload).to_bytes(4, "big"))
    if payload:
        writer.write(payload)
    await asyncio.wait_for(writer.drain(), timeout)
    return HEADER_LEN + len(payload)


async def read_message(
    reader: asyncio.StreamReader, kinds: type[K], limit: Callable[[K], int], timeout: float
) -> tuple[K, bytes]:
    """Read one message whose kind is a member of ``kinds`` and whose payload is within ``limit(kind)``."""
    header = await asyncio.wait_for(reader.readexactly(HEADER_LEN), timeout)
    try:
        kind = kinds(header[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind {header[0]}") from None
    length = int.from_bytes(header[1:], "big")
    if length > limit(kind):
        raise ProtocolError(f"{kind.name} message of {length} bytes exceeds the limit of {limit(kind)}")
    payload = await asyncio.wait_for(reader.readexactly(length), timeout) if length else b""
    return kind, payload


def dump_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json(payload: bytes) -> dict[str, Any]:
    """A JSON object from a control message; ProtocolError for anything else."""
    try:
        obj = json.loads(payload.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("message is not a JSON object")
    return obj
