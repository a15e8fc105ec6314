"""The relay's side of :mod:`swarm.p2p._forward`: forward swarm streams to peers behind NAT.

The bootstrap runs one. It forwards only to peers its daemon is connected to right now (the peers
behind NAT that dialled out to it), and only to their relayed handlers. Every forwarded stream is
metered (:class:`RelayLimits`): slots in all and per dialler, reserved before anything is awaited
(a full relay gives the slot of its quietest stream, one that moved nothing for ``evict_quiet_s``, to
a new request, so streams that fill every slot and then trickle do not hold them for long); a byte
cap, a rate cap and a lifetime per stream; and a byte budget per dialler over a window. A forwarded
stream closes when either side closes, fails, moves nothing for :data:`IDLE_TIMEOUT_S`, runs past one
of those caps, or loses its slot.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
MAX_DIALLERS_KEPT = 4096
"""Diallers whose byte budget is remembered at most (those idle longest go first)."""
IDLE_TIMEOUT_S = 60.0
"""Longer than every swarm protocol's own progress timeout, which fires first."""
CONTROL_TIMEOUT_S = 10.0
PIECE_BYTES = 64 * 1024
MIB = 1024 * 1024


class RelayLimitError(ProtocolError):
    """A forwarded stream ran past one of the relay's caps."""


