"""Wire protocol of state transfer: framed messages, the request, the verified header and assembly.

One raw hivemind binary stream per request. Every message is
``kind (1 byte) | length (4 bytes, big endian) | payload``::

    client                                                donor
    REQUEST {"digest", "part", "parts", "skip"}   ──────▶
                                                  ◀────── HEADER {"digest", "frames", "meta",
                                                                  "chunk_bytes", "hashes", "sending"}
                                                  ◀────── FRAME * sending   (the part's indices part,
                                                          part+parts, ..., less the first skip of them)
                                               or ◀────── ERROR {"error": "digest mismatch", ...}

The digest (:mod:`swarm.state._snapshot`) commits to the canonical JSON of the meta and to the
sha256 of every frame, in order. The client checks the header against the digest it expected, then
every frame against its hash, so a bad frame is pinned on the donor that sent it and no frame is used
before it is verified. A part that fails is asked of another donor with ``skip``: the frames of it
that arrived are not sent again.

A donor chooses its state's ``chunk_bytes``, so nothing the client waits for is counted in frames: the
receive floor (:class:`RecvFloor`) counts the bytes that arrive, header included, over time windows,
and a joiner takes frames of at most :data:`MAX_RECV_CHUNK_BYTES`.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import json
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from swarm._errors import SwarmError
from swarm._protocol import protocol_id
from swarm.compression import DecodeLimits, FrameError, TensorStreamDecoder
from swarm.p2p import ProtocolError, StreamKey, dial, dump_json, parse_json, read_message, write_message
from swarm.state._snapshot import StateSnapshot, build_snapshot, canonical_meta, state_digest

if TYPE_CHECKING:
    from hivemind.p2p import P2P

T = TypeVar("T")
REQUEST_MAX_BYTES = 4096
HEADER_MAX_BYTES = 16 << 20
MAX_PARTS = 256
MAX_FRAMES = (HEADER_MAX_BYTES - (1 << 20)) // 67  # one hex hash and its JSON punctuation each
IO_TIMEOUT_S = 20.0
"""Bound on dialling, on each message read and on each write drain, both sides."""
MIN_RECV_BYTES_PER_S = 32 << 10
"""Receive floor of a stream (:class:`RecvFloor`): after ``IO_TIMEOUT_S`` of grace, every window of
``IO_TIMEOUT_S`` must bring this rate's worth of bytes, or the donor is dropped (snubbed) and its part
reassigned. An honest donor drops us first below its own floor (``_server.MIN_SEND_BYTES_PER_S``, 4
times this)."""
MAX_RECV_CHUNK_BYTES = 4 << 20
"""Largest ``chunk_bytes`` a joiner accepts in a header (four times the 1 MiB every peer spools with):
bounds one frame message, and what one read may hold, whatever a donor's state declares."""


class Kind(enum.IntEnum):
    REQUEST = 1
    HEADER = 2
    FRAME = 3
    ERROR = 4


SERVICE = "state"
"""The service's name in its handler's protocol id (the server's ``StreamService.protocol``)."""


def handler_name(run_id: str) -> str:
    return protocol_id(SERVICE, run_id)


async def send(writer: asyncio.StreamWriter, kind: Kind, payload: bytes, timeout: float) -> None:
    await write_message(writer, kind, payload, timeout)


async def send_json(writer: asyncio.StreamWriter, kind: Kind, obj: dict[str, Any], timeout: float) -> None:
    await write_message(writer, kind, dump_json(obj), timeout)


async def recv(
    reader: asyncio.StreamReader,
    max_bytes: int,
    timeout: float,
    progress: Callable[[int], None] = lambda size: None,
) -> tuple[Kind, bytes]:
    """One message of at most ``max_bytes`` payload bytes; ProtocolError otherwise. ``progress`` hears
    of each piece's bytes as it arrives."""
    return await read_message(reader, Kind, lambda kind: max_bytes, timeout, progress)


def _field(obj: dict[str, Any], key: str, kind: type) -> Any:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ProtocolError(f"field {key!r} is missing or has the wrong type")
    return value


