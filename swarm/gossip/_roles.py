"""The two network roles of a :class:`~swarm.gossip.GossipAverager`: serving a partner's exchange and
initiating our own. Both end in the averager's one data phase and commit (``_exchange``), so this
mixin holds only what differs: the handshake side, the choice of partners and abort handling."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from swarm.gossip._bases import Base, BaseStore
from swarm.gossip._exchange import in_thread
from swarm.gossip._gate import ExchangeGate, Turn
from swarm.gossip._handshake import BANNED_REASON, Handshake
from swarm.gossip._local import Local
from swarm.gossip._metrics import MetricsRecorder, SyncOutcome, SyncResult, log_failure
from swarm.gossip._offer import Offerer
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import PartnerInfo, eligible_partners, pick_order
from swarm.gossip._protocol import PROTOCOL_VERSION, Channel, Hello, MsgKind, parse_json
from swarm.gossip._reputation import Reputation

if TYPE_CHECKING:
    from hivemind.p2p import P2P

logger = logging.getLogger("swarm.gossip._averager")


class ExchangeRoles:
    """Serving and initiating side of the averager; the state is the averager's (declared here)."""

    if TYPE_CHECKING:
        options: GossipOptions
        config_hash: str
        peer_id: str
        _p2p: P2P
        _handshake: Handshake
        _metrics: MetricsRecorder
        _reputation: Reputation
        _gate: ExchangeGate
        _lock: threading.Lock
        _offerer: Offerer
        _last_partner: str | None
        _rng: random.Random
        _aborted: bool
        _served_at: dict[str, float]
        _bases: BaseStore
        _refuses_us: dict[str, float]
        serve_interval_s: float
        _inflight: asyncio.Task[SyncResult] | None
        _serving: asyncio.Task[None] | None

        def _offered(self) -> Local | None: ...
        def _release(self, local: Local) -> None: ...
        async def _exchange(
            self,
            partner: str,
            channel: Channel,
            local: Local,
            theirs: Hello,
            turn: Turn,
            *,
            initiator: bool,
            base: Base | None = None,
        ) -> SyncResult: ...
        async def _serve_base(self, peer: str, channel: Channel, theirs: Hello) -> None: ...
        async def _await_incoming_base(self, peer: str) -> None: ...
        def _result(
            self,
            outcome: SyncOutcome,
            partner: str | None,
            channel: Channel | None,
            latency: float,
            reason: str,
            weight: float = 0.0,
        ) -> SyncResult: ...

    # ------------------------------------------------------------------ serving side

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = self._handshake.channel(reader, writer)
        try:
            await self._serve_exchange(peer, channel)
        finally:
            self._metrics.add_bytes(channel.bytes_sent, channel.bytes_received)

    async def _serve_exchange(self, peer: str, channel: Channel) -> None:
        _, payload = await channel.recv_expect(MsgKind.HELLO)
        theirs = Hello.from_json(parse_json(payload))
        if self._reputation.is_banned(peer):
            await channel.send_json(MsgKind.REJECT, {"reason": BANNED_REASON})
            return
        if self._aborted:
            await channel.send_json(MsgKind.BUSY, {"reason": "leaving"})
            return
        if theirs.push:
            await self._serve_base(peer, channel, theirs)
            return
        if not self._serve_allowed(peer):
            await channel.send_json(MsgKind.BUSY, {"reason": "served you this round already"})
            return
        if not self._gate.try_serve():
            await channel.send_json(MsgKind.BUSY, {"reason": "in another exchange"})
            return
        self._serving = asyncio.current_task()
        taken = None
        try:
            taken = await self._serving_offer()
            if taken is None:
                await channel.send_json(MsgKind.BUSY, {"reason": "nothing to offer yet"})
                return
            local, turn = taken
            remember(self._served_at, peer, time.monotonic())
            base = self._bases.agreed(peer, theirs.base)
            ours = self._handshake.hello(*local.stated(), base=base.base_id if base is not None else "")
            mismatch = ours.mismatch(theirs)
            if mismatch is not None:
                await channel.send_json(MsgKind.REJECT, {"reason": mismatch})
                return
            await channel.send_json(MsgKind.ACCEPT, ours.to_json())
            result = await self._exchange(peer, channel, local, theirs, turn, initiator=False, base=base)
            logger.debug("served exchange with %s: %s %s", peer, result.outcome.value, result.reason)
        finally:
            if taken is not None:
                self._release(taken[0])
            self._serving = None
            self._gate.served()

    def _serve_allowed(self, peer: str) -> bool:
        """At most one served exchange per partner per ``serve_interval_s``, whatever its outcome: a
        dialler with no record gets no more than a member."""
        last = self._served_at.get(peer)
        return last is None or time.monotonic() - last >= self.serve_interval_s

    async def _serving_offer(self) -> tuple[Local, Turn] | None:
        """What we serve and its turn, taken under the exchange lock; None if there is nothing to
        offer or the lock is held (a commit: the partner gets BUSY)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            local = await in_thread(self._offered)
            return None if local is None else (local, Turn(self._gate, self._gate.generation()))
        finally:
            self._lock.release()

    def _donated(self, partner: str, channel: Channel, latency: float, initiator: bool) -> SyncResult:
        """An exchange whose partner stated a joiner's weight ended: it took our tensors over, and
        nothing here changes (no commit, no verdict on it, no schedule round). Our own sync that met
        such a partner got nothing, so it did not succeed."""
        self._metrics.count("donated")
        if initiator:
            reason = "the partner stated a joiner's weight: it took our tensors, we got nothing"
            return self._result(SyncOutcome.FAILED, partner, channel, latency, reason)
        return self._result(SyncOutcome.OK, partner, channel, latency, "donated: a joiner took our tensors")

    # ------------------------------------------------------------------ initiating side

    def _excluded(self, peer: str) -> bool:
        """Not a partner for now: banned (or a failure held against it), or it told us it banned us:
        dialling it again before its ban could end only costs both sides a handshake."""
        until = self._refuses_us.get(peer)
        if until is not None and time.monotonic() < until:
            return True
        return self._reputation.is_banned(peer)

    async def _initiate_abortable(
        self, local: Local, candidates: Sequence[PartnerInfo], turn: Turn, first: str | None
    ) -> SyncResult:
        """:meth:`_initiate` as a task that :meth:`abort` can cancel; a cancelled one returns CANCELLED."""
        cancelled = self._result(SyncOutcome.CANCELLED, None, None, 0.0, "aborted: shutting down")
        if self._aborted:
            return cancelled
        self._inflight = asyncio.ensure_future(self._initiate(local, candidates, turn, first))
        try:
            return await self._inflight
        except asyncio.CancelledError:
            if not self._inflight.cancelled():
                raise  # we were cancelled ourselves (loop shutdown), not just the exchange
            self._metrics.count("failed")
            return cancelled
        finally:
            self._inflight = None

    async def _initiate(
        self, local: Local, candidates: Sequence[PartnerInfo], turn: Turn, first: str | None
    ) -> SyncResult:
        """Try eligible partners, ``first`` first, then random ones, until one accepts; that exchange's
        outcome is the result."""
        eligible = eligible_partners(
            candidates,
            self_id=self.peer_id,
            protocol_version=PROTOCOL_VERSION,
            config_hash=self.config_hash,
            banned=self._excluded,
            last_partner=self._last_partner,
        )
        if not eligible:
            self._metrics.count("no_partner")
            return self._result(SyncOutcome.NO_PARTNER, None, None, 0.0, "no eligible partner")
        channels: list[Channel] = []
        try:
            order = pick_order(eligible, self._rng, self.options.max_attempts, first=first)
            result = await self._try_partners(order, local, channels, turn)
        finally:
            for channel in channels:
                channel.close()
            sent = sum(channel.bytes_sent for channel in channels)
            received = sum(channel.bytes_received for channel in channels)
            self._metrics.add_bytes(sent, received)
        return dataclasses.replace(result, bytes_sent=sent, bytes_received=received)

    async def _try_partners(
        self, order: Sequence[PartnerInfo], local: Local, channels: list[Channel], turn: Turn
    ) -> SyncResult:
        deadline = time.monotonic() + self.options.exchange_timeout_s
        busy, reason = 0, ""
        for info in order:
            if time.monotonic() >= deadline:
                break
            await self._await_incoming_base(info.peer_id)
            dialled = time.monotonic()
            held = self._bases.get(info.peer_id)
            hello = self._handshake.hello(*local.stated(), base=held.base_id if held is not None else "")
            reply = await self._handshake.propose(self._p2p, info.peer_id, hello, channels)
            answered_s = time.monotonic() - dialled
            if reply.kind is not None:  # a dial that failed is timed by its own timeout, not the link
                self._metrics.record_dial(answered_s)
            answer = reply.kind.name if reply.kind is not None else "no answer"
            logger.debug("dialled %s: %s after %.2f s", info.peer_id, answer, answered_s)
            if reply.kind is MsgKind.ACCEPT and reply.channel is not None and reply.hello is not None:
                base = held if held is not None and reply.hello.base == held.base_id else None
                return await self._exchange(
                    info.peer_id, reply.channel, local, reply.hello, turn, initiator=True, base=base
                )
            self._reputation.answered(info.peer_id, reply)
            if reply.kind is MsgKind.REJECT and reply.reason == BANNED_REASON:
                until = time.monotonic() + self.options.ban_base_s
                remember(self._refuses_us, info.peer_id, until)
            busy += reply.kind is MsgKind.BUSY
            if reply.kind is not MsgKind.BUSY:
                outcome = SyncOutcome.FAILED if reply.kind is None else SyncOutcome.REJECTED
                log_failure("initiator", info.peer_id, "handshake", outcome, reply.reason or reply.describe())
            reason = f"{info.peer_id}: {reply.describe()}"
        outcome = SyncOutcome.BUSY if busy else SyncOutcome.FAILED
        return self._result(outcome, None, None, 0.0, reason)


REMEMBERED = 4096
"""Peers a per-peer table of the roles keeps, the oldest entry forgotten first."""


def remember(table: dict[str, float], peer: str, value: float) -> None:
    """Set ``table[peer]`` as its newest entry, keeping at most :data:`REMEMBERED` peers."""
    table.pop(peer, None)
    table[peer] = value
    while len(table) > REMEMBERED:
        del table[next(iter(table))]
