"""The relay's side of :mod:`swarm.p2p._forward`: forward swarm streams to peers behind NAT.

The bootstrap runs one. It forwards only to peers its daemon is connected to right now (the peers
behind NAT that dialled out to it), only to their relayed handlers, and at most
:data:`MAX_FORWARDS` streams at once (:data:`MAX_PER_DIALLER` for one dialler). A forwarded stream
closes when either side closes, fails, or moves nothing for :data:`IDLE_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import TYPE_CHECKING, Any

from swarm.p2p._auth import StreamKey
from swarm.p2p._forward import (
    FORWARD_HANDLER,
    HANDLER,
    PEER_ID,
    RELAYED_SUFFIX,
    ForwardKind,
    field,
    read_control,
    send_control,
)
from swarm.p2p._framing import ProtocolError, _within
from swarm.p2p._relay import FORWARDED, RelayedBytes
from swarm.p2p._service import P2PFactory, StreamService

if TYPE_CHECKING:
    from hivemind.dht import DHT

logger = logging.getLogger(__name__)

MAX_FORWARDS = 64
MAX_PER_DIALLER = 8
IDLE_TIMEOUT_S = 60.0
"""Longer than every swarm protocol's own progress timeout, which fires first."""
CONTROL_TIMEOUT_S = 10.0
PIECE_BYTES = 64 * 1024


class RelayForwarder(StreamService):
    """Forwards streams from any swarm member to the peers behind NAT connected to this daemon."""

    what = "relay request"
    serves_relayed = False  # a relay forwards to peers behind NAT; it is not one

    def __init__(
        self,
        run_id: str,
        *,
        dht: DHT | None = None,
        p2p_factory: P2PFactory | None = None,
        swarm_key: StreamKey | None = None,
        counter: RelayedBytes = FORWARDED,
    ) -> None:
        super().__init__(
            run_id,
            FORWARD_HANDLER,
            dht=dht,
            p2p_factory=p2p_factory,
            swarm_key=swarm_key,
            auth_timeout_s=CONTROL_TIMEOUT_S,
        )
        self.counter = counter
        self._per_dialler: collections.Counter[str] = collections.Counter()
        self._start("swarm-relay")

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, body = await read_control(reader, CONTROL_TIMEOUT_S)
        if kind is not ForwardKind.FORWARD:
            raise ProtocolError(f"expected FORWARD, got {kind.name}")
        target, handler = field(body, "to", PEER_ID), field(body, "handler", HANDLER)
        refusal = await self._refusal(peer, target)
        if refusal:
            await send_control(writer, ForwardKind.REFUSED, {"reason": refusal}, CONTROL_TIMEOUT_S)
            return
        self._per_dialler[peer] += 1
        try:
            await self._forward(peer, target, handler, reader, writer)
        finally:
            self._per_dialler[peer] -= 1
            if not self._per_dialler[peer]:
                del self._per_dialler[peer]

    async def _refusal(self, dialler: str, target: str) -> str:
        if sum(self._per_dialler.values()) >= MAX_FORWARDS:
            return f"this relay forwards {MAX_FORWARDS} streams already"
        if self._per_dialler[dialler] >= MAX_PER_DIALLER:
            return f"this relay forwards {MAX_PER_DIALLER} streams for you already"
        if target in (dialler, self.peer_id):
            return "cannot forward a stream to its own dialler or to the relay"
        connected = {info.peer_id.to_base58() for info in await self._p2p.list_peers()}
        if target not in connected:
            return f"peer {target} is not connected to this relay"
        return ""

    async def _forward(
        self,
        dialler: str,
        target: str,
        handler: str,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        from hivemind.p2p import PeerID

        try:
            _, peer_reader, peer_writer = await asyncio.wait_for(
                self._p2p.call_binary_stream_handler(PeerID.from_base58(target), handler + RELAYED_SUFFIX),
                CONTROL_TIMEOUT_S,
            )
        except Exception as exc:  # hivemind's P2PHandlerError, a dropped connection, a timeout
            reason = f"could not open {handler} on {target}: {type(exc).__name__}: {exc}"
            await send_control(writer, ForwardKind.REFUSED, {"reason": reason[:500]}, CONTROL_TIMEOUT_S)
            return
        try:
            await send_control(peer_writer, ForwardKind.PREAMBLE, {"from": dialler}, CONTROL_TIMEOUT_S)
            self.counter.add(streams=1)  # the peer's READY (or its closing the stream) is the answer
            await _splice(reader, writer, peer_reader, peer_writer, self.counter)
        finally:
            peer_writer.close()
        logger.debug("forwarded %s from %s to %s", handler, dialler, target)


async def _splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    peer_reader: asyncio.StreamReader,
    peer_writer: asyncio.StreamWriter,
    counter: RelayedBytes,
) -> None:
    """Copy both ways until one side closes or fails; the caller closes both streams."""
    to_peer = asyncio.ensure_future(_copy(reader, peer_writer, lambda n: counter.add(sent=n)))
    back = asyncio.ensure_future(_copy(peer_reader, writer, lambda n: counter.add(received=n)))
    try:
        await asyncio.wait((to_peer, back), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (to_peer, back):
            task.cancel()
        await asyncio.gather(to_peer, back, return_exceptions=True)


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter, count: Any) -> None:
    while data := await _within(source.read(PIECE_BYTES), IDLE_TIMEOUT_S, "received"):
        sink.write(data)
        await _within(sink.drain(), IDLE_TIMEOUT_S, "sent")
        count(len(data))
