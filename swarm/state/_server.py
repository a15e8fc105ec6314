"""StateServer: a donor serves its latest published snapshot to joiners, in verified parts.

See docs/state-sync.md and the wire protocol in :mod:`swarm.state._transfer_protocol`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarm.p2p import P2PFactory, ProtocolError, StreamService
from swarm.state._transfer_protocol import (
    IO_TIMEOUT_S,
    REQUEST_MAX_BYTES,
    Kind,
    ProgressFloor,
    Request,
    SlowPeerError,
    StateSnapshot,
    build_snapshot,
    handler_name,
    header_json,
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


@dataclass(frozen=True)
class _Published:
    snapshot: StateSnapshot
    hashes_hex: list[str]


class StateServer(StreamService):
    """Serves the latest published snapshot on ``swarm.state.v{PROTOCOL_VERSION}.{run_id}``.

    Give ``dht`` (a running ``hivemind.DHT``: we open our own client to its daemon) or ``p2p_factory``
    (an async callable returning a P2P dedicated to this server). A request pins the snapshot it
    started on: a ``publish`` during a download never mixes two states into one stream. In a private
    swarm (``swarm_key``, by default the key ``dht`` was started with) a client must pass the swarm key
    handshake before its request is read. Admission: at most :data:`MAX_STREAMS_PER_PEER` streams per
    peer id and :data:`MAX_CONCURRENT_STREAMS` parts being sent in all, each kept above the progress
    floor :data:`MIN_SEND_BYTES_PER_S`. Each frame is read with ``snapshot.frame(index)`` in a worker
    thread right before it is sent: the one place a served frame's bytes come from.
    """

    what = "state request"

    def __init__(
        self,
        dht: DHT | None = None,
        run_id: str = "",
        *,
        p2p_factory: P2PFactory | None = None,
        swarm_key: SwarmKey | None = None,
    ) -> None:
        super().__init__(
            run_id,
            handler_name(run_id),
            dht=dht,
            p2p_factory=p2p_factory,
            swarm_key=swarm_key,
            auth_timeout_s=IO_TIMEOUT_S,
        )
        self._lock = threading.Lock()
        self._published: _Published | None = None
        self._stats = ServeStats()
        self._sending = 0  # parts being sent now; like the per-peer counts, only touched on the loop thread
        self._streams: dict[str, int] = {}
        self._start(f"state-{run_id}")

    def publish(self, snapshot: StateSnapshot) -> None:
        """Serve ``snapshot`` from now on (atomically replaces the previous one)."""
        if not snapshot.frames:
            snapshot = build_snapshot(snapshot.tensors, snapshot.meta, snapshot.chunk_bytes)
        published = _Published(snapshot, [f.sha256.hex() for f in snapshot.frames])
        with self._lock:
            self._published = published

    @property
    def digest(self) -> str | None:
        with self._lock:
            return None if self._published is None else self._published.snapshot.digest

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
        with self._lock:
            published = self._published
        error: dict[str, str | None]
        if published is None or published.snapshot.digest != request.digest:
            error = {
                "error": "digest mismatch",
                "digest": None if published is None else published.snapshot.digest,
            }
        elif self._sending >= MAX_CONCURRENT_STREAMS:
            error = {"error": "busy"}
        else:
            self._sending += 1
            try:
                sent = await self._send_part(writer, published, request)
            finally:
                self._sending -= 1
            logger.info(
                "served part %d/%d of %s (%d frames) to %s",
                request.part,
                request.parts,
                request.digest[:12],
                sent,
                peer,
            )
            return
        self._count(refused=1)
        await send_json(writer, Kind.ERROR, error, IO_TIMEOUT_S)

    async def _send_part(self, writer: asyncio.StreamWriter, published: _Published, request: Request) -> int:
        snapshot = published.snapshot
        indices = request.indices(len(snapshot.frames))
        floor = ProgressFloor(MIN_SEND_BYTES_PER_S, IO_TIMEOUT_S, "reader")
        header = header_json(snapshot, published.hashes_hex, len(indices))
        try:
            await floor.within(
                send_json(writer, Kind.HEADER, header, IO_TIMEOUT_S), 70 * len(published.hashes_hex)
            )
            for index in indices:
                data = await asyncio.to_thread(snapshot.frame, index)
                await floor.within(send(writer, Kind.FRAME, data, IO_TIMEOUT_S), len(data))
                self._count(frames_sent=1)
        except SlowPeerError:
            self._count(too_slow=1)
            raise
        self._count(parts_served=1)
        return len(indices)
