"""SyncReport: what one round of a trainer did, for its one-line-per-sync output and its history."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import cast

from swarm.gossip import ExchangeMetrics
from swarm.trainer._backend import RoundOutcome, RoundResult, RoundRole
from swarm.trainer._live import Update
from swarm.trainer._progress import Progress


@dataclass(frozen=True)
class SyncReport:
    """What one round did, for the trainer's one-line-per-sync output and its history."""

    round: int
    step: int
    loss: float | None
    eval_loss: float | None
    samples_per_s: float
    outcome: RoundOutcome
    partner: str | None
    bytes_sent: int
    bytes_received: int
    drift: float | None
    lr: float
    weight: float
    role: RoundRole = "initiator"
    loss_unit: str = "bits/byte"
    """The unit of ``loss`` and ``eval_loss``: bits per token, or per byte for byte-level data."""
    eval_bits_per_byte: float | None = None
    tokens_per_s: float | None = None
    """Tokens per second of compute (smoothed); with ``mfu`` (None: unknown peak) and the device's
    ``peak_memory_bytes`` (None off CUDA)."""
    mfu: float | None = None
    peak_memory_bytes: int | None = None

    @classmethod
    def of(cls, progress: Progress, result: RoundResult, lr: float) -> SyncReport:
        """The report of ``result``, booked into ``progress`` just before."""
        p = progress
        return cls(
            round=p.round,
            step=p.step,
            loss=p.loss,
            eval_loss=p.eval_loss,
            samples_per_s=p.samples_per_s,
            outcome=result.outcome,
            partner=result.partner,
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            drift=p.drift,
            lr=lr,
            weight=result.weight,
            role=result.role,
            loss_unit=p.loss_unit,
            eval_bits_per_byte=p.eval_bits_per_byte,
        )


def round_of(update: Update) -> RoundResult:
    """The round an applied update completes; its info (``_offers._info``, ``_own_round``) holds a
    :class:`~swarm.gossip.SyncOutcome` value or ``solo``, and a role."""
    info = update.info
    return RoundResult(
        cast(RoundOutcome, str(info.get("outcome", "ok"))),
        partner=info.get("partner"),
        bytes_sent=int(info.get("bytes_sent", 0)),
        bytes_received=int(info.get("bytes_received", 0)),
        weight=float(info.get("weight", 0.0)),
        role=cast(RoundRole, str(info.get("role", "initiator"))),
    )


def add_metrics(parts: list[ExchangeMetrics]) -> ExchangeMetrics:
    """Counters added up; latencies are the first part's."""
    counters = {
        f.name: sum(getattr(p, f.name) for p in parts)
        for f in dataclasses.fields(ExchangeMetrics)
        if not f.name.endswith("latency_s")
    }
    return dataclasses.replace(parts[0], **counters)