def is_digest(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True)
class Request:
    """Part ``part`` of ``parts`` of the state ``digest`` (its frames part, part+parts, ...), less the
    first ``skip`` of them: those another donor already delivered."""

    digest: str
    part: int
    parts: int
    skip: int = 0

    def encode(self) -> bytes:
        fields = {"digest": self.digest, "part": self.part, "parts": self.parts, "skip": self.skip}
        return json.dumps(fields).encode()

    @classmethod
    def parse(cls, payload: bytes) -> Request:
        obj = parse_json(payload)
        fields = (_field(obj, "digest", str), _field(obj, "part", int), _field(obj, "parts", int))
        request = cls(*fields, skip=_field(obj, "skip", int))
        if not is_digest(request.digest):
            raise ProtocolError("field 'digest' is not a sha256 hex digest")
        if not (1 <= request.parts <= MAX_PARTS and 0 <= request.part < request.parts):
            raise ProtocolError(f"part {request.part} of {request.parts} is out of range")
        if not 0 <= request.skip <= MAX_FRAMES:
            raise ProtocolError(f"field 'skip' {request.skip} is not in [0, {MAX_FRAMES}]")
        return request

    def indices(self, frames: int) -> range:
        """The frame indices to send of a state of ``frames`` frames; ProtocolError if ``skip`` passes
        the end of the part."""
        part = range(self.part, frames, self.parts)
        if self.skip > len(part):
            where = f"part {self.part}/{self.parts} ({len(part)} frames)"
            raise ProtocolError(f"field 'skip' {self.skip} passes the end of {where}")
        return part[self.skip :]


@dataclass(frozen=True)
class Header:
    """A donor's description of the state it holds, verified against the digest the client expects."""

    digest: str
    meta: dict[str, Any]
    chunk_bytes: int
    hashes: tuple[bytes, ...]
    sending: int

    @classmethod
    def parse(cls, payload: bytes, expected_digest: str) -> Header:
        obj = parse_json(payload)
        hashes_hex = _field(obj, "hashes", list)
        if len(hashes_hex) > MAX_FRAMES or _field(obj, "frames", int) != len(hashes_hex):
            raise ProtocolError("field 'frames' does not match the hash list (or is too large)")
        if not all(is_digest(h) for h in hashes_hex):
            raise ProtocolError("field 'hashes' holds something that is not a sha256 hex digest")
        header = cls(
            digest=_field(obj, "digest", str),
            meta=_field(obj, "meta", dict),
            chunk_bytes=_field(obj, "chunk_bytes", int),
            hashes=tuple(bytes.fromhex(h) for h in hashes_hex),
            sending=_field(obj, "sending", int),
        )
        if not 0 < header.chunk_bytes <= MAX_RECV_CHUNK_BYTES:
            raise ProtocolError(f"chunk_bytes {header.chunk_bytes} is not in [1, {MAX_RECV_CHUNK_BYTES}]")
        actual = state_digest(canonical_meta(header.meta), header.chunk_bytes, header.hashes)
        if header.digest != expected_digest or actual != expected_digest:
            raise ProtocolError(
                f"header hashes to {actual[:12]}..., not the announced {expected_digest[:12]}..."
            )
        return header


class StateTransferError(SwarmError):
    """A state download failed; the message names the donors involved and why."""


class SlowPeerError(ProtocolError):
    """The other side of a stream fell below its :class:`ProgressFloor` or :class:`RecvFloor`."""


class ProgressFloor:
    """A deadline that follows progress: ``grace_s`` plus the time the bytes so far take at
    ``rate`` (bytes per second). A peer that keeps up never meets it; one that moves a little now and
    then (enough for each read's or write's own timeout) is dropped with :class:`SlowPeerError`.
    ``who`` names the other side in the error ("reader", "donor")."""

    def __init__(self, rate: float, grace_s: float, who: str) -> None:
        self._rate, self._who = rate, who
        self._started = asyncio.get_running_loop().time() + grace_s
        self._bytes = 0

    async def within(self, step: Awaitable[T], size: int) -> T:
        """``step`` (moving ``size`` bytes), finished by the deadline that includes those bytes."""
        self._bytes += size + 4096  # and an allowance for a message's framing
        floor = asyncio.timeout_at(self._started + self._bytes / self._rate)
        try:
            async with floor:
                return await step
        except TimeoutError:
            if not floor.expired():
                raise  # the read's or write's own stall timeout
            raise SlowPeerError(f"{self._who} below the progress floor of {self._rate:.0f} B/s") from None


