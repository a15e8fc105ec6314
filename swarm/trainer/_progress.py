"""Counters of one peer's training, what it announces, and what it saves in checkpoints."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Progress:
    """Where this peer is. Everything here is plain numbers, so it checkpoints and announces as is."""

    step: int = 0
    round: int = 0
    samples_total: int = 0
    samples_since_sync: int = 0
    samples_drawn: int = 0
    swarm_samples: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    drift: float | None = None
    compute_seconds: float = 0.0
    device_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)
    _rate: float = 0.0

    def record_step(
        self, samples: int, loss: float, seconds: float, compute_seconds: float, device_seconds: float = 0.0
    ) -> None:
        """Count one inner step; loss and samples/s are smoothed so the record does not jitter.

        ``compute_seconds``: real forward/backward/update time; ``device_seconds``: how long the
        (possibly emulated, ``train.step_time_s``) device was busy, at least the compute.
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

    def checkpoint_state(self) -> dict[str, Any]:
        volatile = ("started", "_rate", "compute_seconds", "device_seconds")
        return {k: v for k, v in asdict(self).items() if k not in volatile}

    def restore(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            if key in self.checkpoint_state():
                setattr(self, key, value)
