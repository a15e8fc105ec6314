"""SyncReport: what one round of a trainer did, for its one-line-per-sync output and its history."""

from __future__ import annotations

from dataclasses import dataclass

from swarm.trainer._backend import RoundOutcome, RoundResult, RoundRole
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
