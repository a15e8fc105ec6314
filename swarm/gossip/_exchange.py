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

With a :class:`~swarm.gossip._robust.ClipPolicy` in the spec the robust rule of
``swarm.gossip._robust`` replaces it: the partner's difference is clipped, weights stay, and the
pair's mass is still conserved exactly.

A companion part (:class:`Companion`: the trainer's anchor beside its pseudo-gradient) travels on the
same stream right after the first part, and is validated and mixed by the same rules with its own
weights, codec and clip; the one ACK each way covers both parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from swarm._errors import SwarmError
from swarm.compression import ErrorFeedback, FrameError, TensorStreamDecoder, encode_tensors
from swarm.gossip._deadlines import Sending, SlowPartner, rate_floor
from swarm.gossip._gate import NOT_COMMITTED_REASON, Turn
from swarm.gossip._metrics import SyncOutcome
from swarm.gossip._protocol import Channel, MsgKind, ProtocolError, parse_json
from swarm.gossip._robust import NO_BLAME, Blame, ClipPolicy, ClipStats, robust_mix
from swarm.gossip._validation import NormPolicy, Schema, ValidationError, validate_received
from swarm.p2p import PEER_FAULTS

T = TypeVar("T")
logger = logging.getLogger(__name__)
NamedTensors = list[tuple[str, torch.Tensor]]


class PartnerRejected(SwarmError):
    """The partner answered NACK: it refused our data (or our part of the exchange)."""


class NotCommitted(SwarmError):
    """The exchange went through, but one side's gate refused to commit it (another exchange committed
    first, :mod:`swarm.gossip._gate`): neither side commits, and neither is to blame."""


@dataclass(frozen=True)
class ExchangeSpec:
    """Everything about an exchange that is fixed for the averager's lifetime."""

    codec: Any
    chunk_bytes: int
    policy: NormPolicy
    clip: ClipPolicy | None = None
    min_rate_bytes_s: float = 0.0
    """The rate floor of the data phase, each way (0: none): :func:`swarm.gossip._deadlines.rate_floor`."""
    rate_window_s: float = 10.0
    """The window over which the floor is measured."""


@dataclass(frozen=True)
class Mixed:
    """The validated, mixed result, ready to be committed; ``clip`` is set when robust mixing ran;
    ``companion``: the companion part's own result, when the exchange had one."""

    tensors: dict[str, torch.Tensor]
    weight: float
    clip: ClipStats | None = None
    companion: Mixed | None = None


@dataclass(frozen=True)
class Companion:
    """The second part of an exchange: our tensors, (our weight, the partner's), and its own spec
    (codec, clip). It never uses error feedback, and the robust clip blames it on its own norm."""

    tensors: Mapping[str, torch.Tensor]
    weights: tuple[float, float]
    spec: ExchangeSpec


@dataclass(frozen=True)
class _Part:
    """One part of an exchange in its data phase: what we send, how, and our own frames' decoder."""

    local: Mapping[str, torch.Tensor]
    spec: ExchangeSpec
    error_feedback: ErrorFeedback | None
    schema: Schema
    own: TensorStreamDecoder | None

    @classmethod
    def of(
        cls, local: Mapping[str, torch.Tensor], spec: ExchangeSpec, error_feedback: ErrorFeedback | None
    ) -> _Part:
        schema: Schema = {name: (tuple(t.shape), t.dtype) for name, t in local.items()}
        own = None if spec.codec.lossless else TensorStreamDecoder(expected=schema)
        return cls(local, spec, error_feedback, schema, own)

    async def sent(self) -> Mapping[str, torch.Tensor]:
        return dict(self.local) if self.own is None else await in_thread(_own_values, self.own)


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
    companion: Companion | None = None,
    turn: Turn | None = None,
) -> Mixed:
    """Send ours and receive theirs concurrently, validate, mix, then swap ACKs.

    ``blame`` (robust mixing only): the norms the partner's difference is judged against.
    ``companion``: a second part, sent and received after the first on the same stream.
    ``turn``: reserved before our ACK (:mod:`swarm.gossip._gate`); the caller releases it.

    Returns only when both sides have ACKed; raises ValidationError (we rejected their data, NACK
    already sent), PartnerRejected, NotCommitted, ProtocolError, or a connection/timeout error.
    """
    parts = [_Part.of(local, spec, error_feedback)]
    if companion is not None:
        parts.append(_Part.of(companion.tensors, companion.spec, None))
    sending = Sending()
    sender = asyncio.create_task(_send_parts(channel, parts, sending))
    try:
        receiver = asyncio.create_task(_receive_parts(channel, parts))
        floor = (spec.min_rate_bytes_s, spec.rate_window_s)
        received = await rate_floor(channel, sender, receiver, *floor, sending)
        sent = [await part.sent() for part in parts]
        for part, theirs in zip(parts, received, strict=True):
            await in_thread(validate_received, theirs, part.local, part.spec.policy)
    except ValidationError as exc:
        await _cancel(sender)
        with contextlib.suppress(Exception):
            await channel.send_json(MsgKind.NACK, {"reason": str(exc)[:500]})
        raise
    except BaseException:
        await _cancel(sender)
        raise
    mixed = await in_thread(_mix, spec, local, sent[0], weights, received[0], blame)
    if companion is not None:
        other = await in_thread(
            _mix, companion.spec, companion.tensors, sent[1], companion.weights, received[1], NO_BLAME
        )
        mixed = dataclasses.replace(mixed, companion=other)
    refusal = turn.reserve() if turn is not None else None
    if refusal is not None:
        with contextlib.suppress(Exception):
            await channel.send_json(MsgKind.NACK, {"reason": f"{NOT_COMMITTED_REASON} ({refusal})"})
        raise NotCommitted(refusal)
    await channel.send(MsgKind.ACK)
    kind, payload = await channel.recv_expect(MsgKind.ACK, MsgKind.NACK)
    if kind is MsgKind.NACK:
        reason = str(parse_json(payload).get("reason", "no reason given"))
        if reason.startswith(NOT_COMMITTED_REASON):
            raise NotCommitted(f"the partner: {reason}")
        raise PartnerRejected(reason)
    return mixed


