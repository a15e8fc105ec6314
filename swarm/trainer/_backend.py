"""What a trainer's core needs from whatever keeps the peers' models in agreement.

A :class:`~swarm.trainer.TrainingPeer` owns the model, the data, the inner optimizer, the progress
counters, the swarm node, status, evaluation and checkpoints, and runs the loop. Everything about
averaging lives behind :class:`AveragingBackend`: the gossip backend (``averaging.backend: gossip``),
the ``hivemind.Optimizer`` baseline, a solo peer (``none``), and whatever comes next plug in here
without touching the core. The core calls, in this order::

    backend = make_backend(context)              # the model and the node exist
    inner optimizer = backend.inner_optimizer()  # None: the core's own AdamW
    backend.load_checkpoint_state(...)           # --resume only
    backend.join(fresh)                          # before the first step
    loop:  inner step, its parameter update inside backend.update_guard()
           rounds = backend.after_step(samples)  # rounds completed in the background, applied now
           if backend.sync_due(): rounds += backend.sync_round()
           each completed round: evaluate, announce, report, maybe checkpoint
    backend.abort() (on stop), backend.finish(), backend.close()
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from swarm.config import RunConfig
from swarm.gossip import ExchangeMetrics
from swarm.trainer._progress import Progress

if TYPE_CHECKING:
    from collections.abc import Callable

    from swarm._node import SwarmNode
    from swarm.membership import PeerRecord


RoundOutcome = Literal[
    "ok",
    "solo",
    "partial",
    "no_partner",
    "no_group",
    "busy",
    "failed",
    "rejected",
    "timeout",
    "cancelled",
    "skipped",
]
"""How a round ended: the gossip averager's :class:`~swarm.gossip.SyncOutcome` values, ``solo`` and the
all-reduce baseline's ``partial`` and ``no_group``."""
RoundRole = Literal["initiator", "responder", "local"]


@dataclass(frozen=True)
class RoundResult:
    """One completed averaging round, as the core reports it (one trainer line, one history row).

    ``outcome``: ``ok`` (averaged with someone), ``solo`` (an outer step on our own update), or why
    no averaging happened (``no_partner``, ``busy``, ``failed``, ``no_group``...). ``role`` says who
    started it: ``initiator``, ``responder`` (a partner dialled us and we applied the result too) or
    ``local``. ``weight``: the samples behind our side of the round.
    """

    outcome: RoundOutcome
    partner: str | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    weight: float = 0.0
    role: RoundRole = "initiator"
    drift: float | None = None


@dataclass(frozen=True)
class JoinResult:
    """How a fresh peer took over the swarm's state (empty when it kept its own)."""

    donors: tuple[str, ...] = ()
    meta: dict[str, int] = field(default_factory=dict)
    digest: str = ""


@dataclass(frozen=True)
class PeerGroup:
    """A part of the swarm that averages its own part of the model (a pipeline stage).

    ``suffix`` namespaces the group's averagers and state server (``run_id + suffix``); ``accepts``
    says which members' records belong to the group: only they are partners and donors.
    """

    suffix: str
    accepts: Callable[[PeerRecord], bool]


@dataclass
class BackendContext:
    """The core's parts a backend may use. ``progress`` is shared: backends set ``drift``.

    ``group``: averaging restricted to a :class:`PeerGroup` (the gossip backend honours it; None: the
    whole swarm)."""

    config: RunConfig
    model: torch.nn.Module
    device: torch.device
    node: SwarmNode
    progress: Progress
    group: PeerGroup | None = None


def outer_state_device(context: BackendContext) -> str | None:
    """``cpu`` when the outer state goes to host memory (``averaging.outer_state_device``), else None:
    next to the parameters."""
    from swarm.learning.estimate import outer_state_on_host

    return "cpu" if outer_state_on_host(context.config, context.device) else None


class AveragingBackend(Protocol):
    """The averaging half of a trainer. Every method is called from the training thread."""

    def inner_optimizer(self) -> torch.optim.Optimizer | None:
        """The inner optimizer to train with, if this backend wraps its own; None for the core's AdamW."""

    def update_guard(self) -> AbstractContextManager[Any]:
        """Held around each in-place parameter update of the inner optimizer."""

    def join(self, fresh: bool) -> JoinResult:
        """Before the first step: take over the swarm's state if this peer is ``fresh`` (not resumed)."""

    def after_step(self, samples: int) -> list[RoundResult]:
        """After each inner step of ``samples`` samples; returns the rounds that completed meanwhile."""

    def sync_due(self) -> bool:
        """Whether the core should call :meth:`sync_round` now."""

    def sync_round(self) -> list[RoundResult]:
        """Run (or start) one round; returns the rounds completed by the time it returns."""

    def rollback(self) -> bool:
        """The parameters went non-finite: put back those of the last completed round and drop the steps
        since. False when this backend cannot (its anchor is not finite either); the core then takes
        the swarm's state again."""

    def on_client_mode(self) -> None:
        """Nobody can dial this peer (failed reachability check): stop serving anything."""

    def status(self) -> dict[str, Any]:
        """Record fields this backend owns (e.g. ``state_hash``)."""

    def metrics(self) -> ExchangeMetrics:
        """Wire and exchange counters, both roles."""

    def details(self) -> dict[str, Any]:
        """Extra numbers for the peer's summary (bans, per-kind exchange counts...)."""

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume this backend (saved beside the core's state). Called on
        the training thread, which writes it out at once: it may hold live tensors, not copies."""

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`checkpoint_state` (``--resume``)."""

    def abort(self) -> None:
        """Cancel what is in flight without applying it, refuse new exchanges; thread-safe."""

    def finish(self) -> list[RoundResult]:
        """At the end of the loop: apply what already completed, start nothing new."""

    def close(self) -> None:
        """Release network resources (the node is closed by the core afterwards). Idempotent."""


class NoGuard:
    """Mixin for backends whose parameters nobody else reads during training."""

    def update_guard(self) -> AbstractContextManager[Any]:
        return contextlib.nullcontext()
