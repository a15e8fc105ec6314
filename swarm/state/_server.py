"""StateServer: a donor serves its published state to joiners, in verified parts.

See docs/state-sync.md and the wire protocol in :mod:`swarm.state._transfer_protocol`. What is served
is a :class:`~swarm.state._served.ServedState`: frames in a spool file, read one at a time.

A spool file is a full copy of the state on disk, so how many stay open is bounded whatever readers
do, on PostgreSQL's model of a bounded snapshot age: a replaced state still answers requests while a
record naming it may be read (``keep_replaced_s``), a stream may read it for a bounded time after it
was replaced (``pin_lifetime_s``, then the stream is cut: "snapshot too old"), and at most
:data:`MAX_STATES` states are open at once (a publish beyond them evicts the oldest replaced one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from swarm.p2p import P2PFactory, ProtocolError, StreamService
from swarm.state._served import ServedState, spool_state
from swarm.state._snapshot import StateSnapshot
from swarm.state._transfer_protocol import (
    IO_TIMEOUT_S,
    REQUEST_MAX_BYTES,
    SERVICE,
    Kind,
    ProgressFloor,
    Request,
    SlowPeerError,
    recv,
    send,
    send_json,
)

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.network import SwarmKey

logger = logging.getLogger(__name__)

MAX_CONCURRENT_STREAMS = 8
"""A donor sends at most this many parts at once; further requests get ``{"error": "busy"}``."""
MAX_STREAMS_PER_PEER = 2
"""Streams one peer id may have open at once (reading its request or being served); its further
ones get ``{"error": "busy"}`` at once, so one peer cannot take the slots of the others."""
MIN_SEND_BYTES_PER_S = 128 << 10
"""Progress floor of a part being served: after ``IO_TIMEOUT_S`` of grace, the bytes handed on must
keep up with this rate, or the stream is dropped. Holding a slot costs a reader real bandwidth."""
MAX_STATES = 2
"""Published states (spool files: each a full copy of the state on disk) open at once: the one served
now and the one it replaced. Each reader's share of them is bounded by its streams
(:data:`MAX_STREAMS_PER_PEER`), each stream's hold on a replaced one by the pin lifetime."""
KEEP_REPLACED_S = 15.0
"""How long a replaced state still answers requests by default: a membership record's default
lifetime (``network.record_ttl_s``, 10 s) and 5 s for a record announced as it was replaced and a
joiner's dial. A donor whose records live longer passes ``record_ttl_s + 5``."""
PIN_LIFETIME_S = 600.0
"""How long a stream may go on reading a state after it was replaced, by default; then it is cut."""


@dataclass
class ServeStats:
    """What a donor did: well-formed requests read, parts sent in full, frames sent, requests refused
    (the snapshot asked for is not one served, or too many streams at once, in all or from that
    peer), streams dropped because their reader fell below the progress floor, and streams cut
    because the state they read was replaced too long ago or evicted (:class:`SnapshotTooOld`)."""

    requests: int = 0
    parts_served: int = 0
    frames_sent: int = 0
    refused: int = 0
    too_slow: int = 0
    cut: int = 0


class SnapshotTooOld(ProtocolError):
    """The state a stream reads was replaced more than the pin lifetime ago, or evicted by a newer
    publish: the stream is closed (the reader resumes its part elsewhere)."""


@dataclass(eq=False)
class _Pin:
    """One stream reading a published state: its loop and the deadline that ends it."""

    loop: asyncio.AbstractEventLoop
    lifetime: asyncio.Timeout

    def end_at(self, deadline: float) -> None:
        """End the stream by ``deadline`` (``time.monotonic()``; never later than one set before),
        from any thread."""

        def reschedule() -> None:
            when = self.loop.time() + deadline - time.monotonic()
            current = self.lifetime.when()
            with contextlib.suppress(RuntimeError):  # the stream has ended meanwhile
                if current is None or when < current:
                    self.lifetime.reschedule(when)

        with contextlib.suppress(RuntimeError):  # its loop is closed: the stream ended with it
            self.loop.call_soon_threadsafe(reschedule)


