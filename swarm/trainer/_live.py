"""The model a gossip trainer keeps training while its exchanges run: snapshots out, updates in.

Two threads meet here. The training thread runs inner steps; exchanges (ours, started by the sync
worker, and partners' that dial us) run on the averagers' threads. The rules:

* **Snapshots, never live tensors.** An exchange gets a snapshot of our parameters
  (:class:`ModelSnapshot`: the anchor read in place plus a compact copy of our progress since it),
  taken under :attr:`LiveModel.lock`. The training thread holds that lock only around the inner
  optimizer's in-place update (:meth:`updating`), so a partner that dials us never stops our
  training, and we never wait for it.
* **The training thread is the only writer.** A committed exchange only queues an :class:`Update`;
  the training thread applies it at its next step boundary (:meth:`apply_pending`), under the lock.
  Anchor, momentum and parameters therefore always change together, between two steps.
* **Every step is used once.** A snapshot carries the steps it holds. While an update is queued and
  not yet applied, no new snapshot is given out (its exchange already averaged these parameters);
  once applied, the steps it consumed leave the count, and the steps taken since the snapshot stay
  in the model as the start of the next round (kept local progress).

The update rule (docs/training.md): with anchor ``θ``, parameters ``φ``, a snapshot ``φs`` and the
pair's mean model ``m``, the training thread sets ``θ' = outer(θ, θ - m)`` and
``φ' = φ + (θ' - θ) - (φs - θ)``, i.e. ``φ' = θ' + (φ - φs)``: the new anchor plus whatever it trained
since.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm._device import release_free_host_memory
from swarm.compression import LazyTensors
from swarm.gossip import MixedTensors
from swarm.learning import OuterOptimizer, all_finite, half_dtype

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSnapshot:
    """Our parameters as an exchange averages them, and the inner steps since the anchor that they
    hold.

    Stored compactly: ``progress``, the parameters minus the anchor in bfloat16 (float16 on an MPS
    device without it; 2 bytes per
    parameter, on the anchor's device). ``params`` computes ``anchor + progress`` (float32) per tensor
    when read: that sum is the model the exchange offers, exactly, and what the update later subtracts
    from the parameters, so the rounding of ``progress`` stays in our own parameters instead of being
    lost. The anchor it reads changes only when an update is applied, which first makes every
    exchange still reading it stale (``LiveModel``'s ``before_change``).
    """

    params: LazyTensors
    progress: Tensors
    steps: int
    progress_norm: float = 0.0
    """``||params - anchor||``: how far we moved since the anchor, what a partner is judged against."""
    version: int = 0
    """:attr:`LiveModel.version` when it was taken."""


@dataclass
class Update:
    """A committed exchange's result, waiting for the training thread.

    ``kind="anchor"``: ``shift`` is how far the exchange moved
    our anchor snapshot. ``kind="model"``: ``gradient`` is the pair's mean model (a
    :class:`~swarm.gossip.MixedTensors`, read tensor by tensor) and ``snapshot`` the
    :class:`ModelSnapshot` it averaged, with its ``steps``; the outer step goes along ``anchor - mean``
    and the steps taken since the snapshot stay on top. ``kind="solo"``: an outer step on our
    own, whole pseudo-gradient (no partner). ``info`` is for the round's report.
    """

    kind: str
    gradient: Mapping[str, torch.Tensor] = field(default_factory=dict)
    snapshot: ModelSnapshot | None = None
    steps: int = 0
    shift: Tensors = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


class LiveModel:
    """The parameters, the outer optimizer and the bookkeeping of steps and pending updates."""

    def __init__(
        self,
        model: torch.nn.Module,
        outer: OuterOptimizer,
        samples_per_step: int,
        before_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.outer = outer
        self.lock = threading.Lock()
        self.steps = 0
        """Inner steps taken since the anchor and not yet used by an update."""
        self.version = 0
        """Counts the changes of the anchor (applied updates, rollbacks, resets): a snapshot of an
        older version describes a model that is gone."""
        self._before_change = before_change
        """Called before the anchor or the error feedback changes outside an exchange's commit: the
        exchanges reading a lazy snapshot of them must stop (``GossipAverager.invalidate``)."""
        self._params = dict(model.named_parameters())
        self._samples_per_step = samples_per_step
        self._pending: list[Update] = []
        self._pending_kinds: set[str] = set()
        self._queued = threading.Condition(self.lock)

    @property
    def samples_per_step(self) -> int:
        return self._samples_per_step

    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Around the inner optimizer's update: snapshots wait for it, and it counts as one step."""
        with self.lock:
            yield
            self.steps += 1

    # ------------------------------------------------------------------ snapshots (any thread)

    def model_snapshot(self, reuse: ModelSnapshot | None = None) -> ModelSnapshot | None:
        """Our parameters as a :class:`ModelSnapshot`, or None while an update waits to be applied (its
        exchange has already averaged these parameters) or when they are not finite. A model may be
        averaged again with no new steps: that is one more consensus step.

        ``reuse``: a snapshot still in use by another exchange; it is given again while nothing was
        applied since it was taken (the steps since stay local, as for any exchange), so that two
        overlapping exchanges hold one snapshot, not two."""
        with self.lock:
            if self._pending_kinds & {"solo", "model", "anchor"}:
                return None
            if reuse is not None and reuse.version == self.version:
                return reuse
            anchor = self.outer.anchor
            progress = {
                name: torch.sub(param.detach().to(anchor[name].device, torch.float32), anchor[name]).to(
                    half_dtype(anchor[name].device)  # bf16, or fp16 on an MPS device without it
                )
                for name, param in self._params.items()
            }
            if not all_finite(progress.values()):  # never served: the training thread rolls back
                return None
            schema = {name: (tuple(p.shape), torch.float32) for name, p in self._params.items()}
            params = LazyTensors(schema, lambda name: progress[name].float().add_(anchor[name]))
            return ModelSnapshot(params, progress, self.steps, norm(progress.values()), self.version)

    def anchor_view(self) -> LazyTensors | None:
        """Our live anchor, read in place (no copy), or None while an anchor update waits or when it
        is not finite. It changes only when an update is applied, which first makes the exchanges
        reading it stale (``before_change``)."""
        with self.lock:
            if "anchor" in self._pending_kinds or not all_finite(self.outer.anchor.values()):
                return None
            anchor = self.outer.anchor
            schema = {name: (tuple(t.shape), t.dtype) for name, t in anchor.items()}
            return LazyTensors(schema, anchor.__getitem__)

    # ------------------------------------------------------------------ updates

    def queue(self, update: Update) -> None:
        """Called when an exchange committed (any thread); applied by :meth:`apply_pending`."""
        with self.lock:
            self._pending.append(update)
            self._pending_kinds.add(update.kind)
            self._queued.notify_all()

    def wait_queued(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for an update to be queued (a scheduled partner's exchange
        with us committed); True if one is waiting."""
        with self._queued:
            return self._queued.wait_for(lambda: bool(self._pending), max(0.0, timeout))

    def has_pending(self) -> bool:
        with self.lock:
            return bool(self._pending)

    @torch.no_grad()
    def apply_pending(self) -> list[Update]:
        """Apply the queued updates in order; call from the training thread between steps."""
        with self.lock:
            updates, self._pending = self._pending, []
            self._pending_kinds.clear()
            if updates:
                self._before_change()
                self.version += 1
            for update in updates:
                self._apply(update)
        if updates:
            release_free_host_memory()  # the exchange's copies are gone: hand their pages back
        return updates

    def _apply(self, update: Update) -> None:
        if update.kind == "model":
            self._apply_model(update)
        elif update.kind == "solo":
            own = self._pseudo_gradient()
            if not all_finite(own.values()):  # the training thread rolls back; the anchor stays good
                update.steps, update.info["weight"] = 0, 0
                return
            self._move_params(self.outer.advance(own), own)
            update.steps, self.steps = self.steps, 0
            update.info["weight"] = update.steps * self._samples_per_step
        elif update.kind == "anchor":
            for name, anchor in self.outer.anchor.items():
                anchor.add_(update.shift[name])
            self._move_params(update.shift, None)
            update.shift = {}
        else:
            raise ValueError(f"unknown update kind {update.kind!r}")

    def _apply_model(self, update: Update) -> None:
        """The outer step along ``anchor - mean``, one tensor at a time: read the mean (it reads the
        anchor, so before the anchor moves), step, and move the parameters by the anchor's move minus
        the snapshot's progress: ``φ' = θ' + (φ - snapshot)``.

        Reading the mean decodes the partner's frames and re-encodes ours, one tensor at a time, here on
        the training thread: computing it when the exchange commits would hold the whole mean model
        (4 bytes a parameter, twice what the exchange path holds), and in bfloat16 its rounding would
        stop the pair short of its mean (docs/architecture.md, "One exchange, end to end")."""
        snapshot, mean = update.snapshot, update.gradient
        if snapshot is None:
            raise ValueError("a model update needs the snapshot it averaged")
        take = mean.take if isinstance(mean, MixedTensors) and mean.kept else mean.__getitem__
        for name, param in self._params.items():
            anchor = self.outer.anchor[name]
            gradient = anchor - take(name).to(anchor.device, torch.float32)
            move = self.outer.advance_tensor(name, gradient)
            move.sub_(snapshot.progress[name].to(move.device, torch.float32))
            param.add_(move.to(param.device, param.dtype))
        self.outer.count_round()
        update.gradient, update.snapshot = {}, None
        self.steps -= update.steps

    def _pseudo_gradient(self) -> Tensors:
        return {
            name: self.outer.anchor[name] - param.detach().to(self.outer.anchor[name].device, torch.float32)
            for name, param in self._params.items()
        }

    def _move_params(self, moves: Tensors, consumed: Tensors | None) -> None:
        """``φ += move (+ consumed)``: the anchor's move, plus the snapshot's steps that the update used."""
        for name, param in self._params.items():
            step = moves[name] if consumed is None else moves[name] + consumed[name]
            param.add_(step.to(param.device, param.dtype))

    @torch.no_grad()
    def rollback(self) -> bool:
        """The parameters went non-finite: back to the anchor, dropping the steps since and any update
        queued for them (computed against parameters that no longer exist). False if the anchor is not
        finite either (nothing changed then)."""
        with self.lock:
            if not self.outer.restore():
                return False
            self._pending, self.steps = [], 0
            self._pending_kinds.clear()
            self.version += 1
        return True

    def reset(self) -> None:
        """After loading new parameters and anchor (joining): nothing is pending, no steps are held."""
        with self.lock:
            self._before_change()
            self._pending, self.steps = [], 0
            self._pending_kinds.clear()
            self.version += 1


def relative_norm(shift: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """``||shift|| / ||reference||`` over all tensors."""
    return norm(shift.values()) / max(norm(reference.values()), 1e-12)


def progress_norm(params: Tensors, anchor: Tensors) -> float:
    """``||params - anchor||`` over all tensors, one tensor's difference at a time."""
    squares = (_norm(params[name].to(a.device, torch.float32) - a) ** 2 for name, a in anchor.items())
    return math.sqrt(sum(squares))


def norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm over all ``tensors``: float32 per tensor (MPS has no float64), summed in Python."""
    return math.sqrt(sum(_norm(t) ** 2 for t in tensors))


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t, dtype=torch.float32))
