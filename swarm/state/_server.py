"""StateServer: a donor serves its latest published state to joiners, in verified parts.

See docs/state-sync.md and the wire protocol in :mod:`swarm.state._transfer_protocol`. What is served
is a :class:`~swarm.state._served.ServedState`: frames in a spool file, read one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import threading
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


@dataclass
class ServeStats:
    """What a donor did: well-formed requests read, parts sent in full, frames sent, requests refused
    (the snapshot asked for is not the one served, or too many streams at once, in all or from that
    peer) and streams dropped because their reader fell below the progress floor."""

    requests: int = 0
    parts_served: int = 0
    frames_sent: int = 0
    refused: int = 0
    too_slow: int = 0


@dataclass(eq=False)
class _Published:
    """A state published here, and the streams that serve it now. A state that a newer one replaced
    (``retired``) is closed once its last stream ends; both fields change only under the server's lock."""

    state: ServedState
    hashes_hex: list[str] = field(init=False)
    streams: int = 0
    retired: bool = False

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
    """Serves the latest published state on ``swarm.state.v{PROTOCOL_VERSION}.{run_id}``.

    Give ``dht`` (a running ``hivemind.DHT``: we open our own client to its daemon) or ``p2p_factory``
    (an async callable returning a P2P dedicated to this server). A request pins the state it
    started on: a ``publish`` during a download never mixes two states into one stream, and the
    replaced state's spool file stays open until its last stream ends, then is closed (so at most
    two states are alive while one is being replaced). In a private swarm (``swarm_key``, by default
    the key ``dht`` was started with) a client must pass the swarm key handshake before its request
    is read. Admission: at most :data:`MAX_STREAMS_PER_PEER` streams per peer id and
    :data:`MAX_CONCURRENT_STREAMS` parts being sent in all, each kept above the progress floor
    :data:`MIN_SEND_BYTES_PER_S`. Each frame is read with ``state.frame(index)`` in a worker thread
    right before it is sent: the one place a served frame's bytes come from. ``spool_dir``: where a
    published :class:`StateSnapshot` is spooled (default: the system's temporary directory).
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
    ) -> None:
        super().__init__(run_id, dht=dht, p2p_factory=p2p_factory, swarm_key=swarm_key)
        self._lock = threading.Lock()
        self._spool_dir = spool_dir
        self._published: _Published | None = None
        self._open: list[_Published] = []  # the published one and replaced ones still being served
        self._shut = False
        self._stats = ServeStats()
        self._sending = 0  # parts being sent now; like the per-peer counts, only touched on the loop thread
        self._streams: dict[str, int] = {}
        self._start(f"state-{run_id}")

    def publish(self, state: ServedState | StateSnapshot) -> None:
        """Serve ``state`` from now on (atomically replaces the previous one). The server takes a
        :class:`ServedState` over and closes it once it is replaced and no stream serves it any more;
        a :class:`StateSnapshot` is spooled first (:func:`spool_state`, in ``spool_dir``)."""
        if isinstance(state, StateSnapshot):
            state = spool_state(state.tensors, state.meta, state.chunk_bytes, self._spool_dir)
        published = _Published(state)
        with self._lock:
            shut = self._shut
            previous = None if shut else self._published
            if not shut:
                self._published = published
                self._open.append(published)
        if shut:  # closed: nothing would ever serve it
            state.close()
        if previous is not None:
            self._release(previous, retire=True)

    def _release(self, published: _Published, *, retire: bool = False, stream: bool = False) -> None:
        """Retire ``published`` and/or end one of its streams; close its state once it is retired and
        no stream serves it."""
        with self._lock:
            published.retired |= retire
            published.streams -= stream
            idle = published.retired and not published.streams
            if idle and published in self._open:
                self._open.remove(published)
        if idle:
            published.state.close()

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
        pinned = self._pin(request)
        if isinstance(pinned, dict):
            self._count(refused=1)
            await send_json(writer, Kind.ERROR, pinned, IO_TIMEOUT_S)
            return
        self._sending += 1
        try:
            sent = await self._send_part(writer, pinned, request)
        finally:
            self._sending -= 1
            self._release(pinned, stream=True)
        logger.info(
            "served part %d/%d of %s (%d frames, %d skipped) to %s",
            request.part,
            request.parts,
            request.digest[:12],
            sent,
            request.skip,
            peer,
        )

    def _pin(self, request: Request) -> _Published | dict[str, str | None]:
        """The published state ``request`` asks for, pinned for one stream (its spool stays open until
        :meth:`_release`), or the error to answer."""
        with self._lock:
            published = self._published
            if published is None or published.state.digest != request.digest:
                current = None if published is None else published.state.digest
                return {"error": "digest mismatch", "digest": current}
            if self._sending >= MAX_CONCURRENT_STREAMS:
                return {"error": "busy"}
            published.streams += 1
            return published

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
