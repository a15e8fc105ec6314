"""A base push on the wire: the pusher's frames go one way, the verdict comes back.

After HELLO (``push``) and ACCEPT, the pusher streams its tensors in the averager's codec (no error
feedback: a base is whatever both sides hold, not a value owed) and keeps the very frames it sends in a
:class:`~swarm.compression.FrameStore` of its own; the receiver keeps the frames it gets, checks that
every tensor decodes and is finite, and answers ACK (or NACK with the reason). Neither side touches its
model: a base only names what a later exchange is sent relative to (:mod:`swarm.gossip._bases`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from swarm.compression import FrameStore, Schema, encode_tensors, schema_of
from swarm.gossip._bases import Base, BaseStore, check_base, new_base_id
from swarm.gossip._deadlines import Deadlines, payload_nbytes
from swarm.gossip._exchange import (
    ExchangeSpec,
    NotCommitted,
    PartnerRejected,
    _nack_error,
    _receive_all,
    as_named,
    in_thread,
    receive_limits,
)
from swarm.gossip._handshake import Handshake
from swarm.gossip._metrics import MetricsRecorder
from swarm.gossip._protocol import Channel, Hello, MsgKind, ProtocolError
from swarm.gossip._reputation import Reputation
from swarm.gossip._roles import remember
from swarm.gossip._validation import ValidationError, schema_hash
from swarm.p2p import PEER_FAULTS

if TYPE_CHECKING:
    from hivemind.p2p import P2P

    from swarm.p2p import LoopThread

logger = logging.getLogger("swarm.gossip._averager")


async def send_base(
    channel: Channel, tensors: Mapping[str, torch.Tensor], schema: Schema, spec: ExchangeSpec
) -> FrameStore:
    """Stream ``tensors`` as frames, keep them, and return them once the partner ACKed; raises
    PartnerRejected or NotCommitted on its NACK, ProtocolError or a connection error otherwise."""
    store = FrameStore(expected=schema, limits=receive_limits(spec), codec=spec.codec)
    frames = iter(encode_tensors(tensors, spec.codec, spec.chunk_bytes))
    count = 0
    while (frame := await in_thread(next, frames, None)) is not None:
        await in_thread(store.feed, frame)
        await channel.send(MsgKind.DATA, frame)
        count += 1
    await channel.send_json(MsgKind.END, {"frames": count})
    store.complete()
    kind, payload = await channel.recv_expect(MsgKind.ACK, MsgKind.NACK)
    if kind is MsgKind.NACK:
        raise _nack_error(payload)
    return store


async def receive_base(
    channel: Channel, schema: Schema, spec: ExchangeSpec, keep: Callable[[FrameStore], None]
) -> None:
    """Take the partner's frames of ``schema``, check them, ``keep`` them, then ACK (so that the pusher,
    once it has our ACK, finds the base here); ValidationError (NACK sent) for a base that does not
    decode or is not finite."""
    store = await _receive_all(channel, schema, spec)
    try:
        await in_thread(check_base, store, schema)
    except ValidationError as exc:
        with contextlib.suppress(Exception):
            await channel.send_json(MsgKind.NACK, {"reason": str(exc)[:500]})
        raise
    keep(store)
    await channel.send(MsgKind.ACK)


class BaseRoles:
    """The averager's two sides of a base push; the state is the averager's (declared here)."""

    if TYPE_CHECKING:
        _p2p: P2P
        _loop: LoopThread
        _handshake: Handshake
        _metrics: MetricsRecorder
        _reputation: Reputation
        _deadlines: Deadlines
        _spec: ExchangeSpec
        _delta_spec: ExchangeSpec | None
        _bases: BaseStore
        _schema: Schema | None
        _schema_hash: str
        _pushed_at: dict[str, float]
        _incoming_bases: dict[str, asyncio.Event]
        base_wait_s: float
        _aborted: bool
        _closed: bool
        serve_interval_s: float

    def push_base(self, partner: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Push ``tensors`` (our anchor) to ``partner`` as the base of our next exchange with it, in the
        averager's codec; True once it took them. Blocking and thread-safe; False (nothing kept) if the
        partner refused, failed, or this averager has no delta codec."""
        if self._delta_spec is None or self._closed or self._aborted:
            return False
        pushed = self._loop.run(self._push_base(partner, as_named(tensors)))
        if pushed:
            self._metrics.count("pushed")
        return pushed

    async def _push_base(self, partner: str, tensors: Mapping[str, torch.Tensor]) -> bool:
        schema, base_id = schema_of(tensors), new_base_id()
        hello = self._handshake.hello(schema_hash(schema), 1.0, base=base_id, push=True)
        channels: list[Channel] = []
        try:
            reply = await self._handshake.propose(self._p2p, partner, hello, channels)
            if reply.kind is not MsgKind.ACCEPT or reply.channel is None:
                logger.debug("base push to %s: %s", partner, reply.describe())
                return False
            nbytes = payload_nbytes(tensors, self._spec.codec)
            async with asyncio.timeout(self._deadlines.exchange_s(partner, nbytes)):
                frames = await send_base(reply.channel, tensors, schema, self._spec)
        except (PartnerRejected, NotCommitted, ProtocolError, TimeoutError, *PEER_FAULTS) as exc:
            logger.debug("base push to %s failed: %s: %s", partner, type(exc).__name__, exc)
            return False
        finally:
            for channel in channels:
                channel.close()
            sent, received = sum(c.bytes_sent for c in channels), sum(c.bytes_received for c in channels)
            self._metrics.add_bytes(sent, received, base=True)
        self._bases.put(partner, Base(base_id, frames, schema))
        return True

    async def _serve_base(self, peer: str, channel: Channel, theirs: Hello) -> None:
        """A partner's base push: at most one per partner per serve interval, of the tensors we
        exchange; kept only if every frame checks out (bad frames ban the pusher, as bad data does)."""
        schema = self._schema
        if self._delta_spec is None or schema is None or not theirs.base:
            await channel.send_json(MsgKind.BUSY, {"reason": "no base wanted"})
            return
        last = self._pushed_at.get(peer)
        if last is not None and time.monotonic() - last < self.serve_interval_s:
            await channel.send_json(MsgKind.BUSY, {"reason": "took a base from you this round already"})
            return
        remember(self._pushed_at, peer, time.monotonic())
        ours = self._handshake.hello(self._schema_hash, 1.0, base=theirs.base, push=True)
        mismatch = ours.mismatch(theirs)
        if mismatch is not None:
            await channel.send_json(MsgKind.REJECT, {"reason": mismatch})
            return
        await channel.send_json(MsgKind.ACCEPT, ours.to_json())
        nbytes = sum(self._spec.codec.payload_nbytes(math.prod(shape)) for shape, _ in schema.values())
        arrived = self._incoming_bases.setdefault(peer, asyncio.Event())

        def keep(frames: FrameStore) -> None:
            self._bases.put(peer, Base(theirs.base, frames, schema))

        try:
            async with asyncio.timeout(self._deadlines.exchange_s(peer, nbytes)):
                await receive_base(channel, schema, self._spec, keep)
        except ValidationError as exc:
            self._reputation.misbehaved(peer, f"pushed a bad base: {exc}")
        except (PartnerRejected, NotCommitted, ProtocolError, TimeoutError, *PEER_FAULTS) as exc:
            logger.debug("base push from %s failed: %s: %s", peer, type(exc).__name__, exc)
        finally:
            arrived.set()  # whoever waits for it goes on, with the base or without
            if self._incoming_bases.get(peer) is arrived:
                del self._incoming_bases[peer]

    async def _await_incoming_base(self, peer: str) -> None:
        """Before proposing an exchange to ``peer``: if it is pushing us a base right now, wait for it to
        land (at most ``base_wait_s``), so that the exchange can go relative to it instead of sending
        whole models, which would crowd the same links even more."""
        arrived = self._incoming_bases.get(peer)
        if arrived is not None and self.base_wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.base_wait_s):
                    await arrived.wait()
