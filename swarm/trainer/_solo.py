"""``averaging.backend: none``: DiLoCo on one peer, outer steps on its own pseudo-gradient only.

The reference a swarm is measured against: the same model, data, inner and outer optimizers, with
no network traffic at all.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from swarm.config import AveragingSection
from swarm.gossip import ExchangeMetrics
from swarm.learning import OuterOptimizer
from swarm.trainer._backend import BackendContext, JoinResult, NoGuard, RoundResult, outer_state_device


class RoundClock:
    """When a round is due: every ``sync_every_steps`` inner steps, or ``sync_every_seconds``."""

    def __init__(self, averaging: AveragingSection) -> None:
        self._every_steps = averaging.sync_every_steps
        self._every_seconds = averaging.sync_every_seconds
        self.steps = 0
        self._started = time.monotonic()

    def tick(self) -> None:
        self.steps += 1

    def due(self) -> bool:
        if self.steps >= self._every_steps:
            return True
        return self._every_seconds is not None and time.monotonic() - self._started >= self._every_seconds

    def restart(self, steps_already: int = 0) -> None:
        """A new round starts now, with ``steps_already`` steps of it taken."""
        self.steps, self._started = steps_already, time.monotonic()


class SoloBackend(NoGuard):
    """Outer Nesterov steps on this peer's own pseudo-gradient every round; no network."""

    def __init__(self, context: BackendContext) -> None:
        self.outer = OuterOptimizer.from_config(
            context.model, context.config.averaging, state_device=outer_state_device(context)
        )
        self._clock = RoundClock(context.config.averaging)
        self._samples = 0

    def inner_optimizer(self) -> torch.optim.Optimizer | None:
        return None

    def join(self, fresh: bool) -> JoinResult:
        return JoinResult()

    def after_step(self, samples: int) -> list[RoundResult]:
        self._clock.tick()
        self._samples += samples
        return []

    def sync_due(self) -> bool:
        return self._clock.due()

    def sync_round(self) -> list[RoundResult]:
        self.outer.apply(self.outer.pseudo_gradient())
        weight, self._samples = self._samples, 0
        self._clock.restart()
        return [RoundResult("solo", weight=weight, role="local")]

    def rollback(self) -> bool:
        self._samples = 0
        self._clock.restart()
        return self.outer.restore()

    def on_client_mode(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}

    def metrics(self) -> ExchangeMetrics:
        return ExchangeMetrics()

    def details(self) -> dict[str, Any]:
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"outer_optimizer": self.outer.state_dict(copy=False)}  # saved at once, on this thread

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["outer_optimizer"])

    def abort(self) -> None:
        pass

    def finish(self) -> list[RoundResult]:
        return []

    def close(self) -> None:
        pass