@dataclass(eq=False)
class _Published:
    """A state published here and the streams reading it. Once replaced (``replaced_at``, monotonic)
    it still answers requests for the server's keep window and is closed when that is over and no
    stream reads it; once evicted it answers none and is closed when its streams, cut, have ended.
    The fields change only under the server's lock."""

    state: ServedState
    hashes_hex: list[str] = field(init=False)
    pins: set[_Pin] = field(default_factory=set)
    replaced_at: float | None = None
    evicted: bool = False

    def __post_init__(self) -> None:
        self.hashes_hex = [h.hex() for h in self.state.hashes]

    def header(self, sending: int) -> dict[str, Any]:
        state = self.state
        return {
            "digest": state.digest,
            "frames": state.frame_count,
            "meta": state.meta,
            "chunk_bytes": state.chunk_bytes,
            "hashes": self.hashes_hex,
            "sending": sending,
        }


class StateServer(StreamService):
    """Serves the latest published state, and the one it replaced while a record may still name it, on
    ``swarm.state.v{PROTOCOL_VERSION}.{run_id}``.

    Give ``dht`` (a running ``hivemind.DHT``: we open our own client to its daemon) or ``p2p_factory``
    (an async callable returning a P2P dedicated to this server). A request pins the state it
    started on: a ``publish`` during a download never mixes two states into one stream. Snapshot
    lifetime: a replaced state still answers requests for ``keep_replaced_s`` (a joiner read its
    digest in a record of ours that has not expired: pass the records' lifetime plus a margin); a
    stream reading it is closed ``pin_lifetime_s`` after it was replaced (:class:`SnapshotTooOld`);
    then its spool file is closed. At most :data:`MAX_STATES` spool files are open: a publish beyond
    them cuts the oldest replaced state's streams at once, and :meth:`can_publish` tells a publisher
    whether one would. In a private swarm (``swarm_key``, by default the key ``dht`` was started
    with) a client must pass the swarm key handshake before its request is read. Admission: at most
    :data:`MAX_STREAMS_PER_PEER` streams per peer id and :data:`MAX_CONCURRENT_STREAMS` parts being
    sent in all, each kept above the progress floor :data:`MIN_SEND_BYTES_PER_S`. Each frame is read
    with ``state.frame(index)`` in a worker thread right before it is sent: the one place a served
    frame's bytes come from. ``spool_dir``: where a published :class:`StateSnapshot` is spooled
    (default: :func:`~swarm.state._served.default_spool_dir`).
    """

    what = "state request"
    protocol = SERVICE
    io_timeout_s = IO_TIMEOUT_S

    def __init__(
        self,
        dht: DHT | None = None,
        run_id: str = "",
        *,
        p2p_factory: P2PFactory | None = None,
        swarm_key: SwarmKey | None = None,
        spool_dir: str | None = None,
        keep_replaced_s: float = KEEP_REPLACED_S,
        pin_lifetime_s: float = PIN_LIFETIME_S,
    ) -> None:
        if keep_replaced_s < 0 or pin_lifetime_s <= 0:
            raise ValueError("keep_replaced_s must be >= 0 and pin_lifetime_s > 0")
        super().__init__(run_id, dht=dht, p2p_factory=p2p_factory, swarm_key=swarm_key)
        self._lock = threading.Lock()
        self._spool_dir = spool_dir
        self._keep_s, self._pin_s = keep_replaced_s, max(pin_lifetime_s, keep_replaced_s)
        self._published: _Published | None = None
        self._open: list[_Published] = []  # oldest first: replaced ones still open, then the published one
        self._shut = False
        self._stats = ServeStats()
        self._sending = 0  # parts being sent now; like the per-peer counts, only touched on the loop thread
        self._streams: dict[str, int] = {}
        self._start(f"state-{run_id}")

    def publish(self, state: ServedState | StateSnapshot) -> None:
        """Serve ``state`` from now on (atomically replaces the previous one, which is kept as the
        class says). The server takes a :class:`ServedState` over and closes it when its time is over;
        a :class:`StateSnapshot` is spooled first (:func:`spool_state`, in ``spool_dir``). Beyond
        :data:`MAX_STATES` open states the oldest replaced one is evicted, its streams cut at once."""
        if isinstance(state, StateSnapshot):
            state = spool_state(state.tensors, state.meta, state.chunk_bytes, self._spool_dir)
        published = _Published(state)
        now = time.monotonic()
        cuts: list[tuple[_Pin, float]] = []
        with self._lock:
            if self._shut:  # closed: nothing would ever serve it
                closing = [published]
            else:
                cuts = self._replace(published, now)
                closing = self._sweep(now)
        self._finish(closing, cuts)

    def can_publish(self) -> bool:
        """Whether a new state can be published without evicting one that a record may still name or
        a stream still reads (fewer than :data:`MAX_STATES` open). A trainer asks before spooling."""
        with self._lock:
            closing = self._sweep(time.monotonic())
            ready = not self._shut and len(self._open) < MAX_STATES
        self._finish(closing)
        return ready

    def spooled(self) -> tuple[int, int]:
        """The spool files this server holds open now, and their bytes."""
        with self._lock:
            closing = self._sweep(time.monotonic())
            held = [published.state for published in self._open]
        self._finish(closing)
        return len(held), sum(state.nbytes for state in held)

    def _replace(self, published: _Published, now: float) -> list[tuple[_Pin, float]]:
        """Make ``published`` the served state (under the lock): the previous one's streams get their
        pin lifetime, and the oldest replaced states beyond :data:`MAX_STATES` are evicted. Returns the
        streams to end and by when."""
        cuts: list[tuple[_Pin, float]] = []
        previous = self._published
        if previous is not None:
            previous.replaced_at = now
            cuts += [(pin, now + self._pin_s) for pin in previous.pins]
        self._published = published
        self._open.append(published)
        kept = [p for p in self._open if not p.evicted]
        for old in kept[: max(0, len(kept) - MAX_STATES)]:  # oldest first; the new one is last
            old.evicted = True
            cuts += [(pin, now) for pin in old.pins]
        return cuts

    def _sweep(self, now: float) -> list[_Published]:
        """Take the replaced states whose time is over and that no stream reads out of the open ones
        (under the lock); the caller closes them."""
        closing = [
            p
            for p in self._open
            if p.replaced_at is not None and not p.pins and (p.evicted or now >= p.replaced_at + self._keep_s)
        ]
        for published in closing:
            self._open.remove(published)
        return closing

    @staticmethod
    def _finish(closing: Sequence[_Published], cuts: Sequence[tuple[_Pin, float]] = ()) -> None:
        """Close ``closing`` and end each stream of ``cuts`` by its deadline (outside the lock)."""
        for published in closing:
            published.state.close()
        for pin, deadline in cuts:
            pin.end_at(deadline)

    @property
    def digest(self) -> str | None:
        with self._lock:
            return None if self._published is None else self._published.state.digest

    def stats(self) -> ServeStats:
        with self._lock:
            return ServeStats(**vars(self._stats))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, delta in deltas.items():
                setattr(self._stats, key, getattr(self._stats, key) + delta)

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._streams.get(peer, 0) >= MAX_STREAMS_PER_PEER:
            self._count(refused=1)
            await send_json(writer, Kind.ERROR, {"error": "busy"}, IO_TIMEOUT_S)
            return
        self._streams[peer] = self._streams.get(peer, 0) + 1
        try:
            await self._serve_request(peer, reader, writer)
        finally:
            self._streams[peer] -= 1
            if not self._streams[peer]:
                del self._streams[peer]

    async def _serve_request(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        kind, payload = await recv(reader, REQUEST_MAX_BYTES, IO_TIMEOUT_S)
        if kind is not Kind.REQUEST:
            raise ProtocolError(f"expected REQUEST, got {kind.name}")
        request = Request.parse(payload)
        self._count(requests=1)
        try:
            async with asyncio.timeout(None) as lifetime:  # no end while the state is the published one
                pin = _Pin(asyncio.get_running_loop(), lifetime)
                pinned = self._pin(request, pin)
                if isinstance(pinned, dict):
                    self._count(refused=1)
                    await send_json(writer, Kind.ERROR, pinned, IO_TIMEOUT_S)
                    return
                sent = await self._serve_pinned(writer, pinned, pin, request)
        except TimeoutError:
            if not lifetime.expired():
                raise
            self._count(cut=1)
            raise SnapshotTooOld(
                f"state {request.digest[:12]} was replaced too long ago (or evicted)"
            ) from None
        logger.info(
            "served part %d/%d of %s (%d frames, %d skipped) to %s",
            request.part,
            request.parts,
            request.digest[:12],
            sent,
            request.skip,
            peer,
        )

    def _pin(self, request: Request, pin: _Pin) -> _Published | dict[str, str | None]:
        """The state ``request`` asks for (the published one, or a replaced one in its keep window),
        pinned by ``pin`` (its spool stays open until :meth:`_release`), or the error to answer."""
        now = time.monotonic()
        with self._lock:
            published = self._find(request.digest, now)
            if published is None:
                current = None if self._published is None else self._published.state.digest
                return {"error": "digest mismatch", "digest": current}
            if self._sending >= MAX_CONCURRENT_STREAMS:
                return {"error": "busy"}
            published.pins.add(pin)
            replaced_at = published.replaced_at
        if replaced_at is not None:
            pin.end_at(replaced_at + self._pin_s)
        return published

    def _find(self, digest: str, now: float) -> _Published | None:
        """The newest open state with ``digest`` that still answers requests (under the lock)."""
        for published in reversed(self._open):
            if published.state.digest != digest or published.evicted:
                continue
            if published.replaced_at is None or now < published.replaced_at + self._keep_s:
                return published
        return None

    async def _serve_pinned(
        self, writer: asyncio.StreamWriter, published: _Published, pin: _Pin, request: Request
    ) -> int:
        self._sending += 1
        try:
            return await self._send_part(writer, published, request)
        finally:
            self._sending -= 1
            self._release(published, pin)

    def _release(self, published: _Published, pin: _Pin) -> None:
        """End ``pin``'s hold on ``published``; close the states whose time is over."""
        with self._lock:
            published.pins.discard(pin)
            closing = self._sweep(time.monotonic())
        self._finish(closing)

    async def _send_part(self, writer: asyncio.StreamWriter, published: _Published, request: Request) -> int:
        state = published.state
        indices = request.indices(state.frame_count)
        floor = ProgressFloor(MIN_SEND_BYTES_PER_S, IO_TIMEOUT_S, "reader")
        try:
            await floor.within(
                send_json(writer, Kind.HEADER, published.header(len(indices)), IO_TIMEOUT_S),
                70 * state.frame_count,
            )
            for index in indices:
                data = await asyncio.to_thread(state.frame, index)
                await floor.within(send(writer, Kind.FRAME, data, IO_TIMEOUT_S), len(data))
                self._count(frames_sent=1)
        except SlowPeerError:
            self._count(too_slow=1)
            raise
        self._count(parts_served=1)
        return len(indices)

    def close(self) -> None:
        """Stop serving, then close every state published here. Idempotent."""
        super().close()
        with self._lock:
            self._shut, self._published = True, None
            remaining, self._open = self._open, []
        for published in remaining:
            published.state.close()
