"""Faults injected at the edges, for tests: a gossip peer that tampers with what it sends or stalls
mid-exchange, and a state donor that pauses before a frame or serves corrupted bytes.

Gossip: :class:`~swarm.gossip.GossipAverager` takes ``wrap_channel``, applied to each exchange's
:class:`~swarm.gossip._protocol.Channel` before its data phase; :func:`tampering` and :func:`stalling`
return such wrappers, and the same wrappers apply to a bare channel given to
:func:`~swarm.gossip._exchange.run_exchange`. The production path never knows: the averager encodes
and sends honest frames, and the wrapper rewrites or withholds them on their way to the stream.

State: :func:`faulty_snapshot` serves a published state's frames through ``before_frame`` and
``corrupt``; the header still states the honest hashes, so the client sees corrupted bytes exactly as
if a donor had sent them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarm.compression import Codec, TensorStreamDecoder, encode_tensors
from swarm.gossip._protocol import Channel, MsgKind
from swarm.state import ServedState, StateSnapshot, spool_state

NamedTensors = list[tuple[str, torch.Tensor]]
ChannelWrapper = Callable[[Channel], Any]


class _Proxy:
    """Everything a Channel does (reads, byte counts, close), except what a subclass overrides."""

    def __init__(self, inner: Channel) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def send(self, kind: MsgKind, payload: bytes | memoryview = b"") -> None:
        await self._inner.send(kind, payload)

    async def send_json(self, kind: MsgKind, obj: dict[str, Any]) -> None:
        await self._inner.send_json(kind, obj)


class TamperingChannel(_Proxy):
    """Holds back the DATA frames of the exchange's first part, decodes them at its END, and sends
    ``tamper(tensors)`` encoded with ``codec`` instead (with a fresh END that counts the new frames).

    ``codec`` may be one the product would never use, e.g. :class:`NanCodec`. Frames are no larger
    than the largest honest one, so the partner's size limit never refuses them. ``tampered`` counts
    the parts rewritten: a test can check the fault really happened."""

    def __init__(self, inner: Channel, tamper: Callable[[NamedTensors], NamedTensors], codec: Codec) -> None:
        super().__init__(inner)
        self._tamper = tamper
        self._codec = codec
        self._decoder: TensorStreamDecoder | None = TensorStreamDecoder()
        self._largest = 0
        self.tampered = 0

    async def send(self, kind: MsgKind, payload: bytes | memoryview = b"") -> None:
        if kind is not MsgKind.DATA or self._decoder is None:
            await self._inner.send(kind, payload)
            return
        self._decoder.feed(payload)
        self._largest = max(self._largest, len(payload))

    async def send_json(self, kind: MsgKind, obj: dict[str, Any]) -> None:
        decoder, self._decoder = self._decoder, None
        if kind is not MsgKind.END or decoder is None:
            await self._inner.send_json(kind, obj)
            return
        named = self._tamper(list(decoder.finish().items()))
        count = 0
        for frame in encode_tensors(named, self._codec, chunk_bytes=max(self._largest, 4096)):
            await self._inner.send(MsgKind.DATA, frame)
            count += 1
        self.tampered += 1
        await self._inner.send_json(MsgKind.END, {"frames": count})


class StallingChannel(_Proxy):
    """Sends ``after`` DATA frames, then calls ``on_stall`` once and never sends again (the stream
    stays open: only a deadline, the rate floor or a cancellation ends the exchange)."""

    def __init__(self, inner: Channel, after: int, on_stall: Callable[[], None] | None) -> None:
        super().__init__(inner)
        self._left = after
        self._on_stall = on_stall

    async def send(self, kind: MsgKind, payload: bytes | memoryview = b"") -> None:
        await self._inner.send(kind, payload)
        if kind is MsgKind.DATA:
            self._left -= 1
            if self._left == 0:
                if self._on_stall is not None:
                    self._on_stall()
                await asyncio.Event().wait()


def tampering(tamper: Callable[[NamedTensors], NamedTensors], codec: Codec) -> ChannelWrapper:
    """A ``wrap_channel`` that makes every exchange's first part ``tamper(ours)``, encoded with ``codec``."""
    return lambda channel: TamperingChannel(channel, tamper, codec)


def stalling(after: int = 1, on_stall: Callable[[], None] | None = None) -> ChannelWrapper:
    """A ``wrap_channel`` that stalls every exchange after ``after`` DATA frames."""
    return lambda channel: StallingChannel(channel, after, on_stall)


def unchanged(named: NamedTensors) -> NamedTensors:
    return named


class NanCodec:
    """Wraps a float codec: encodes normally, then plants NaN in the encoded values (the real codecs
    refuse to encode NaN, so this is how a hostile peer would put NaN on the wire)."""

    def __init__(self, inner: Codec) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, t: torch.Tensor) -> Any:
        encoded = self._inner.encode(t)
        data = encoded.data.clone()
        data.view(-1)[:: max(1, data.numel() // 7)] = float("nan")
        return dataclasses.replace(encoded, data=data)


@dataclass(frozen=True, eq=False)
class _FaultyState(ServedState):
    before_frame: Callable[[int], None] | None = None
    corrupt: Callable[[int, bytes], bytes] | None = None

    def frame(self, index: int) -> bytes:
        if self.before_frame is not None:
            self.before_frame(index)
        data = super().frame(index)
        return data if self.corrupt is None else self.corrupt(index, data)


def faulty_snapshot(
    state: StateSnapshot | ServedState,
    *,
    before_frame: Callable[[int], None] | None = None,
    corrupt: Callable[[int, bytes], bytes] | None = None,
) -> ServedState:
    """``state`` to publish (spooled if it is a snapshot; same digest, same honest frame hashes), whose
    frame ``index`` is read by the server (in a worker thread, where it may block) only after
    ``before_frame(index)`` returned, and served as ``corrupt(index, honest bytes)``."""
    if isinstance(state, StateSnapshot):
        state = spool_state(state.tensors, state.meta, state.chunk_bytes)
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state) if f.init}
    return _FaultyState(**fields, before_frame=before_frame, corrupt=corrupt)