async def _receive_parts(channel: Channel, parts: Sequence[_Part]) -> list[dict[str, torch.Tensor]]:
    return [await _receive_all(channel, part.schema) for part in parts]


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


def _own_values(own: TensorStreamDecoder) -> dict[str, torch.Tensor]:
    try:
        return own.finish()
    except FrameError as exc:  # a bug of ours: our own encoder's frames disagree with our schema
        raise ProtocolError(f"our own frames do not decode to our schema: {exc}") from exc


def _next_frame(frames: Iterator[bytes], own: TensorStreamDecoder | None) -> bytes | None:
    """The next frame to send; also decoded into ``own``, so we know exactly what the partner gets."""
    frame = next(frames, None)
    if frame is not None and own is not None:
        with contextlib.suppress(FrameError):  # surfaces again, as ProtocolError, in _own_values
            own.feed(frame)
    return frame


async def _send_parts(channel: Channel, parts: Sequence[_Part], sending: Sending) -> None:
    """Each part's frames and END, one part after the other."""
    for part in parts:
        await _send_all(channel, list(part.local.items()), part.spec, part.error_feedback, part.own, sending)


async def _send_all(
    channel: Channel,
    named: NamedTensors,
    spec: ExchangeSpec,
    error_feedback: ErrorFeedback | None,
    own: TensorStreamDecoder | None,
    sending: Sending,
) -> None:
    frames = encode_tensors(named, spec.codec, chunk_bytes=spec.chunk_bytes, error_feedback=error_feedback)
    count = 0
    while (frame := await in_thread(_next_frame, frames, own)) is not None:
        sending.writing = True
        try:
            await channel.send(MsgKind.DATA, frame)
        finally:
            sending.writing = False
        count += 1
    await channel.send_json(MsgKind.END, {"frames": count})


async def _receive_all(channel: Channel, schema: Schema) -> dict[str, torch.Tensor]:
    """Feed DATA frames to a schema-checking decoder until END; FrameError becomes ValidationError."""
    decoder = TensorStreamDecoder(expected=schema)
    count = 0
    try:
        while True:
            kind, payload = await channel.recv_expect(MsgKind.DATA, MsgKind.END, MsgKind.NACK)
            if kind is MsgKind.NACK:
                raise PartnerRejected(str(parse_json(payload).get("reason", "no reason given")))
            if kind is MsgKind.END:
                break
            await in_thread(decoder.feed, payload)
            count += 1
        announced = parse_json(payload).get("frames")
        if announced != count:
            raise ProtocolError(f"END announced {announced} frames, received {count}")
        return await in_thread(decoder.finish)
    except FrameError as exc:
        raise ValidationError(f"bad frame: {exc}") from exc


def _mix(
    spec: ExchangeSpec,
    local: Mapping[str, torch.Tensor],
    sent: Mapping[str, torch.Tensor],
    weights: tuple[float, float],
    received: Mapping[str, torch.Tensor],
    blame: Blame,
) -> Mixed:
    if spec.clip is None:
        return mix(local, sent, weights[0], received, weights[1])
    tensors, stats = robust_mix(
        local, sent, weights[0], received, weights[1], spec.clip, blame.reference, blame.own
    )
    return Mixed(tensors=tensors, weight=weights[0], clip=stats)


def mix(
    local: Mapping[str, torch.Tensor],
    sent: Mapping[str, torch.Tensor],
    local_weight: float,
    remote: Mapping[str, torch.Tensor],
    remote_weight: float,
) -> Mixed:
    """``x' = (w * (2x - q) + v * p) / (w + v)`` in float32 (no float64: MPS has none), rounded once to
    the local dtype."""
    total = local_weight + remote_weight
    out = {}
    for name, mine in local.items():
        x = mine.detach().to(torch.float32, copy=True)
        if sent[name] is not mine:  # lossy codec: x + (x - q) keeps the pair's mass exact
            x.mul_(2.0).sub_(sent[name].to(device=mine.device, dtype=torch.float32))
        p = remote[name].to(device=mine.device, dtype=torch.float32)
        mixed = x.mul_(local_weight / total).add_(p, alpha=remote_weight / total)
        out[name] = mixed.to(mine.dtype)
    return Mixed(tensors=out, weight=total / 2)


def commit(local: Mapping[str, torch.Tensor], mixed: Mixed) -> None:
    """Write the mixed values into the caller's tensors, in place."""
    with torch.no_grad():
        for name, tensor in local.items():
            tensor.copy_(mixed.tensors[name])


def as_named(tensors: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept a mapping or a plain sequence (named "0", "1", ...); reject non-dense or duplicate input."""
    named = dict(tensors) if isinstance(tensors, Mapping) else {str(i): t for i, t in enumerate(tensors)}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.is_sparse or not t.is_floating_point():
            raise TypeError(f"tensor {name!r} must be a dense floating-point torch.Tensor")
    return named