@dataclass(frozen=True)
class RelayLimits:
    """What one relay carries at most. The defaults fit the swarm's largest streams (a state transfer
    or an int8 exchange of a 1B model) and cut off a dialler that tries to use the relay as a free pipe.
    """

    max_forwards: int = MAX_FORWARDS
    max_per_dialler: int = MAX_PER_DIALLER
    stream_bytes: int = 4096 * MIB
    """Bytes one forwarded stream carries, both ways together."""
    stream_rate: float = 64 * MIB
    """Bytes per second one forwarded stream carries at most (faster streams are slowed to it)."""
    stream_lifetime_s: float = 1800.0
    """Seconds one forwarded stream stays open at most, however busy."""
    dialler_bytes: int = 8192 * MIB
    """Bytes all of one dialler's streams carry per ``dialler_window_s``."""
    dialler_window_s: float = 3600.0
    evict_quiet_s: float = 20.0
    """On a full relay, a stream that moved nothing for this long loses its slot to a new request."""

    def __post_init__(self) -> None:
        for name in ("max_forwards", "max_per_dialler", "stream_bytes", "dialler_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"RelayLimits.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("stream_rate", "stream_lifetime_s", "dialler_window_s", "evict_quiet_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RelayLimits.{name} must be positive, got {getattr(self, name)}")


class _Budgets:
    """Bytes each dialler moved in its current window (loop thread only; bounded)."""

    def __init__(self, limits: RelayLimits) -> None:
        self.limits = limits
        self._used: collections.OrderedDict[str, tuple[float, int]] = collections.OrderedDict()

    def left(self, dialler: str, now: float) -> int:
        start, used = self._used.get(dialler, (now, 0))
        if now - start >= self.limits.dialler_window_s:
            return self.limits.dialler_bytes
        return self.limits.dialler_bytes - used

    def spend(self, dialler: str, n: int, now: float) -> int:
        """Count ``n`` bytes for ``dialler``; the bytes left in its window afterwards (may be negative)."""
        start, used = self._used.pop(dialler, (now, 0))
        if now - start >= self.limits.dialler_window_s:
            start, used = now, 0
        self._used[dialler] = (start, used + n)
        while len(self._used) > MAX_DIALLERS_KEPT:
            self._used.popitem(last=False)
        return self.limits.dialler_bytes - used - n


class _Slot:
    """One reserved forwarding slot; ``evicted`` is set when a full relay gave it to another dialler."""

    def __init__(self, dialler: str, now: float) -> None:
        self.dialler, self.last_active = dialler, now
        self.evicted = asyncio.Event()
        self.released = False


class StreamMeter:
    """The caps of one forwarded stream: :meth:`take` counts bytes, and says how long to wait to keep
    to the rate cap, or raises :class:`RelayLimitError` past the byte cap or the dialler's budget."""

    def __init__(self, dialler: str, budgets: _Budgets, now: float, slot: _Slot | None = None) -> None:
        self.dialler, self._budgets, self._limits = dialler, budgets, budgets.limits
        self.slot = slot or _Slot(dialler, now)
        self.started, self.carried = now, 0
        self.lifetime_s = budgets.limits.stream_lifetime_s

    def take(self, n: int, now: float) -> float:
        self.carried += n
        self.slot.last_active = now
        if self.carried > self._limits.stream_bytes:
            raise RelayLimitError(
                f"the stream carried more than the relay's {self._limits.stream_bytes} bytes"
            )
        if self._budgets.spend(self.dialler, n, now) < 0:
            raise RelayLimitError(
                f"dialler {self.dialler} moved more than {self._limits.dialler_bytes} bytes "
                f"in {self._limits.dialler_window_s:g} s through this relay"
            )
        return max(0.0, self.carried / self._limits.stream_rate - (now - self.started))


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
        limits: RelayLimits | None = None,
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
        self.limits = limits or RelayLimits()
        self._budgets = _Budgets(self.limits)
        self._per_dialler: collections.Counter[str] = collections.Counter()
        self._forwarding = 0
        self._slots: set[_Slot] = set()
        self._start("swarm-relay")

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kind, body = await read_control(reader, CONTROL_TIMEOUT_S)
        if kind is not ForwardKind.FORWARD:
            raise ProtocolError(f"expected FORWARD, got {kind.name}")
        target, handler = field(body, "to", PEER_ID), field(body, "handler", HANDLER)
        slot = self._reserve(peer)  # counted with the check, before anything is awaited
        if isinstance(slot, str):
            await send_control(writer, ForwardKind.REFUSED, {"reason": slot}, CONTROL_TIMEOUT_S)
            return
        try:
            refusal = await self._refusal(peer, target)
            if refusal:
                await send_control(writer, ForwardKind.REFUSED, {"reason": refusal}, CONTROL_TIMEOUT_S)
                return
            await self._forward(peer, target, handler, reader, writer, slot)
        finally:
            self._release(slot)

    def _reserve(self, dialler: str) -> _Slot | str:
        """Take a slot for ``dialler`` (no await between the check and the count); why not, if not."""
        limits, now = self.limits, time.monotonic()
        if self._per_dialler[dialler] >= limits.max_per_dialler:
            return f"this relay forwards {limits.max_per_dialler} streams for you already"
        if self._budgets.left(dialler, now) <= 0:
            return (
                f"you moved {limits.dialler_bytes} bytes through this relay in {limits.dialler_window_s:g} s"
            )
        if self._forwarding >= limits.max_forwards and not self._evict_quietest(now):
            return f"this relay forwards {limits.max_forwards} streams already"
        slot = _Slot(dialler, now)
        self._slots.add(slot)
        self._forwarding += 1
        self._per_dialler[dialler] += 1
        return slot

    def _evict_quietest(self, now: float) -> bool:
        """Free the slot of the stream quiet longest, if it moved nothing for ``evict_quiet_s``."""
        quietest = min(self._slots, key=lambda s: s.last_active, default=None)
        if quietest is None or now - quietest.last_active < self.limits.evict_quiet_s:
            return False
        logger.info("a full relay gives the slot of a quiet stream from %s to a new one", quietest.dialler)
        self._release(quietest)
        quietest.evicted.set()
        return True

    def _release(self, slot: _Slot) -> None:
        if slot.released:
            return
        slot.released = True
        self._slots.discard(slot)
        self._forwarding -= 1
        self._per_dialler[slot.dialler] -= 1
        if not self._per_dialler[slot.dialler]:
            del self._per_dialler[slot.dialler]

    async def _refusal(self, dialler: str, target: str) -> str:
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
        slot: _Slot,
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
            if slot.evicted.is_set():
                raise RelayLimitError("its slot went to another stream while the relay was full")
            await send_control(peer_writer, ForwardKind.PREAMBLE, {"from": dialler}, CONTROL_TIMEOUT_S)
            self.counter.add(streams=1)  # the peer's READY (or its closing the stream) is the answer
            meter = StreamMeter(dialler, self._budgets, time.monotonic(), slot)
            await _splice(reader, writer, peer_reader, peer_writer, self.counter, meter)
        except RelayLimitError as exc:
            logger.info("closed a stream forwarded from %s to %s: %s", dialler, target, exc)
        finally:
            peer_writer.close()
        logger.debug("forwarded %s from %s to %s", handler, dialler, target)


async def _splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    peer_reader: asyncio.StreamReader,
    peer_writer: asyncio.StreamWriter,
    counter: RelayedBytes,
    meter: StreamMeter,
) -> None:
    """Copy both ways until one side closes or fails, or the stream runs past a cap (then
    RelayLimitError); the caller closes both streams."""
    to_peer = asyncio.ensure_future(_copy(reader, peer_writer, meter, lambda n: counter.add(sent=n)))
    back = asyncio.ensure_future(_copy(peer_reader, writer, meter, lambda n: counter.add(received=n)))
    evicted = asyncio.ensure_future(meter.slot.evicted.wait())
    lifetime = meter.lifetime_s
    try:
        done, _ = await asyncio.wait(
            (to_peer, back, evicted), timeout=lifetime, return_when=asyncio.FIRST_COMPLETED
        )
        if not done:
            raise RelayLimitError(f"the stream was open for the relay's {lifetime:g} s")
        if evicted in done:
            raise RelayLimitError("it moved nothing for a while, and its slot went to another stream")
        for task in done:
            if isinstance(error := task.exception(), RelayLimitError):
                raise error
    finally:
        for task in (to_peer, back, evicted):
            task.cancel()
        await asyncio.gather(to_peer, back, evicted, return_exceptions=True)


async def _copy(
    source: asyncio.StreamReader, sink: asyncio.StreamWriter, meter: StreamMeter, count: Callable[[int], None]
) -> None:
    while data := await _within(source.read(PIECE_BYTES), IDLE_TIMEOUT_S, "received"):
        wait = meter.take(len(data), time.monotonic())
        sink.write(data)
        await _within(sink.drain(), IDLE_TIMEOUT_S, "sent")
        count(len(data))
        if wait > 0:
            await asyncio.sleep(wait)  # the rate cap: a throttle, not a synchronisation