@dataclass(frozen=True)
class FloorSpec:
    """A receive floor: ``rate`` bytes per second, measured over windows of ``window_s`` seconds after
    ``window_s`` of grace (defaults: :data:`MIN_RECV_BYTES_PER_S`, :data:`IO_TIMEOUT_S`, read when a
    stream starts)."""

    rate: float | None = None
    window_s: float | None = None

    def resolved(self) -> tuple[float, float]:
        rate = MIN_RECV_BYTES_PER_S if self.rate is None else self.rate
        return rate, IO_TIMEOUT_S if self.window_s is None else self.window_s


class RecvFloor:
    """The receive floor of one stream, on bytes over time, not on messages: the first
    ``rate x window_s`` bytes must arrive within grace plus a window (``2 x window_s``), and each
    further ``rate x window_s`` bytes within a window of the deadline they renew (a burst banks at most
    one window ahead). A donor's ``chunk_bytes`` changes nothing: a byte counts when it arrives
    (:func:`~swarm.p2p.read_message` reports each piece). Use as ``async with floor:`` around the
    stream, feeding :meth:`count`; below the floor the block raises :class:`SlowPeerError`."""

    def __init__(self, spec: FloorSpec, who: str) -> None:
        rate, self._window = spec.resolved()
        self._need, self._who, self._got = max(1.0, rate * self._window), who, 0.0
        self._rate = rate
        self._loop = asyncio.get_running_loop()
        self._deadline = self._loop.time() + 2 * self._window
        self._timeout = asyncio.timeout_at(self._deadline)

    def count(self, size: int) -> None:
        """``size`` bytes arrived: each full ``rate x window_s`` of them moves the deadline a window on."""
        self._got += size
        windows = int(self._got // self._need)
        if windows and not self._timeout.expired():
            self._got -= windows * self._need
            now = self._loop.time()
            self._deadline = min(max(self._deadline, now) + windows * self._window, now + 2 * self._window)
            self._timeout.reschedule(self._deadline)

    async def __aenter__(self) -> RecvFloor:
        await self._timeout.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError:
            if not self._timeout.expired():
                raise  # a read's own stall timeout
            raise SlowPeerError(f"{self._who} below the receive floor of {self._rate:.0f} B/s") from None


@dataclass(frozen=True)
class Hooks:
    """What a stream reports to its download: a verified header, each verified frame."""

    on_header: Callable[[Header], None] | None = None
    on_frame: Callable[[], None] | None = None


async def fetch_part(
    p2p: P2P,
    handler: str,
    donor: str,
    assembly: Assembly,
    part: int,
    parts: int,
    swarm_key: StreamKey | None = None,
    floor: FloorSpec = FloorSpec(),
    hooks: Hooks = Hooks(),
) -> None:
    """One stream: request what ``assembly`` lacks of part ``part`` of ``parts`` (``skip``: the frames
    of it that arrived, from an earlier donor), verify the header, verify and decode each frame.

    With ``swarm_key`` the stream starts with the swarm key handshake; a donor that fails it raises
    :class:`~swarm.p2p.AuthError`. From the request on, the bytes must keep above ``floor``
    (:class:`RecvFloor`, else :class:`SlowPeerError`); ``hooks`` hear of the verified header and of
    each verified frame."""
    request = Request(assembly.digest, part, parts, assembly.delivered(part, parts))
    reader, writer = await dial(p2p, donor, handler, swarm_key, IO_TIMEOUT_S)
    try:
        async with RecvFloor(floor, f"donor {donor}") as watch:
            await send(writer, Kind.REQUEST, request.encode(), IO_TIMEOUT_S)
            header = await _read_header(reader, assembly, watch)
            if hooks.on_header is not None:
                hooks.on_header(header)
            indices = request.indices(len(header.hashes))
            if header.sending != len(indices):
                what = f"part {part}/{parts} has {len(indices)} to send"
                raise ProtocolError(f"header announces {header.sending} frames, {what}")
            for index in indices:
                kind, data = await recv(reader, header.chunk_bytes, IO_TIMEOUT_S, watch.count)
                if kind is not Kind.FRAME:
                    raise ProtocolError(f"expected FRAME, got {kind.name}")
                await asyncio.to_thread(assembly.add, index, data, donor)
                if hooks.on_frame is not None:
                    hooks.on_frame()
    finally:
        writer.close()


async def _read_header(reader: asyncio.StreamReader, assembly: Assembly, watch: RecvFloor) -> Header:
    kind, payload = await recv(reader, HEADER_MAX_BYTES, IO_TIMEOUT_S, watch.count)
    if kind is Kind.ERROR:
        raise ProtocolError(f"donor refused: {str(parse_json(payload).get('error'))[:200]}")
    if kind is not Kind.HEADER:
        raise ProtocolError(f"expected HEADER, got {kind.name}")
    header = await asyncio.to_thread(Header.parse, payload, assembly.digest)
    assembly.accept(header)
    return header


class Assembly:
    """One announced state being received: every frame is checked against the verified hash list
    before it reaches the decoder, so the decoder only ever sees frames the digest commits to.
    ``received_bytes`` counts the verified frames' bytes, a frame that came twice twice."""

    def __init__(self, digest: str, limits: DecodeLimits) -> None:
        self.digest = digest
        self.header: Header | None = None
        self.received_bytes = 0
        self._decoder = TensorStreamDecoder(limits=limits)
        self._received: set[int] = set()
        self._lock = threading.Lock()

    def delivered(self, part: int, parts: int) -> int:
        """How many frames of part ``part`` of ``parts``, from its first on, have arrived: a part's frames
        come in order, so a donor taking the part over starts after them."""
        with self._lock:
            if self.header is None:
                return 0
            count = 0
            for index in range(part, len(self.header.hashes), parts):
                if index not in self._received:
                    break
                count += 1
            return count

    def missing(self, part: int, parts: int) -> int:
        """Frames of part ``part`` of ``parts`` not received yet (:data:`MAX_FRAMES` before a header)."""
        with self._lock:
            if self.header is None:
                return MAX_FRAMES
            return sum(i not in self._received for i in range(part, len(self.header.hashes), parts))

    def accept(self, header: Header) -> None:
        if self.header is None:  # all headers verified against the same digest are identical
            self.header = header

    def add(self, index: int, data: bytes, donor: str) -> None:
        assert self.header is not None
        if hashlib.sha256(data).digest() != self.header.hashes[index]:
            raise ProtocolError(f"frame {index} does not match its announced hash")
        with self._lock:
            self.received_bytes += len(data)
            if index in self._received:  # sent twice (never asked for: a resumed part skips it)
                return
            try:
                self._decoder.feed(data)
            except FrameError as exc:
                raise StateTransferError(
                    f"state {self.digest[:12]} (from {donor}) is unusable: {exc}"
                ) from exc
            self._received.add(index)

    def finish(self) -> StateSnapshot:
        assert self.header is not None
        try:
            tensors = self._decoder.finish()
        except FrameError as exc:
            raise StateTransferError(f"state {self.digest[:12]} is incomplete: {exc}") from exc
        if any(t.dtype != torch.float32 for t in tensors.values()):
            raise StateTransferError(f"state {self.digest[:12]} holds non-fp32 tensors")
        snapshot = build_snapshot(tensors, self.header.meta, self.header.chunk_bytes)
        if snapshot.digest != self.digest:
            raise StateTransferError(
                f"state {self.digest[:12]} re-encodes to another digest {snapshot.digest[:12]}"
            )
        return snapshot
