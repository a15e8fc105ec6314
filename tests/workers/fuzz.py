"""Shared pieces of the in-process fuzz tests (tests/test_fuzz_*.py): settings, a time bound, fake
streams and peers, and the strategy that mutates a scripted message stream."""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import logging
import struct
import zlib
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any, TypeVar

from hivemind.p2p import PeerID
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from swarm.compression import CODEC_NAMES, HEADER_SIZE, get_codec
from swarm.p2p import HEADER_LEN

T = TypeVar("T")
CASE_TIMEOUT_S = 5.0
"""Every fuzz case must end (accepted or cleanly rejected) within this bound."""


def fuzz_settings(max_examples: int) -> settings:
    """Reproducible in CI: derandomized, no example database, no per-example deadline (the time
    bound is CASE_TIMEOUT_S, enforced by `bounded`)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def bounded(coro: Coroutine[Any, Any, T], timeout: float = CASE_TIMEOUT_S) -> T:
    """Run ``coro`` in a fresh event loop; a hang past ``timeout`` fails the test (not a clean rejection)."""

    async def guarded() -> T:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait([task], timeout=timeout)
        if not done:
            task.cancel()
            raise AssertionError(f"hung for more than {timeout}s")
        return task.result()

    return asyncio.run(guarded())


class Kind(enum.IntEnum):
    """Message kinds for framing tests that are not tied to one protocol."""

    HELLO = 1
    DATA = 5


class FakeWriter:
    """The writing half of a stream, collecting what is written (``asyncio.StreamWriter``'s surface)."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        if self.closed:
            raise ConnectionResetError("write to a closed stream")
        self.data += chunk

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("drain on a closed stream")

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    async def wait_closed(self) -> None:
        return None


def with_crc(body: bytearray) -> bytes:
    crc = zlib.crc32(bytes(body[HEADER_SIZE:]), zlib.crc32(bytes(body[: HEADER_SIZE - 4])))
    body[HEADER_SIZE - 4 : HEADER_SIZE] = struct.pack("<I", crc)
    return bytes(body)


_interesting = st.sampled_from([0, 1, 2, 63, 64, 65, 2**31, 2**32 - 1, 2**62, 2**64 - 1])


@st.composite
def crafted_frames(draw: st.DrawFn) -> bytes:
    """A frame whose header fields are arbitrary but mostly plausible, with a consistent checksum and
    length, so the decoder's semantic checks (not the crc) have to catch every lie."""
    ndim = draw(st.integers(0, 3))
    shape = [draw(st.integers(0, 70) | _interesting) for _ in range(ndim)]
    name = draw(st.sampled_from([b"w", b"v"]) | st.binary(min_size=1, max_size=4))
    codec_id = draw(st.integers(1, 5))
    quantized = codec_id >= 4
    block = draw(st.sampled_from([16, 64]) if quantized else st.just(0)) if draw(st.booleans()) else 0
    block = draw(st.sampled_from([0, 16, 48, 2**20])) if not draw(st.integers(0, 7)) else block
    count = draw(st.integers(0, 200) | _interesting)
    payload_len = draw(st.integers(0, 300))
    valid_block = block in (16, 64) or (block == 0 and not quantized)  # get_codec refuses 48 and 2**20
    if draw(st.booleans()) and count < 1000 and valid_block:
        payload_len = get_codec(CODEC_NAMES[codec_id - 1], block or 64).payload_nbytes(count)
    fields = [
        b"SWQF",
        1,
        codec_id,
        draw(st.integers(1, 4)),
        ndim,
        len(name),
        0,
        block,
        draw(st.integers(0, 3) | _interesting.filter(lambda v: v < 2**32)),
        draw(st.integers(1, 3) | _interesting.filter(lambda v: v < 2**32)),
        draw(st.sampled_from([0, 16, 64]) | _interesting),
        count,
        payload_len if draw(st.integers(0, 7)) else draw(_interesting),
        0,
    ]
    head = bytearray(struct.pack("<4sBBBBHHIIIQQQI", *fields))
    payload = draw(st.binary(min_size=min(payload_len, 2048), max_size=min(payload_len, 2048)))
    return with_crc(head + struct.pack(f"<{ndim}Q", *shape) + name + payload)


def peer_id(label: str) -> PeerID:
    return PeerID(hashlib.sha256(label.encode()).digest())


_counter = iter(range(1 << 30))


def fresh_peer() -> PeerID:
    """A new peer id per case: a peer whose exchange failed is banned for a while."""
    return peer_id(f"peer-{next(_counter)}")


class FakeP2P:
    """The surface of ``hivemind.p2p.P2P`` the averager and the state server use. A dial returns a
    reader holding ``script`` (the scripted other side, then EOF) and a writer that records."""

    def __init__(self, label: str) -> None:
        self.peer_id = peer_id(label)
        self.handlers: dict[str, Callable[..., Any]] = {}
        self.script = b""
        self.writers: list[FakeWriter] = []

    async def add_binary_stream_handler(self, name: str, handler: Callable[..., Any]) -> None:
        self.handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self.handlers.pop(name, None)

    async def call_binary_stream_handler(
        self, peer: PeerID, name: str
    ) -> tuple[Any, asyncio.StreamReader, FakeWriter]:
        reader = asyncio.StreamReader()
        reader.feed_data(self.script)
        reader.feed_eof()
        writer = FakeWriter()
        self.writers.append(writer)
        return SimpleNamespace(peer_id=peer), reader, writer

    async def shutdown(self) -> None:
        return None

    async def factory(self) -> FakeP2P:
        """A ``p2p_factory`` for a service under test: it serves on this fake."""
        return self


def serve_stream(
    service: Any, p2p: FakeP2P, handler: str, data: bytes, eof: bool = True, peer: PeerID | None = None
) -> bytes:
    """Run ``handler`` (registered on ``p2p`` by ``service``, a ``StreamService``) on ``data`` from
    ``peer`` (a fresh one by default), on the service's own loop; return what it wrote back."""
    writer = FakeWriter()

    async def run() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        if eof:
            reader.feed_eof()
        # addr: the remote address of the stream's connection, as the daemon reports it (a direct one)
        info = SimpleNamespace(peer_id=peer or fresh_peer(), addr="/ip4/127.0.0.1/tcp/4001")
        await asyncio.wait_for(p2p.handlers[handler](info, reader, writer), CASE_TIMEOUT_S)

    service._loop.run(run(), timeout=CASE_TIMEOUT_S + 1)
    return bytes(writer.data)


def msg(kind: int, payload: bytes = b"", length: int | None = None) -> bytes:
    size = len(payload) if length is None else length
    return bytes([kind]) + size.to_bytes(4, "big") + payload


def jmsg(kind: int, obj: object) -> bytes:
    return msg(kind, json.dumps(obj).encode())


def parse_messages(data: bytes) -> list[tuple[int, bytes]]:
    """Split what a handler wrote into (kind, payload); fails the test if it is not well-formed."""
    out, at = [], 0
    while at < len(data):
        assert len(data) - at >= HEADER_LEN, f"truncated header in the handler's output at {at}"
        length = int.from_bytes(data[at + 1 : at + HEADER_LEN], "big")
        end = at + HEADER_LEN + length
        assert end <= len(data), "the handler wrote a truncated message"
        out.append((data[at], data[at + HEADER_LEN : end]))
        at = end
    return out


class ErrorLog(logging.Handler):
    """Collects ERROR records of the ``swarm`` loggers: what a handler logs for an unexpected exception."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def check(self) -> None:
        found = [
            f"{r.getMessage()} ({r.exc_info[1]!r})" if r.exc_info else r.getMessage() for r in self.records
        ]
        self.records.clear()
        assert not found, f"unclean rejection logged: {found}"


# ------------------------------------------------------------------------- mutating a script

garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70) | st.sampled_from([2**64, -(2**63) - 1, 10**400, -(10**400)]),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_lengths = st.sampled_from(
    [0, 1, 4097, 2**16, 2**16 + 1, 4096 + 65536, 4096 + 65537, 2**24 + 1, 2**31, 2**32 - 1]
)
"""Announced lengths around the protocols' limits (request, control, DATA with 4 KiB chunks, header)."""
OPS = ("drop", "dup", "swap", "kind", "length", "insert", "field", "hostile", "flip", "truncate")
HOSTILE_JSON = ("1e400", "NaN", "-Infinity", "1" + "0" * 400, "9" * 5000, "[" * 5000 + "]" * 5000, "{}")
"""JSON that json.dumps never writes but a hostile peer can: overflowing floats, NaN, integers
float() cannot convert or Python refuses to parse, nesting past the recursion limit."""


@st.composite
def mutated(draw: st.DrawFn, script: list[bytes], json_at: dict[int, dict[str, Any]]) -> bytes:
    """``script`` (one bytes object per message) after 1-3 random mutations; ``json_at`` maps message
    indices to their JSON bodies, whose fields the "field" and "hostile" mutations replace."""
    msgs = list(script)
    bodies = {i: dict(body) for i, body in json_at.items()}
    tail_ops = []
    for op in draw(st.lists(st.sampled_from(OPS), min_size=1, max_size=3)):
        i = draw(st.integers(0, max(0, len(msgs) - 1)))
        if op in ("flip", "truncate"):
            tail_ops.append(op)
        elif not msgs:
            continue
        elif op == "drop":
            del msgs[i]
        elif op == "dup":
            msgs.insert(draw(st.integers(0, len(msgs))), msgs[i])
        elif op == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        elif op == "kind":
            msgs[i] = bytes([draw(st.integers(0, 255))]) + msgs[i][1:]
        elif op == "length":
            msgs[i] = msgs[i][:1] + draw(_lengths).to_bytes(4, "big") + msgs[i][HEADER_LEN:]
        elif op == "insert":
            kind = draw(st.integers(1, 8) | st.integers(0, 255))
            msgs.insert(i, msg(int(kind), draw(st.binary(max_size=40))))
        elif op == "field" and i in bodies and msgs[i] is script[i]:
            body = bodies[i]
            key = draw(st.sampled_from([*body, "extra"]))
            if draw(st.booleans()) and key in body:
                del body[key]
            else:
                body[key] = draw(garbage)
            msgs[i] = jmsg(script[i][0], body)
        elif op == "hostile" and i in bodies and msgs[i] is script[i]:
            key = draw(st.sampled_from(sorted(bodies[i])))
            msgs[i] = _with_raw_value(script[i][0], bodies[i], key, draw(st.sampled_from(HOSTILE_JSON)))
    raw = b"".join(msgs)
    for op in tail_ops:
        if op == "truncate" and raw:
            raw = raw[: draw(st.integers(0, len(raw) - 1))]
        elif op == "flip" and raw:
            bit = draw(st.integers(0, 8 * len(raw) - 1))
            flipped = bytearray(raw)
            flipped[bit // 8] ^= 1 << (bit % 8)
            raw = bytes(flipped)
    return raw


def _with_raw_value(kind: int, body: dict[str, Any], key: str, raw: str) -> bytes:
    """A JSON message like ``body`` but with ``raw`` JSON text as the value of ``key``."""
    return msg(kind, json.dumps({**body, key: "@"}).replace('"@"', raw).encode())


def hostile_variants(script: list[bytes], json_at: dict[int, dict[str, Any]]) -> list[bytes]:
    """Every HOSTILE_JSON value in every field of every JSON message of ``script``, one at a time
    (deterministic: a handful of random examples would rarely hit each one)."""
    return [
        b"".join([*script[:i], _with_raw_value(script[i][0], body, key, raw), *script[i + 1 :]])
        for i, body in json_at.items()
        for key in sorted(body)
        for raw in HOSTILE_JSON
    ]
