"""Length-prefixed messages on a p2p stream, shared by swarm's protocols (gossip, state transfer,
reachability), and the strict JSON parser of their control messages.

A message is one kind byte, a 4-byte big-endian payload length, then the payload. The reader checks
the kind and bounds the length before reading the payload, so a peer cannot make us allocate more
than the limit.

Every read and write has a timeout on *progress*, not on the whole message: a payload moves in pieces
of :data:`PROGRESS_BYTES`, and each piece must move within the timeout. So a large message over a slow
link takes as long as it needs, while a partner that stops sending (or reading) is dropped after one
timeout, whatever the message's size. Bounds on a whole exchange are the caller's (the gossip
averager's deadlines grow with the exchange's size over the rate measured to that partner).
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from swarm._errors import SwarmError

HEADER_LEN = 5

K = TypeVar("K", bound=enum.IntEnum)
T = TypeVar("T")


class ProtocolError(SwarmError):
    """The other side broke the protocol: unexpected message, malformed header or payload."""


PROGRESS_BYTES = 64 * 1024
"""A message's payload moves in pieces of this size; each must move within the read/write timeout."""


class StalledError(TimeoutError):
    """The other side moved no piece of a message within the timeout (it stopped sending or reading)."""


Progress = Callable[[int], None]
"""Called with the bytes of each header and piece as it moves: a caller's byte count that keeps up
with a large message (a 1 MiB chunk takes tens of seconds over a home link)."""


def _ignore(_: int) -> None:
    pass


async def write_message(
    writer: asyncio.StreamWriter,
    kind: enum.IntEnum,
    payload: bytes | memoryview,
    timeout: float,
    progress: Progress = _ignore,
) -> int:
    """Send one message; return the bytes it put on the stream. Raises :class:`StalledError` when a
    piece of it cannot be handed on within ``timeout`` seconds (the reader stopped reading)."""
    view = memoryview(payload).cast("B")
    writer.write(bytes([kind]) + len(view).to_bytes(4, "big"))
    progress(HEADER_LEN)
    for start in range(0, len(view), PROGRESS_BYTES):
        piece = view[start : start + PROGRESS_BYTES]
        writer.write(piece)
        await _within(writer.drain(), timeout, "sent")
        progress(len(piece))
    if not len(view):
        await _within(writer.drain(), timeout, "sent")
    return HEADER_LEN + len(view)


async def read_message(
    reader: asyncio.StreamReader,
    kinds: type[K],
    limit: Callable[[K], int],
    timeout: float,
    progress: Progress = _ignore,
) -> tuple[K, bytes]:
    """Read one message whose kind is a member of ``kinds`` and whose payload is within ``limit(kind)``.

    Raises :class:`StalledError` when no piece of it arrives within ``timeout`` seconds."""
    header = await _within(reader.readexactly(HEADER_LEN), timeout, "received")
    progress(HEADER_LEN)
    try:
        kind = kinds(header[0])
    except ValueError:
        raise ProtocolError(f"unknown message kind {header[0]}") from None
    length = int.from_bytes(header[1:], "big")
    if length > limit(kind):
        raise ProtocolError(f"{kind.name} message of {length} bytes exceeds the limit of {limit(kind)}")
    if length <= PROGRESS_BYTES:
        payload = await _within(reader.readexactly(length), timeout, "received") if length else b""
        progress(length)
        return kind, payload
    pieces, received = [], 0
    while received < length:
        piece = await _within(reader.readexactly(min(PROGRESS_BYTES, length - received)), timeout, "received")
        pieces.append(piece)
        received += len(piece)
        progress(len(piece))
    return kind, b"".join(pieces)  # one copy of the payload (a growing bytearray, then bytes(), took two)


async def _within(step: Awaitable[T], timeout: float, what: str) -> T:
    """``step`` within ``timeout`` seconds, honouring a cancellation that arrives as it completes.

    On Python 3.11 ``wait_for`` returns the step's result when the task is cancelled in the same
    instant, and the cancellation is lost: an aborted exchange would run on into a partner's stall.
    The task still counts the request (``cancelling()``), so it is raised here.
    """
    try:
        result = await asyncio.wait_for(step, timeout)
    except TimeoutError:
        raise StalledError(f"nothing {what} for {timeout:g} s (the other side stalled)") from None
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    return result


MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays/objects a control message may have (ours use two or three levels)."""


def dump_json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def parse_json(payload: bytes) -> dict[str, Any]:
    """A JSON object from a control message; ProtocolError for anything else.

    Rejected too: NaN/Infinity (and numbers that overflow to them), integers outside the 64-bit
    range (``float(10**400)`` raises OverflowError in whoever reads such a field), and nesting
    deeper than MAX_JSON_DEPTH, so callers only ever see plain, finite, shallow JSON.
    """
    try:
        obj = json.loads(
            payload.decode(),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            parse_int=_int64,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ProtocolError(f"malformed message: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("message is not a JSON object")
    if _depth(obj) > MAX_JSON_DEPTH:
        raise ProtocolError(f"message nests deeper than {MAX_JSON_DEPTH} levels")
    return obj


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} is out of range")
    return value


def _int64(text: str) -> int:
    if len(text) > 21:  # the longest 64-bit integer, with its sign, has 20 digits
        raise ValueError(f"integer {text[:24]}... is out of range")
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"integer {text} is out of range")
    return value


def _depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, computed without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest
