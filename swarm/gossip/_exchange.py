"""The data phase of one exchange, identical for both sides: stream, validate, mix, ACK.

Mixing rule (mass-conserving quantized push-sum, see docs/gossip.md). A side holds ``x`` with
weight ``w``; it sends ``q`` (what its frames decode to: ``x`` plus quantization error, with error
feedback) and receives the partner's ``p`` with weight ``v``. Both sides take the weight
``(w + v) / 2`` and the side computes::

    x' = (w * (2x - q) + v * p) / (w + v)

With a lossless codec (``q = x``) this is the weighted pairwise mean. With a lossy one the two
sides' ``weight * tensor`` still add up to exactly what they were before (``w*x + v*y``), because
each side subtracts its own quantized value ``q`` exactly as the partner adds it: quantization
adds noise to the individual peers but never moves the swarm's weighted mean.

With a :class:`~swarm.gossip._robust.ClipPolicy` in the spec the partner's difference is clipped
first; weights stay, and the pair's mass is still conserved exactly.

Memory: nothing here holds a whole model's decoded tensors (:mod:`swarm.gossip._mixing`). Our frames
are encoded from our tensors one tensor at a time as they are sent, and again whenever their decoded
values are needed; the partner's payloads are kept in the agreed codec, no more of them than the
schema needs in it (:class:`~swarm.compression.FrameStore`, :func:`receive_limits`); the result is a
:class:`~swarm.gossip._mixing.MixedTensors` that computes each tensor when read. Our tensors may
therefore be computed too (a :class:`~swarm.compression.LazyTensors` over the live anchor): an
exchange whose ``turn`` went stale (another exchange committed, so what they are computed from may be
changing) stops sending at once and ends as not committed, blaming nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarm._errors import SwarmError
from swarm.compression import (
    DecodeLimits,
    ErrorFeedback,
    FrameError,
    FrameStore,
    LazyTensors,
    Schema,
    encode_tensors,
    schema_of,
)
from swarm.gossip._bases import MAX_BASE_ERROR, absolute, relative
from swarm.gossip._deadlines import Sending, SlowPartner, rate_floor
from swarm.gossip._gate import NOT_COMMITTED_REASON, Turn
from swarm.gossip._metrics import SyncOutcome
from swarm.gossip._mixing import Mixed, MixedTensors, measure, pair_norms, sent_values
from swarm.gossip._protocol import Channel, MsgKind, ProtocolError, parse_json
from swarm.gossip._robust import NO_BLAME, Blame, ClipPolicy, clip_stats
from swarm.gossip._validation import NormPolicy, TensorNorms, ValidationError, check_norms
from swarm.p2p import PEER_FAULTS

T = TypeVar("T")
logger = logging.getLogger(__name__)


class PartnerRejected(SwarmError):
    """The partner answered NACK: it refused our data (or our part of the exchange)."""


class NotCommitted(SwarmError):
    """The exchange went through, but one side's gate refused to commit it (another exchange committed
    first, :mod:`swarm.gossip._gate`): neither side commits, and neither is to blame."""


class BaseTooFar(NotCommitted):
    """Our values did not come through the shared base faithfully (:data:`MAX_BASE_ERROR`): it is far
    from our model (as after a healed partition). Nobody is blamed; the base is dropped."""


@dataclass(frozen=True)
class ExchangeSpec:
    """Everything about an exchange that is fixed for the averager's lifetime."""

    codec: Any
    chunk_bytes: int
    policy: NormPolicy
    clip: ClipPolicy | None = None
    min_rate_bytes_s: float = 0.0
    """The rate floor of the data phase, each way (0: none), over ``rate_window_s`` seconds
    (:func:`swarm.gossip._deadlines.rate_floor`)."""
    rate_window_s: float = 10.0


@dataclass(frozen=True)
class _Part:
    """Our side of an exchange in its data phase: what we send, how, and what our frames decode to.

    ``base``: the shared base of the pair (:mod:`swarm.gossip._bases`): our frames carry ``local -
    base`` (``wire``), the partner's are read with the base added back, and ``sent`` is what the
    partner then holds of ours, base included."""

    local: Mapping[str, torch.Tensor]
    spec: ExchangeSpec
    error_feedback: ErrorFeedback | None
    schema: Schema
    sent: Mapping[str, torch.Tensor]
    wire: Mapping[str, torch.Tensor]
    base: Mapping[str, torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        local: Mapping[str, torch.Tensor],
        spec: ExchangeSpec,
        error_feedback: ErrorFeedback | None,
        base: Mapping[str, torch.Tensor] | None = None,
    ) -> _Part:
        schema = schema_of(local)
        if base is None:
            return cls(
                local, spec, error_feedback, schema, sent_values(local, spec.codec, error_feedback), local
            )
        wire = relative(local, base, schema)
        sent = absolute(sent_values(wire, spec.codec, error_feedback), base, schema)
        return cls(local, spec, error_feedback, schema, sent, wire, base)

    def theirs(self, received: FrameStore) -> Mapping[str, torch.Tensor]:
        """The partner's tensors as we hold them: its frames decoded, plus the base if there is one."""
        decoded = LazyTensors(self.schema, received.tensor)
        return decoded if self.base is None else absolute(decoded, self.base, self.schema)

    def measure(self, received: FrameStore) -> dict[str, TensorNorms]:
        """Every tensor's norms, checked (ValidationError): what the partner sent is finite and
        plausible, and through a base, our own values came through it faithfully."""
        norms = measure(self.local, self.sent, self.theirs(received))
        if self.base is not None:  # first: a bad base makes the partner's values look bad too
            _check_base_error(norms)
        check_norms(norms, self.spec.policy)
        return norms


def _check_base_error(norms: Mapping[str, TensorNorms]) -> None:
    """ValidationError if our values through the base lost more than ``MAX_BASE_ERROR`` of their norm:
    the base is far from our model (a partner pushed one that is not its anchor)."""
    error = math.sqrt(sum(n.own_error**2 for n in norms.values()))
    scale = math.sqrt(sum(n.local**2 for n in norms.values()))
    if error > MAX_BASE_ERROR * max(scale, 1e-12):
        raise BaseTooFar(
            f"the shared base is far from our model: our values through it are off by {error:.4g} "
            f"(norm {scale:.4g})"
        )


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run CPU work in a worker thread; if cancelled, still wait for it so no work outlives us."""
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        with contextlib.suppress(BaseException):
            await future
        raise


async def run_exchange(
    channel: Channel,
    local: Mapping[str, torch.Tensor],
    weights: tuple[float, float],
    spec: ExchangeSpec,
    error_feedback: ErrorFeedback | None,
    blame: Blame = NO_BLAME,
    turn: Turn | None = None,
    base: Mapping[str, torch.Tensor] | None = None,
) -> Mixed:
    """Send ours and receive theirs concurrently, validate, mix, then swap ACKs.

    ``blame`` (robust mixing only): the norms the partner's difference is judged against.
    ``turn``: reserved before our ACK (:mod:`swarm.gossip._gate`); the caller releases it.
    ``base``: the pair's shared base, which our tensors are sent relative to (:mod:`swarm.gossip._bases`).

    Returns only when both sides have ACKed; raises ValidationError (we rejected their data, NACK
    already sent), PartnerRejected, NotCommitted, ProtocolError, or a connection/timeout error.
    """
    part = _Part.of(local, spec, error_feedback, base)
    negligible = is_donation(*weights)
    sending = Sending()
    sender = asyncio.create_task(_send(channel, part, sending, turn))
    try:
        receiver = asyncio.create_task(_receive_all(channel, part.schema, spec, keep=not negligible))
        floor = (spec.min_rate_bytes_s, spec.rate_window_s)
        received = await rate_floor(channel, sender, receiver, *floor, sending)
        norms = await in_thread(part.measure, received) if received.keep else {}
        _check_turn(turn)  # what the checks read did not change under them
    except ValidationError as exc:
        await _cancel(sender)
        if turn is not None and turn.stale():  # our tensors changed under the checks: no verdict
            await _refuse(channel, "our offer changed during the exchange")
            raise NotCommitted("our offer changed during the exchange") from exc
        with contextlib.suppress(Exception):
            await channel.send_json(MsgKind.NACK, {"reason": str(exc)[:500]})
        raise
    except NotCommitted as exc:
        await _cancel(sender)
        await _refuse(channel, str(exc))
        raise
    except BaseException:
        await _cancel(sender)
        raise
    if negligible:  # a joiner taking over our tensors: it moves us by at most NEGLIGIBLE_SHARE
        mixed = Mixed(MixedTensors.identity(local), weights[0])
    else:
        mixed = _mix(part, received, norms, weights, blame)
    refusal = turn.reserve() if turn is not None else None
    if refusal is not None:
        await _refuse(channel, refusal)
        raise NotCommitted(refusal)
    await channel.send(MsgKind.ACK)
    kind, payload = await channel.recv_expect(MsgKind.ACK, MsgKind.NACK)
    if kind is MsgKind.NACK:
        raise _nack_error(payload)
    return mixed


NEGLIGIBLE_SHARE = 1e-6
"""A partner whose share of the pair's weight is at most this (a joiner taking over our tensors at a
weight of about 1e-9) would move us by at most that share of our difference: its frames are checked
and dropped as they arrive, and the exchange leaves us unchanged."""


def is_donation(own_weight: float, partner_weight: float) -> bool:
    """Whether an exchange only hands our tensors to the partner: its share of the pair's weight is at
    most ``NEGLIGIBLE_SHARE`` (a joiner's, ``swarm.trainer``'s ``JOIN_WEIGHT``). Its mix would move us
    by at most that share, so we commit nothing of it; the partner keeps what it received."""
    return partner_weight <= NEGLIGIBLE_SHARE * (own_weight + partner_weight)


def _check_turn(turn: Turn | None) -> None:
    if turn is not None and turn.stale():
        raise NotCommitted("another exchange committed while this one ran")


async def _refuse(channel: Channel, why: str) -> None:
    """NACK as not committed: the partner neither commits nor blames us."""
    with contextlib.suppress(Exception):
        await channel.send_json(MsgKind.NACK, {"reason": f"{NOT_COMMITTED_REASON} ({why})"})


def _nack_error(payload: bytes) -> Exception:
    """What a partner's NACK means: it did not commit (no one to blame), or it refused our data."""
    reason = str(parse_json(payload).get("reason", "no reason given"))
    if reason.startswith(NOT_COMMITTED_REASON):
        return NotCommitted(f"the partner: {reason}")
    return PartnerRejected(reason)


