"""Counters of one peer's training, what it announces, and what it saves in checkpoints."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from swarm.gossip import ExchangeMetrics


@dataclass
class Progress:
    """Where this peer is. Everything here is plain values, so it checkpoints and announces as is.

    Losses are in ``loss_unit``, bits per token (bits per byte for byte-level data): ``loss`` the
    smoothed training loss, ``eval_loss`` the last held-out one; ``eval_bits_per_byte`` is the latter
    per byte of text (equal to it for byte-level data).
    """

    step: int = 0
    round: int = 0
    samples_total: int = 0
    samples_since_sync: int = 0
    samples_drawn: int = 0
    swarm_samples: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    eval_bits_per_byte: float | None = None
    loss_unit: str = "bits/byte"
    drift: float | None = None
    rollbacks: int = 0
    """Times the parameters went non-finite and were put back (TrainingPeer._roll_back)."""
    compute_seconds: float = 0.0
    device_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)
    _rate: float = 0.0

    def record_step(
        self, samples: int, loss: float, seconds: float, compute_seconds: float, device_seconds: float = 0.0
    ) -> None:
        """Count one inner step; loss and samples/s are smoothed so the record does not jitter.

        ``compute_seconds``: real forward/backward/update time; ``device_seconds``: how long the
        (possibly emulated, ``emulation.step_time_s``) device was busy, at least the compute.
        """
        self.step += 1
        self.samples_total += samples
        self.samples_since_sync += samples
        self.compute_seconds += compute_seconds
        self.device_seconds += max(device_seconds, compute_seconds)
        self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
        rate = samples / max(seconds, 1e-9)
        self._rate = rate if self._rate == 0.0 else 0.9 * self._rate + 0.1 * rate

    @property
    def samples_per_s(self) -> float:
        return self._rate

    def utilization(self) -> float:
        """Share of wall time the device was busy (forward, backward, optimizer) since start."""
        return self.device_seconds / max(time.monotonic() - self.started, 1e-9)

    def record_fields(self, state: str, metrics: ExchangeMetrics) -> dict[str, Any]:
        """The membership record's fields that describe this progress, the peer's ``state`` and its
        exchange ``metrics``; losses outside what records accept are reported as unknown."""
        return {
            "state": state,
            "step": self.step,
            "round": self.round,
            "samples_total": self.samples_total,
            "samples_per_s": float(self.samples_per_s),
            "loss": _bounded(self.loss),
            "eval_loss": _bounded(self.eval_loss),
            "eval_bits_per_byte": _bounded(self.eval_bits_per_byte),
            "loss_unit": self.loss_unit,
            "drift": _bounded(self.drift),
            "rollbacks": self.rollbacks,
            "bytes_sent": metrics.bytes_sent,
            "bytes_received": metrics.bytes_received,
            "exchanges_ok": metrics.exchanges_ok,
            "exchanges_failed": metrics.exchanges_failed,
            "exchanges_rejected": metrics.exchanges_rejected,
            "state_hash": "",
        }

    def checkpoint_state(self) -> dict[str, Any]:
        volatile = ("started", "_rate", "compute_seconds", "device_seconds", "loss_unit")
        return {k: v for k, v in asdict(self).items() if k not in volatile}

    def restore(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key in self.checkpoint_state():
                setattr(self, key, value)


def _bounded(value: float | None) -> float | None:
    """Records accept finite losses in [0, 1e6]; anything else is reported as unknown."""
    if value is None or not (0.0 <= value <= 1e6):
        return None
    return float(value)
