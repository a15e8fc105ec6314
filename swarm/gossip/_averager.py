"""GossipAverager: quantized pairwise averaging with scheduled or random live partners over hivemind P2P.

Threads: the caller's thread (``sync``) and one private event-loop thread that owns the P2P client,
serves incoming exchanges, and runs outgoing ones. The exchange lock
(:class:`~swarm.gossip._gate.ExchangeGate`) is held only for local, short work: taking an offer,
and committing; never while a partner's data is awaited, so a slow partner cannot make
our own sync wait. The gate's generation lets only one of overlapping exchanges commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from swarm.compression import ErrorFeedback, Schema, schema_of
from swarm.gossip._backoff import Backoff
from swarm.gossip._base_push import BaseRoles
from swarm.gossip._bases import Base, BaseStore
from swarm.gossip._deadlines import Deadlines, payload_nbytes
from swarm.gossip._exchange import as_named, in_thread, is_donation, run_exchange, settle
from swarm.gossip._gate import ExchangeGate, Turn
from swarm.gossip._handshake import Handshake
from swarm.gossip._local import Local, committed_of
from swarm.gossip._metrics import ExchangeMetrics, MetricsRecorder, SyncOutcome, SyncResult, log_failure
from swarm.gossip._mixing import Mixed
from swarm.gossip._offer import Committed, Offerer
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import PartnerInfo
from swarm.gossip._protocol import Channel, Hello, handler_name
from swarm.gossip._reputation import Reputation
from swarm.gossip._robust import Blame
from swarm.gossip._roles import ExchangeRoles
from swarm.gossip._validation import schema_hash
from swarm.p2p import P2PFactory, StreamService

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.network import SwarmKey

logger = logging.getLogger(__name__)


class GossipAverager(ExchangeRoles, BaseRoles, StreamService):
    """Averages its offerer's snapshots with live partners; serves partners while alive.

    Exactly one of ``dht`` (a running ``hivemind.DHT``; we open our own client to its daemon) or
    ``p2p_factory`` (an async callable returning a ``hivemind.p2p.P2P`` dedicated to this averager)
    must be given. The averager shuts the P2P client it obtained down on :meth:`close`.
    ``options`` (:class:`GossipOptions`) tunes the exchanges: ``robust_clip`` turns on the pairwise centred
    clip (``swarm.gossip._robust``) with its strikes; ``exclusive_with`` shares another averager's exchange
    lock (at most one exchange of the two at a time); ``respect_bans_of`` makes it also refuse the peers
    another averager has banned. Each :meth:`sync` is handed its partners, and may name the one to try
    first (a schedule such as :func:`~swarm.gossip.hypercube_partner`; the others follow in random
    order when it is missing, banned or busy). In a private swarm (``swarm_key``, by default
    the key ``dht`` was started with) every stream starts with the swarm key handshake
    (:mod:`swarm.p2p`); a peer that fails it is dropped before its HELLO.

    Each exchange, initiated or served, uses a fresh snapshot from ``offerer.offer()`` and settles it
    with ``offerer.settled()``, passing the committed result or None (:mod:`swarm.gossip._offer`); the
    averager writes nothing in place.

    ``wrap_channel`` is the transport seam: each exchange's data phase (our frames, END, the ACKs) runs
    on ``wrap_channel(channel)``, a view of the stream with :class:`~swarm.gossip._protocol.Channel`'s
    methods. By default the channel itself; the tests wrap it to tamper with or stall what we send.
    """

    what = "gossip exchange"
    open_timeout_s = None
    close_timeout_s = 10.0

    def __init__(
        self,
        *,
        run_id: str,
        offerer: Offerer,
        dht: DHT | None = None,
        p2p_factory: P2PFactory | None = None,
        options: GossipOptions | None = None,
        config_hash: str = "",
        respect_bans_of: GossipAverager | None = None,
        exclusive_with: GossipAverager | None = None,
        client_mode: bool = False,
        seed: int | None = None,
        swarm_key: SwarmKey | None = None,
        wrap_channel: Callable[[Channel], Channel] = lambda channel: channel,
    ) -> None:
        opts = self.options = options or GossipOptions()
        handler = handler_name(run_id)
        super().__init__(
            run_id,
            handler,
            dht=dht,
            p2p_factory=p2p_factory,
            swarm_key=swarm_key,
            auth_timeout_s=opts.chunk_timeout_s,
            client_mode=client_mode,
        )
        self.run_id = run_id
        self.config_hash = config_hash
        self._offerer = offerer
        self._schema_hash = ""  # of the last tensors we exchanged: error feedback restarts when it changes
        self._schema: Schema | None = None  # theirs: what a base pushed to us must match
        self._spec = opts.exchange_spec()
        self._delta_spec = opts.delta_spec()
        self._bases = BaseStore()
        self._pushed_at: dict[str, float] = {}  # partner: when it last pushed us a base (bounded)
        self._incoming_bases: dict[str, asyncio.Event] = {}  # partner: its push to us in flight
        self.base_wait_s = 0.0
        """An exchange with a partner that is pushing us a base waits at most this long for it to land
        (0: not at all); a trainer sets it to a share of its round."""
        self._wrap_channel = wrap_channel
        self._handshake = Handshake(run_id, config_hash, handler, self._swarm_key, opts)
        self._use_ef = opts.error_feedback and not self._spec.codec.lossless
        self._ef: ErrorFeedback | None = None
        self._delta_ef: ErrorFeedback | None = None  # the same residuals, encoded in the delta codec
        self._metrics = MetricsRecorder()
        also = respect_bans_of._reputation.bans if respect_bans_of is not None else None
        self._reputation: Reputation = Reputation(opts, self._metrics, also)
        self._deadlines = Deadlines(
            opts.exchange_timeout_s, max(opts.exchange_timeout_s, opts.max_exchange_timeout_s)
        )
        self._rng = random.Random(seed)
        # averagers that share the gate take turns: at most one own sync and one served exchange in
        # flight across them, and only one of overlapping exchanges commits
        self._gate: ExchangeGate = exclusive_with._gate if exclusive_with is not None else ExchangeGate()
        self._lock: threading.Lock = self._gate.lock
        self._last_partner: str | None = None
        self._aborted = False
        self._aborting = threading.Event()  # wakes a sync backing off after failures
        self._backoff = Backoff(opts.retry_backoff_s, opts.max_retry_backoff_s, self._rng)
        self._served_at: dict[str, float] = {}  # partner: when we last served it (bounded)
        self._refuses_us: dict[str, float] = {}  # partner: until when it said it banned us (bounded)
        self.serve_interval_s = opts.serve_interval_s
        """A partner is served at most once per this many seconds (0: no limit); a trainer sets it to
        a share of its round, so that a partner gets one exchange per round, record or not."""
        self._inflight: asyncio.Task[SyncResult] | None = None  # only touched on the loop thread
        self._serving: asyncio.Task[None] | None = None  # the served exchange in flight, if any
        self._start(f"gossip-{run_id}")

    # ------------------------------------------------------------------ public API

    def sync(self, partners: Sequence[PartnerInfo], first: str | None = None) -> SyncResult:
        """One exchange of a fresh offer with an eligible one of ``partners`` (SKIPPED when the offerer
        has nothing to offer); blocking and thread-safe. ``first`` (the schedule's partner) is tried
        first, then random ones.

        If every partner tried is BUSY, the call backs off (randomized, exponential) without counting
        as an exchange, so partners can exchange with us meanwhile, and tries again for up to
        ``busy_patience_s``; only then does it return BUSY. A served exchange in flight is waited for
        at most that long too; then both run, and the first to commit wins (the other commits nothing).
        After a sync that failed or was rejected, the next one first waits a randomized,
        exponential backoff (``retry_backoff_s`` doubling up to ``max_retry_backoff_s``,
        reset by a committed exchange), so that peers calling ``sync`` in a loop never storm
        partners that are busy, gone or refusing them.
        """
        if self._closed:
            raise RuntimeError("the averager is closed")
        with self._gate.sync_lock:
            return self._sync(list(partners), first)

    def _sync(self, candidates: list[PartnerInfo], first: str | None) -> SyncResult:
        self._aborting.wait(self._backoff.remaining())
        result = self._sync_patiently(candidates, first)
        self._backoff.after(result.outcome, result.reason)
        return result

    def _sync_patiently(self, candidates: list[PartnerInfo], first: str | None) -> SyncResult:
        give_up_busy = time.monotonic() + self.options.busy_patience_s
        backoff, sent, received = 0.01, 0, 0
        while True:
            self._reputation.review(candidates)
            self._gate.begin_sync(max(0.0, give_up_busy - time.monotonic()))
            try:
                with self._lock:
                    local = self._offered()
                    turn = Turn(self._gate, self._gate.generation())
                if local is None:
                    return self._result(SyncOutcome.SKIPPED, None, None, 0.0, "nothing to offer")
                try:
                    result = self._loop.run(self._initiate_abortable(local, candidates, turn, first))
                finally:
                    self._release(local)
            finally:
                self._gate.end_sync()
            sent, received = sent + result.bytes_sent, received + result.bytes_received
            pause = self._rng.uniform(backoff / 2, backoff)
            if (
                self._aborted
                or result.outcome is not SyncOutcome.BUSY
                or time.monotonic() + pause > give_up_busy
            ):
                return dataclasses.replace(result, bytes_sent=sent, bytes_received=received)
            time.sleep(pause)
            backoff = min(2 * backoff, 0.25)

    def invalidate(self) -> None:
        """The owner is about to change what its offers are computed from (lazy offers,
        :mod:`swarm.gossip._offer`): the exchanges in flight stop and do not commit."""
        self._gate.changed()

    def metrics(self) -> ExchangeMetrics:
        return self._metrics.snapshot()

    def banned_peers(self) -> dict[str, float]:
        """Currently banned peer ids and the seconds left on each ban."""
        return self._reputation.banned()

    def ban_reasons(self) -> dict[str, str]:
        """Why each peer of :meth:`banned_peers` is banned (or held toward a ban)."""
        return self._reputation.reasons()

    def ban_strikes(self) -> dict[str, int]:
        """Strikes (bans so far, expired ones included) per peer since its last good exchange."""
        return self._reputation.bans.strikes()

    def abort(self) -> None:
        """Cancel the sync in flight and refuse new ones (they return CANCELLED); for a prompt shutdown.

        The cancelled exchange (and one we are serving, which would otherwise hold the exchange lock
        until its deadline) does not commit (exactly as if the partner had vanished, see
        docs/gossip.md): our tensors stay bit-identical, and the caller's ``sync`` returns once the
        exchange has unwound. Partners that dial us from now on get BUSY ("leaving"), so none
        starts an exchange that :meth:`close` would cut off. Thread-safe and idempotent.
        """
        self._aborted = True
        self._aborting.set()
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.loop.call_soon_threadsafe(self._cancel_inflight)

    def _cancel_inflight(self) -> None:
        for task in (self._inflight, self._serving):
            if task is not None:
                task.cancel()

    def _stop_work(self) -> None:
        """On :meth:`close`: abort what is in flight."""
        self.abort()

    # ------------------------------------------------------------------ state

    def _offered(self) -> Local | None:
        """A fresh snapshot from the offerer, or None. Called with the lock held."""
        offer = self._offerer.offer()
        if offer is None:
            return None
        if not (offer.weight > 0 and offer.weight < float("inf")):
            raise ValueError(f"offered weight must be a finite positive number, got {offer.weight!r}")
        named = as_named(offer.tensors)
        self.expect_schema(schema_of(named))
        nbytes = payload_nbytes(named, self._spec.codec)
        return Local(named, float(offer.weight), self._schema_hash, nbytes, offer)

    def _release(self, local: Local) -> None:
        """The exchange that took ``local`` ended: settle its offer, unless it committed (and so was
        settled with its result)."""
        if not local.settled:
            local.settled = True
            self._offerer.settled(local.offer, None)

    def expect_schema(self, schema: Schema) -> None:
        """The tensors we exchange (and take bases of) from now on; error feedback restarts when they
        change. The averager learns it from each offer; a caller that takes bases before its first
        offer states it first."""
        digest = schema_hash(schema)
        if self._schema_hash != digest:
            self._schema_hash, self._schema = digest, dict(schema)
            self._ef = ErrorFeedback(self._spec.codec) if self._use_ef else None
            delta = self._delta_spec
            self._delta_ef = self._ef.with_codec(delta.codec) if self._ef and delta else None

    # ------------------------------------------------------------------ both roles

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
    ) -> SyncResult:
        """Run the data phase under the exchange deadline, without the exchange lock; commit (under
        it) if ``turn`` got the reservation and both sides ACKed, or leave everything untouched.
        ``base``: the base both HELLOs named, which the tensors are sent relative to."""
        started, before = time.monotonic(), (channel.bytes_sent, channel.bytes_received)
        own = local.offer.blame_norm
        blame = Blame(self._reputation.norm_reference(partner), own)
        weights = (local.weight, theirs.weight)
        donation = is_donation(local.weight, theirs.weight)
        if donation:
            turn = turn.as_donation()
        data = self._wrap_channel(channel)
        spec, feedback = (self._spec, self._ef) if base is None else (self._delta_spec, self._delta_ef)
        assert spec is not None  # a base is only agreed with a delta codec
        shared = base.tensors if base is not None else None
        exchange = run_exchange(data, local.tensors, weights, spec, feedback, blame, turn, shared)
        try:
            deadline = self._deadlines.exchange_s(partner, local.nbytes)
            ended = await settle(exchange, deadline, partner)
            latency = time.monotonic() - started
            sent, received = channel.bytes_sent - before[0], channel.bytes_received - before[1]
            logger.debug(  # what a simulator's link model is calibrated by (docs/simulator.md)
                "data phase with %s: %.2f s, %d B sent, %d B received, %s",
                partner,
                latency,
                sent,
                received,
                "relative to a base" if base is not None else "whole tensors",
            )
            moved = max(sent, received)
            self._deadlines.observe(partner, moved, latency)  # a deadline too short still measured the link
            if ended.mixed is not None and donation:
                return self._donated(partner, channel, latency, initiator)
            if ended.mixed is not None:
                result = self._result(ended.outcome, partner, channel, latency, ended.reason, local.weight)
                done = committed_of(ended.mixed, theirs, initiator, result)
                if base is not None:  # counted first: the offerer hears of the commit inside it
                    self._metrics.count("relative")
                await in_thread(self._commit, partner, local, ended.mixed, latency, turn, done)
                return result
        finally:  # cancelled (abort() or shutdown), failed, or committed above: nothing more commits
            turn.release(committed=False)
        if (ended.bad_data or ended.bad_base) and base is not None:
            self._bases.drop(partner)  # whoever pushed it, a base that failed is not tried again
        if ended.bad_data:
            self._reputation.misbehaved(partner, ended.reason)
        elif ended.blame_partner:
            self._reputation.failed(partner, ended.reason)
        self._metrics.count("rejected" if ended.outcome is SyncOutcome.REJECTED else "failed")
        role = "initiator" if initiator else "responder"
        log_failure(role, partner, "data", ended.outcome, ended.reason)
        return self._result(ended.outcome, partner, channel, latency, ended.reason)

    def _commit(
        self,
        partner: str,
        local: Local,
        mixed: Mixed,
        latency: float,
        turn: Turn,
        done: Committed,
    ) -> None:
        """Hand a fully ACKed exchange to the offerer under the exchange lock (a worker thread); fold
        the error-feedback residuals, unless the offerer keeps the mix and folds them itself
        (:meth:`MixedTensors.keep`); the turn's reservation ends committed. Then judge the partner
        (:meth:`Reputation.committed`)."""
        with self._lock:
            turn.release(committed=True)
            local.settled = True
            self._offerer.settled(local.offer, done)
            if not mixed.tensors.kept:
                mixed.tensors.fold_all()
            self._reputation.committed(partner, mixed.clip)
        self._last_partner = partner
        self._metrics.record_ok(latency)

    def _result(
        self,
        outcome: SyncOutcome,
        partner: str | None,
        channel: Channel | None,
        latency: float,
        reason: str,
        weight: float = 0.0,
    ) -> SyncResult:
        sent = channel.bytes_sent if channel is not None else 0
        received = channel.bytes_received if channel is not None else 0
        return SyncResult(outcome, partner, sent, received, latency, weight, reason)