@dataclass(frozen=True)
class Settled:
    """How an exchange ended: OK with its ``mixed`` result, or the outcome, the reason, and whether the
    partner is to blame (it is not for a failure on our side, e.g. NaN in our own tensors).

    ``bad_data``: the partner sent something no honest peer sends (invalid tensors, a broken protocol):
    banned at once, whether or not it has a record or says it is leaving. Other failures (a stream
    cut, a deadline, the rate floor) may be a partner leaving, and wait for its record.
    """

    outcome: SyncOutcome
    reason: str = ""
    mixed: Mixed | None = None
    blame_partner: bool = True
    bad_data: bool = False
    bad_base: bool = False
    """The shared base is far from our model (:class:`BaseTooFar`): not to be used again."""


async def settle(exchange: Awaitable[Mixed], timeout: float, partner: str) -> Settled:
    """Await :func:`run_exchange` within ``timeout`` seconds and classify how it ended.

    Cancellation (``abort()``, shutdown) propagates: the caller discards what is pending.
    """
    try:
        async with asyncio.timeout(timeout):
            return Settled(SyncOutcome.OK, mixed=await exchange)
    except ValidationError as exc:
        return Settled(SyncOutcome.REJECTED, f"rejected its data: {exc}", bad_data=True)
    except SlowPartner as exc:
        return Settled(SyncOutcome.TIMEOUT, f"dropped a slow partner: {exc}")
    except ProtocolError as exc:
        return Settled(SyncOutcome.FAILED, f"broke the protocol: {exc}", bad_data=True)
    except TimeoutError as exc:  # the exchange's deadline, or a stall (swarm.p2p.StalledError)
        return Settled(
            SyncOutcome.TIMEOUT, f"exchange timed out: {exc}" if str(exc) else "exchange timed out"
        )
    except BaseTooFar as exc:
        return Settled(SyncOutcome.FAILED, f"not committed: {exc}", blame_partner=False, bad_base=True)
    except NotCommitted as exc:
        return Settled(SyncOutcome.FAILED, f"not committed: {exc}", blame_partner=False)
    except PartnerRejected as exc:
        return Settled(SyncOutcome.FAILED, f"it rejected our data: {exc}")
    except PEER_FAULTS as exc:
        return Settled(SyncOutcome.FAILED, f"{type(exc).__name__}: {exc}")
    except Exception as exc:
        logger.exception("exchange with %s failed on our side", partner)
        return Settled(SyncOutcome.FAILED, f"local error: {exc}", blame_partner=False)


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def _send(channel: Channel, part: _Part, sending: Sending, turn: Turn | None) -> None:
    """Our frames and END; a stale ``turn`` stops us (NotCommitted) before the next frame goes out, so
    nothing computed while our tensors changed is ever sent."""
    spec = part.spec
    frames = iter(
        encode_tensors(
            part.wire, spec.codec, spec.chunk_bytes, error_feedback=part.error_feedback, keep_residuals=False
        )
    )
    count = 0
    while (frame := await in_thread(next, frames, None)) is not None:
        _check_turn(turn)
        sending.writing = True
        try:
            await channel.send(MsgKind.DATA, frame)
        finally:
            sending.writing = False
        count += 1
    await channel.send_json(MsgKind.END, {"frames": count})


