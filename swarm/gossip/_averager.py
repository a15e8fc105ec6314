"""GossipAverager: quantized pairwise averaging with random live partners over hivemind P2P.

Threads: the caller's thread (``sync``, ``start_background``'s worker) and one private event-loop
thread that owns the P2P client, serves incoming exchanges, and runs outgoing ones. One lock makes
exchanges exclusive: whoever holds it (a ``sync`` call, a served exchange, or ``paused()``) is the
only one touching the registered tensors; a partner that finds it taken gets BUSY.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from hivemind.p2p import P2P, PeerID

from swarm._auth import AuthError, authenticate_stream, swarm_key_of
from swarm.compression import ErrorFeedback, get_codec
from swarm.gossip._background import Background, Tensors
from swarm.gossip._exchange import (
    ExchangeHooks,
    ExchangeSpec,
    Mixed,
    PartnerRejected,
    as_named,
    commit,
    run_exchange,
)
from swarm.gossip._loop import LoopThread
from swarm.gossip._metrics import GossipMetrics, MetricsRecorder, SyncOutcome, SyncResult
from swarm.gossip._partners import BanList, PartnerInfo, PartnerSource, eligible_partners, pick_order
from swarm.gossip._protocol import (
    PROTOCOL_VERSION,
    Channel,
    Hello,
    MsgKind,
    ProtocolError,
    handler_name,
    parse_json,
)
from swarm.gossip._robust import ClipPolicy
from swarm.gossip._setup import check_params, daemon_maddr
from swarm.gossip._validation import NormPolicy, ValidationError, schema_hash, schema_of

if TYPE_CHECKING:
    from swarm.network import SwarmKey

logger = logging.getLogger(__name__)
BANNED_REASON = "you are temporarily banned"


@dataclass
class _Local:
    """The tensors this peer averages (the caller's objects, updated in place) and their weight."""

    tensors: dict[str, torch.Tensor]
    weight: float
    schema_hash: str


@dataclass(frozen=True)
class _Attempt:
    """A partner that accepted our HELLO, with the open channel and its stated weight."""

    partner: str
    channel: Channel
    weight: float


class GossipAverager:
    """Averages the registered tensors with random partners; serves partners while alive.

    Exactly one of ``dht`` (a running ``hivemind.DHT``; we open our own client to its daemon) or
    ``p2p_factory`` (an async callable returning a ``hivemind.p2p.P2P`` dedicated to this averager)
    must be given. The averager shuts the P2P client it obtained down on :meth:`close`.
    ``robust_clip`` turns on the pairwise centred clip (``swarm.gossip._robust``) with its strikes;
    ``respect_bans_of`` makes it also refuse the peers another averager has banned.
    In a private swarm (``swarm_key``, by default the key ``dht`` was started with) every stream starts
    with the swarm key handshake (:mod:`swarm._auth`); a peer that fails it is dropped before its HELLO.
    """

    def __init__(
        self,
        *,
        run_id: str,
        partner_source: PartnerSource,
        dht: object | None = None,
        p2p_factory: Callable[[], Awaitable[P2P]] | None = None,
        config_hash: str = "",
        codec: str = "int8",
        block_size: int = 64,
        chunk_bytes: int = 1 << 20,
        error_feedback: bool = True,
        exchange_timeout_s: float = 30.0,
        chunk_timeout_s: float = 10.0,
        max_norm_ratio: float = 100.0,
        norm_floor: float = 1.0,
        ban_base_s: float = 10.0,
        ban_max_s: float = 600.0,
        robust_clip: bool = False,
        clip_ratio: float = 2.0,
        clip_floor: float = 1e-8,
        clip_hard_factor: float = 10.0,
        clip_strikes: int = 2,
        respect_bans_of: GossipAverager | None = None,
        max_attempts: int = 4,
        busy_patience_s: float = 5.0,
        client_mode: bool = False,
        initial_weight: float = 1.0,
        seed: int | None = None,
        swarm_key: SwarmKey | None = None,
        _hooks: ExchangeHooks | None = None,
    ) -> None:
        check_params(run_id, dht, p2p_factory, chunk_bytes, exchange_timeout_s, chunk_timeout_s, max_attempts)
        self.run_id = run_id
        self.config_hash = config_hash
        self.client_mode = client_mode
        self._swarm_key = swarm_key if swarm_key is not None else swarm_key_of(dht)
        self._partner_source = partner_source
        self._codec_name = codec
        self._block_size = block_size
        self._exchange_timeout = exchange_timeout_s
        self._chunk_timeout = chunk_timeout_s
        self._max_attempts = max_attempts
        self._busy_patience = busy_patience_s
        self._spec = ExchangeSpec(
            codec=get_codec(codec, block_size=block_size),
            chunk_bytes=chunk_bytes,
            policy=NormPolicy(max_norm_ratio=max_norm_ratio, norm_floor=norm_floor),
            hooks=_hooks,
            clip=ClipPolicy(clip_ratio, clip_floor, clip_hard_factor) if robust_clip else None,
        )
        if clip_strikes < 1:
            raise ValueError(f"clip_strikes must be at least 1, got {clip_strikes}")
        self._clip_strikes = clip_strikes
        self._own_norms: collections.deque[float] = collections.deque(maxlen=8)
        self._use_ef = error_feedback and not self._spec.codec.lossless
        self._ef: ErrorFeedback | None = None
        also = respect_bans_of._bans if respect_bans_of is not None else None
        self._bans = BanList(ban_base_s, ban_max_s, also=also)
        self._metrics = MetricsRecorder()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._local: _Local | None = None
        self._last_partner: str | None = None
        self._weight = float(initial_weight)
        self._background: Background | None = None
        self._closed = False
        self._aborted = False
        self._inflight: asyncio.Task[SyncResult] | None = None  # only touched on the loop thread
        self._serving: asyncio.Task[None] | None = None  # the served exchange holding the lock, if any
        self._handler = handler_name(run_id)
        control_maddr = daemon_maddr(dht) if dht is not None else None
        self._loop = LoopThread(name=f"gossip-{run_id}")
        try:
            self._p2p = self._loop.run(self._open_p2p(control_maddr, p2p_factory))
        except BaseException:
            self._loop.stop()
            raise

    # ------------------------------------------------------------------ public API

    def sync(self, tensors: Tensors | None = None, weight: float | None = None) -> SyncResult:
        """One exchange with a random eligible partner; blocking and thread-safe.

        ``tensors`` (a mapping or a sequence) are registered as this peer's state, served to other
        initiators until replaced, and updated in place only if the exchange commits; otherwise they
        stay bit-identical. ``weight`` is their mass (work behind them); None keeps the current
        weight, which each committed exchange (either role) replaces by the pair's mean weight.
        ``tensors=None`` syncs the tensors registered earlier.

        If every partner tried is BUSY, the call backs off (randomized, exponential) *without* holding
        the exchange lock, so partners can exchange with us meanwhile, and tries again for up to
        ``busy_patience_s``; only then does it return BUSY.
        """
        if self._closed:
            raise RuntimeError("the averager is closed")
        give_up_busy = time.monotonic() + self._busy_patience
        backoff, sent, received = 0.01, 0, 0
        while True:
            with self._lock:
                local = self._register(tensors, weight)
                tensors = weight = None
                candidates = list(self._partner_source())
                result = self._loop.run(self._initiate_abortable(local, candidates))
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

    def set_tensors(self, tensors: Tensors, weight: float | None = None) -> None:
        """Register (or replace) the tensors to serve to initiating partners, without syncing."""
        with self._lock:
            self._register(tensors, weight)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold off exchanges (partners get BUSY) while the caller reads or mutates the tensors."""
        with self._lock:
            yield

    @property
    def weight(self) -> float:
        return self._weight

    def metrics(self) -> GossipMetrics:
        return self._metrics.snapshot()

    def banned_peers(self) -> dict[str, float]:
        """Currently banned peer ids and the seconds left on each ban."""
        return self._bans.banned()

    def ban_strikes(self) -> dict[str, int]:
        """Strikes (bans so far, expired ones included) per peer since its last good exchange."""
        return self._bans.strikes()

    def start_background(
        self,
        get_tensors: Callable[[], Tensors] | None = None,
        interval_s: float = 1.0,
        *,
        get_weight: Callable[[], float] | None = None,
        on_result: Callable[[SyncResult], None] | None = None,
    ) -> None:
        """Sync every ``interval_s`` (with +-20% jitter) in a background thread until :meth:`stop`."""
        if self._background is not None:
            raise RuntimeError("background syncing is already running")
        self._background = Background(self, get_tensors, interval_s, get_weight, on_result)

    def stop(self) -> None:
        """Stop background syncing (serving goes on until :meth:`close`)."""
        background, self._background = self._background, None
        if background is not None:
            background.stop()

    def abort(self) -> None:
        """Cancel the sync in flight and refuse new ones (they return CANCELLED); for a prompt shutdown.

        The cancelled exchange (and one we are serving, which would otherwise hold the exchange lock
        for up to ``exchange_timeout_s``) does not commit (exactly as if the partner had vanished, see
        docs/gossip.md): our tensors stay bit-identical, and the caller's ``sync`` returns once the
        exchange has unwound. Partners that dial us from now on get BUSY ("shutting down"), so none
        starts an exchange that :meth:`close` would cut off. Thread-safe and idempotent.
        """
        self._aborted = True
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.loop.call_soon_threadsafe(self._cancel_inflight)

    def _cancel_inflight(self) -> None:
        for task in (self._inflight, self._serving):
            if task is not None:
                task.cancel()

    def close(self) -> None:
        """Stop syncing and serving, release the P2P client, and stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.abort()
        self.stop()
        with contextlib.suppress(Exception):
            self._loop.run(self._close_p2p(), timeout=10)
        self._loop.stop()

    def __enter__(self) -> GossipAverager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ------------------------------------------------------------------ set-up and state

    async def _open_p2p(self, daemon_maddr: object, factory: Callable[[], Awaitable[P2P]] | None) -> P2P:
        p2p = await P2P.replicate(daemon_maddr) if factory is None else await factory()
        self.peer_id: str = p2p.peer_id.to_base58()  # before serving: the handshake names both peers
        try:
            if not self.client_mode:
                await p2p.add_binary_stream_handler(self._handler, self._serve)
        except BaseException:
            await p2p.shutdown()
            raise
        return p2p

    async def _close_p2p(self) -> None:
        if not self.client_mode:
            with contextlib.suppress(Exception):
                await self._p2p.remove_binary_stream_handler(self._handler)
        await self._p2p.shutdown()

    def _register(self, tensors: Tensors | None, weight: float | None) -> _Local:
        """Called with the lock held."""
        if weight is not None:
            if not (weight > 0 and weight < float("inf")):
                raise ValueError(f"weight must be a finite positive number, got {weight!r}")
            self._weight = float(weight)
        if tensors is None:
            if self._local is None:
                raise ValueError("no tensors registered yet: pass tensors to sync() or set_tensors()")
            self._local.weight = self._weight
            return self._local
        named = as_named(tensors)
        digest = schema_hash(schema_of(named))
        if self._local is None or self._local.schema_hash != digest:
            self._ef = ErrorFeedback(self._spec.codec) if self._use_ef else None
        self._local = _Local(tensors=named, weight=self._weight, schema_hash=digest)
        return self._local

    def _hello(self, local: _Local) -> Hello:
        return Hello(
            version=PROTOCOL_VERSION,
            run_id=self.run_id,
            config_hash=self.config_hash,
            schema_hash=local.schema_hash,
            codec=self._codec_name,
            block_size=self._block_size,
            weight=local.weight,
        )

    def _channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Channel:
        return Channel(
            reader,
            writer,
            chunk_timeout_s=self._chunk_timeout,
            max_data_bytes=self._spec.chunk_bytes + 64 * 1024,
        )

    # ------------------------------------------------------------------ both roles

    async def _exchange(
        self, partner: str, channel: Channel, local: _Local, partner_weight: float
    ) -> SyncResult:
        """Run the data phase under the exchange deadline; commit, or leave everything untouched."""
        started = time.monotonic()
        blame_partner = True
        try:
            async with asyncio.timeout(self._exchange_timeout):
                mixed = await run_exchange(
                    channel,
                    local.tensors,
                    (local.weight, partner_weight),
                    self._spec,
                    self._ef,
                    max(self._own_norms, default=0.0),
                )
            outcome, reason = SyncOutcome.OK, ""
        except ValidationError as exc:
            outcome, reason = SyncOutcome.REJECTED, f"rejected its data: {exc}"
        except TimeoutError:
            outcome, reason = SyncOutcome.TIMEOUT, "exchange timed out"
        except PartnerRejected as exc:
            outcome, reason = SyncOutcome.FAILED, f"it rejected our data: {exc}"
        except (ProtocolError, ConnectionError, OSError, asyncio.IncompleteReadError) as exc:
            outcome, reason = SyncOutcome.FAILED, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # our side failed (e.g. NaN in our own tensors): not the partner's fault
            logger.exception("exchange with %s failed on our side", partner)
            outcome, reason, blame_partner = SyncOutcome.FAILED, f"local error: {exc}", False
        except asyncio.CancelledError:  # abort() or shutdown: nothing is committed
            if self._ef is not None:
                self._ef.discard_pending()
            raise
        latency = time.monotonic() - started
        if outcome is SyncOutcome.OK:
            self._commit(partner, local, mixed, latency)
        else:
            if self._ef is not None:
                self._ef.discard_pending()
            if blame_partner:
                self._bans.ban(partner, reason)
            self._metrics.count("rejected" if outcome is SyncOutcome.REJECTED else "failed")
        return self._result(outcome, partner, channel, latency, reason)

    def _commit(self, partner: str, local: _Local, mixed: Mixed, latency: float) -> None:
        """Apply a fully ACKed exchange: tensors in place, weight, error-feedback residuals.

        A partner whose difference was clipped hard is not forgiven but gets a strike instead
        (``clip_strikes`` in a row ban it); any other committed exchange clears its strikes.
        """
        commit(local.tensors, mixed)
        local.weight = self._weight = mixed.weight
        if self._ef is not None:
            self._ef.commit_all()
        clip = mixed.clip
        # no blame before we know our own usual norm (a first, tiny warm-up update looks like a victim)
        suspect = clip is not None and clip.hard and bool(self._own_norms)
        if clip is not None:
            self._own_norms.append(clip.own_norm)
        if clip is not None and clip.clipped:
            self._metrics.count("clipped")
        if suspect:
            self._metrics.count("suspect")
            reason = f"its update was {clip.excess:.3g}x our clip radius (clipped to {clip.scale:.3g})"
            self._bans.suspect(partner, reason, self._clip_strikes)
        else:
            self._bans.forgive(partner)
        self._last_partner = partner
        self._metrics.record_ok(latency)

    def _result(
        self, outcome: SyncOutcome, partner: str | None, channel: Channel | None, latency: float, reason: str
    ) -> SyncResult:
        sent = channel.bytes_sent if channel is not None else 0
        received = channel.bytes_received if channel is not None else 0
        return SyncResult(outcome, partner, sent, received, latency, self._weight, reason)

    # ------------------------------------------------------------------ serving side

    async def _serve(
        self, stream_info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = stream_info.peer_id.to_base58()
        channel = self._channel(reader, writer)
        try:
            if self._swarm_key is not None:
                await self._authenticate(reader, writer, peer, initiator=False)
            await self._serve_exchange(peer, channel)
        except AuthError as exc:
            logger.warning("refused gossip initiator %s: %s", peer, exc)
        except (ProtocolError, ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            logger.info("handshake with initiator %s failed: %s: %s", peer, type(exc).__name__, exc)
        except Exception:
            logger.exception("serving an exchange with %s failed unexpectedly", peer)
        finally:
            channel.close()
            self._metrics.add_bytes(channel.bytes_sent, channel.bytes_received)

    async def _serve_exchange(self, peer: str, channel: Channel) -> None:
        _, payload = await channel.recv_expect(MsgKind.HELLO)
        theirs = Hello.from_json(parse_json(payload))
        if self._bans.is_banned(peer):
            await channel.send_json(MsgKind.REJECT, {"reason": BANNED_REASON})
            return
        if self._aborted:
            await channel.send_json(MsgKind.BUSY, {"reason": "shutting down"})
            return
        if not self._lock.acquire(blocking=False):
            await channel.send_json(MsgKind.BUSY, {"reason": "in another exchange"})
            return
        self._serving = asyncio.current_task()
        try:
            local = self._local
            if local is None:
                await channel.send_json(MsgKind.BUSY, {"reason": "no tensors registered yet"})
                return
            ours = self._hello(local)
            mismatch = ours.mismatch(theirs)
            if mismatch is not None:
                await channel.send_json(MsgKind.REJECT, {"reason": mismatch})
                return
            await channel.send_json(MsgKind.ACCEPT, ours.to_json())
            result = await self._exchange(peer, channel, local, theirs.weight)
            logger.debug("served exchange with %s: %s %s", peer, result.outcome.value, result.reason)
        finally:
            self._serving = None
            self._lock.release()

    # ------------------------------------------------------------------ initiating side

    async def _initiate_abortable(self, local: _Local, candidates: Sequence[PartnerInfo]) -> SyncResult:
        """:meth:`_initiate` as a task that :meth:`abort` can cancel; a cancelled one returns CANCELLED."""
        cancelled = self._result(SyncOutcome.CANCELLED, None, None, 0.0, "aborted: shutting down")
        if self._aborted:
            return cancelled
        self._inflight = asyncio.ensure_future(self._initiate(local, candidates))
        try:
            return await self._inflight
        except asyncio.CancelledError:
            if not self._inflight.cancelled():
                raise  # we were cancelled ourselves (loop shutdown), not just the exchange
            self._metrics.count("failed")
            return cancelled
        finally:
            self._inflight = None

    async def _initiate(self, local: _Local, candidates: Sequence[PartnerInfo]) -> SyncResult:
        """Try random eligible partners until one accepts; that exchange's outcome is the result."""
        eligible = eligible_partners(
            candidates,
            self_id=self.peer_id,
            protocol_version=PROTOCOL_VERSION,
            config_hash=self.config_hash,
            bans=self._bans,
        )
        if len(eligible) > 1:
            # Never the same partner twice in a row when there is a choice: with back-to-back syncs
            # the two peers that just finished are the only idle ones, and would pair up forever.
            eligible = [info for info in eligible if info.peer_id != self._last_partner]
        if not eligible:
            self._metrics.count("no_partner")
            return self._result(SyncOutcome.NO_PARTNER, None, None, 0.0, "no eligible partner")
        channels: list[Channel] = []
        try:
            result = await self._try_partners(
                pick_order(eligible, self._rng, self._max_attempts), local, channels
            )
        finally:
            for channel in channels:
                channel.close()
            sent = sum(channel.bytes_sent for channel in channels)
            received = sum(channel.bytes_received for channel in channels)
            self._metrics.add_bytes(sent, received)
        return dataclasses.replace(result, bytes_sent=sent, bytes_received=received)

    async def _try_partners(
        self, order: Sequence[PartnerInfo], local: _Local, channels: list[Channel]
    ) -> SyncResult:
        deadline = time.monotonic() + self._exchange_timeout
        busy, reason = 0, ""
        for info in order:
            if time.monotonic() >= deadline:
                break
            attempt, answer = await self._open(info.peer_id, local, channels)
            if attempt is not None:
                return await self._exchange(attempt.partner, attempt.channel, local, attempt.weight)
            busy += answer is MsgKind.BUSY
            reason = f"{info.peer_id}: {answer.name if isinstance(answer, MsgKind) else answer}"
        outcome = SyncOutcome.BUSY if busy else SyncOutcome.FAILED
        return self._result(outcome, None, None, 0.0, reason)

    async def _open(
        self, partner: str, local: _Local, channels: list[Channel]
    ) -> tuple[_Attempt | None, MsgKind | str]:
        """Dial and handshake. Returns (attempt, ACCEPT) or (None, BUSY / REJECT / error text)."""
        try:
            async with asyncio.timeout(self._chunk_timeout):
                _, reader, writer = await self._p2p.call_binary_stream_handler(
                    PeerID.from_base58(partner), self._handler
                )
                channel = self._channel(reader, writer)
                channels.append(channel)
                if self._swarm_key is not None:
                    await self._authenticate(reader, writer, partner, initiator=True)
                await channel.send_json(MsgKind.HELLO, self._hello(local).to_json())
                kind, payload = await channel.recv_expect(MsgKind.ACCEPT, MsgKind.BUSY, MsgKind.REJECT)
                body = parse_json(payload)
                if kind is MsgKind.ACCEPT:
                    return self._accepted(partner, channel, local, body), kind
        except Exception as exc:
            self._bans.ban(partner, f"dial/handshake failed: {type(exc).__name__}: {exc}")
            self._metrics.count("failed")
            return None, f"{type(exc).__name__}: {exc}"
        channel.close()
        if kind is MsgKind.BUSY:
            self._metrics.count("busy")
        elif body.get("reason") == BANNED_REASON:
            # it banned us (perhaps for a failure on our side): no evidence against it, and banning it
            # back would keep the pair apart long after its ban on us expired
            self._metrics.count("failed")
        else:
            self._bans.ban(partner, f"refused the handshake: {body.get('reason')}")
            self._metrics.count("failed")
        return None, kind

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str, *, initiator: bool
    ) -> None:
        await authenticate_stream(
            reader,
            writer,
            key=self._swarm_key,
            initiator=initiator,
            protocol=self._handler,
            local_peer=self.peer_id,
            remote_peer=peer,
            timeout=self._chunk_timeout,
        )

    def _accepted(self, partner: str, channel: Channel, local: _Local, body: dict[str, object]) -> _Attempt:
        theirs = Hello.from_json(body)
        mismatch = self._hello(local).mismatch(theirs)
        if mismatch is not None:
            raise ProtocolError(f"accepted with an incompatible handshake: {mismatch}")
        return _Attempt(partner=partner, channel=channel, weight=theirs.weight)