MIN_CHUNK_BYTES = 4096
"""The smallest ``chunk_bytes`` an honest partner cuts its frames to (``GossipOptions`` refuses less)."""


def receive_limits(spec: ExchangeSpec) -> DecodeLimits:
    """What the partner's frames may cost us: at most as many per tensor as chunks of
    ``MIN_CHUNK_BYTES`` (or our own smaller ``chunk_bytes``) need, in the agreed codec."""
    return DecodeLimits(min_chunk_bytes=min(spec.chunk_bytes, MIN_CHUNK_BYTES))


async def _receive_all(channel: Channel, schema: Schema, spec: ExchangeSpec, keep: bool = True) -> FrameStore:
    """Keep DATA frames (``keep``; else only check them), each checked against ``schema`` and the
    agreed codec as it arrives, until END; FrameError becomes ValidationError (bad data: a frame in
    another codec, or more frames than the schema needs, bans the sender like a NaN does); a NACK
    ends it as the partner's refusal (or not committed, :func:`_nack_error`)."""
    store = FrameStore(expected=schema, limits=receive_limits(spec), codec=spec.codec, keep=keep)
    count = 0
    try:
        while True:
            kind, payload = await channel.recv_expect(MsgKind.DATA, MsgKind.END, MsgKind.NACK)
            if kind is MsgKind.NACK:
                raise _nack_error(payload)
            if kind is MsgKind.END:
                break
            await in_thread(store.feed, payload)
            count += 1
        announced = parse_json(payload).get("frames")
        if announced != count:
            raise ProtocolError(f"END announced {announced} frames, received {count}")
        store.complete()
        return store
    except FrameError as exc:
        raise ValidationError(f"bad frame: {exc}") from exc


def _mix(
    part: _Part,
    received: FrameStore,
    norms: dict[str, TensorNorms],
    weights: tuple[float, float],
    blame: Blame,
) -> Mixed:
    """The result of one part: the plain rule, or the robust clip's from the measured norms."""
    theirs = part.theirs(received)
    feedback = part.error_feedback
    spec = part.spec
    if spec.clip is None:
        tensors = MixedTensors(part.local, part.sent, theirs, weights, feedback=feedback, norms=norms)
        return Mixed(tensors, sum(weights) / 2)
    stats = clip_stats(pair_norms(norms), spec.clip, blame.reference, weights, blame.own)
    tensors = MixedTensors(
        part.local, part.sent, theirs, weights, clip=stats.scale, feedback=feedback, norms=norms
    )
    return Mixed(tensors, weights[0], clip=stats)


def as_named(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Check an offer's tensors: dense floating-point tensors by name. A
    :class:`~swarm.compression.LazyTensors` is taken as it is (its tensors are computed when read)."""
    if isinstance(tensors, LazyTensors):
        return tensors
    if not isinstance(tensors, Mapping):
        kind = type(tensors).__name__
        raise TypeError(f"an offer's tensors must be a mapping of names to tensors, got {kind}")
    named = dict(tensors)
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.is_sparse or not t.is_floating_point():
            raise TypeError(f"tensor {name!r} must be a dense floating-point torch.Tensor")
    return named
