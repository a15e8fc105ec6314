"""One peer's training run: the core that every averaging backend plugs into.

The loop reads top to bottom in :meth:`TrainingPeer.run`::

    join (the backend takes over the swarm's state if we are fresh)
    every step:   inner optimizer step on the next local batch (its parameter update under the
                  backend's guard) → the backend applies rounds that completed in the background
                  → if a round is due, the backend runs or starts it
    every completed round: held-out evaluation → announce → report → maybe checkpoint
    on a stop:    abandon the inner step in progress, start no round, evaluation or checkpoint;
                  book what already completed (the caller saves the one checkpoint of the way out)

What a round is (a gossip exchange, a hivemind epoch, a solo outer step) is the backend's business
(:mod:`swarm.trainer._backend`).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from swarm.config import RunConfig
from swarm.gossip import ExchangeMetrics
from swarm.learning import (
    InnerTrainer,
    Interrupted,
    OuterOptimizer,
    OutOfDeviceMemory,
    Prefetcher,
    TrainBatches,
    all_finite,
    build_model,
    can_load_state,
    count_parameters,
    evaluate_fitting,
    is_oom,
    lr_at,
    release_cached,
    state_kind,
)
from swarm.network import NetworkOptions
from swarm.trainer._backend import AveragingBackend, BackendContext, JoinResult, RoundResult
from swarm.trainer._core import PeerCore
from swarm.trainer._factory import make_backend
from swarm.trainer._report import SyncReport
from swarm.trainer._rollback import roll_back

logger = logging.getLogger(__name__)


class TrainingPeer(PeerCore):
    """A trainer of the whole model. Build it, call :meth:`run` until a stop event, then :meth:`close`.

    ``averaging.backend`` picks how it averages (:func:`swarm.trainer._factory.make_backend`); the
    shell it shares with pipeline stage peers is :class:`~swarm.trainer._core.PeerCore`.
    """

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        public_name: str = "",
        resume: bool = False,
        on_sync: Callable[[SyncReport], None] | None = None,
    ):
        self._backend: AveragingBackend | None = None
        self.join_result = JoinResult()
        self._has_joined = False
        super().__init__(config, network, public_name=public_name, on_sync=on_sync)
        try:
            self.model = build_model(config.model, config.run.seed).to(self.device)
            self._n_params = count_parameters(self.model)
            context = BackendContext(config, self.model, self.device, self.node, self.progress)
            self._backend = make_backend(context, network)
            self.inner = InnerTrainer(
                self.model,
                config.train,
                self.device,
                optimizer=self.backend.inner_optimizer(),
                block_size=config.model.block_size,
                activation_checkpointing=config.train.activation_checkpointing,
                emulation=config.emulation,
                reserve_bytes=self._exchange_reserve(),
            )
            self.resumed_from = self._resume() if resume else None
        except BaseException:
            self.close()
            raise
        self.batches: TrainBatches | Prefetcher = TrainBatches.of_peer(
            self.source, config, self.node.peer_id, self.progress.samples_drawn
        )
        if self.device.type == "cuda":  # draw the next batch into pinned memory while the GPU computes
            self.batches = Prefetcher(self.batches, pin_memory=True)

    @property
    def n_params(self) -> int:
        return self._n_params

    def _exchange_reserve(self) -> int:
        """What the exchanges will allocate on the device, for a micro-batch sized automatically."""
        if self.config.train.micro_batch_size is not None or self.device.type != "cuda":
            return 0
        from swarm.learning.estimate import exchange_reserve_bytes

        return exchange_reserve_bytes(self.config, self.device)

    @property
    def backend(self) -> AveragingBackend:
        """The averaging backend, made by the constructor (asking before that, or after it failed, raises)."""
        if self._backend is None:
            raise RuntimeError("this training peer has no averaging backend (its construction failed)")
        return self._backend

    def _on_unreachable(self) -> None:
        """Client mode: the backend stops serving (it still starts its own exchanges) and the record
        says ``client_mode``, ``reachability: client`` and lists no addresses."""
        self.backend.on_client_mode()

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, *, max_steps: int | None = None) -> None:
        """Train until ``stop`` is set, ``max_steps`` (or ``train.max_steps``) or the swarm's target.

        A stop starts no new work, so that a shutdown does not grow with the model: the inner step in
        progress is abandoned before its next micro-batch, an evaluation before its next batch, and no
        round, evaluation or periodic checkpoint starts after it. Rounds that completed meanwhile are
        booked and reported (not evaluated); the caller saves the checkpoint (:meth:`save_checkpoint`).
        """
        max_steps = max_steps or self.config.train.max_steps
        self._stop = stop
        if not self._has_joined:
            self.join_swarm()
        self._state = "training"
        with self.phases.loop():
            with self.aborting_on(stop):
                while not stop.is_set() and not self._finished(max_steps):
                    self._completed(self._inner_step())
            self._state = "leaving"
            self.node.announce_soon()  # partners stop dialling us, and do not count our going as a fault
            with self.phases.phase("finish"):
                rounds = self.backend.finish()
            self._completed(rounds)

    def join_swarm(self) -> None:
        """Before the first step, a fresh peer in a running swarm takes over the live trainers' state.

        A resumed peer keeps its checkpoint's state; :meth:`run` calls this once by itself.
        """
        self._has_joined = True
        fresh = self.resumed_from is None and self.progress.step == 0
        self.join_result = self.backend.join(fresh)
        self.progress.swarm_samples = self._swarm_samples()
        self._state = "idle"  # joined: partners may dial us now (they do not dial a joining peer)
        self.node.announce_soon()

    def _abort_work(self) -> None:
        if self._backend is not None:
            self._backend.abort()

    def _inner_step(self) -> list[RoundResult]:
        lr = lr_at(self._schedule_progress(), self.config.train, self.total_samples)
        try:
            with self.phases.phase("step_other"):
                stats = self.inner.step(self.batches, lr=lr, guard=self.backend.update_guard, stop=self._stop)
            self.phases.move(stats.device_seconds, "step_other", "device")
        except Interrupted:
            self.batches.give_back()  # untrained: a resumed peer trains it next
            logger.info("stopping: abandoned step %d (nothing of it applied)", self.progress.step + 1)
            return []
        except OutOfDeviceMemory as error:
            self.batches.give_back()  # untrained: drawn again after the move
            self._out_of_device_memory(error)
            return []
        finally:
            self.progress.samples_drawn = self.batches.samples_drawn
        if not math.isfinite(stats.loss):
            self._roll_back(f"loss ({stats.loss})")
            return []
        self.progress.record_step(
            stats.samples, stats.loss, stats.seconds, stats.compute_seconds, stats.device_seconds
        )
        logger.debug("step %d took %.3f s", self.progress.step, stats.seconds)
        return self._rounds_after_step(stats.samples)

    def _rounds_after_step(self, samples: int) -> list[RoundResult]:
        """:meth:`rounds_after_step`; out of memory while applying an update (or starting a round) drops
        that update and goes on training: the next exchange brings the swarm's state again."""
        try:
            return self.rounds_after_step(self.backend, samples)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            message = (str(error).splitlines() or [""])[0][:200]
        release_cached(self.device)  # after the handler: its traceback held the update's temporaries
        logger.warning(
            "out of memory applying an exchange's update (%s): dropped it, training on; tensors it "
            "reached before the error keep their new values",
            message,
        )
        return []

    def _out_of_device_memory(self, error: OutOfDeviceMemory) -> None:
        """Not even a micro-batch of one sample fits (or the optimizer step keeps running out): move the
        outer state to host memory when it is on the device and the config lets it move
        (``averaging.outer_state_device`` not ``device``), else stop with what ``swarm config check``
        advises for this device."""
        outer = getattr(self.backend, "outer", None)
        movable = self.config.averaging.outer_state_device != "device"
        on_device = isinstance(outer, OuterOptimizer) and any(
            t.device.type != "cpu" for t in outer.anchor.values()
        )
        if isinstance(outer, OuterOptimizer) and movable and on_device:
            with self.backend.update_guard():
                outer.move_state("cpu")
            release_cached(self.device)
            logger.warning("%s: moved the outer state to host memory, training on", error)
            return
        raise OutOfDeviceMemory(f"{error}. {self._memory_advice()}") from None

    def _memory_advice(self) -> str:
        """What ``swarm config check --device-memory`` says for this device's memory."""
        from swarm.learning.estimate import estimate_peer
        from swarm.learning.fit import fit_peer

        total = None
        if self.device.type == "cuda":
            total = int(torch.cuda.get_device_properties(self.device).total_memory)
        estimate = estimate_peer(self.config, self.device.type if self.device.type == "cuda" else "cpu")
        advice = fit_peer(self.config, estimate, total, None).advice
        return "swarm config check advises: " + (
            "; ".join(advice)
            or "it should fit: free the device of other programs, or set a smaller model.block_size"
        )

    def _parameters_finite(self) -> bool:
        """Checked before each round (our pseudo-gradient must be finite to be worth anything); rolls
        back when they are not."""
        if all_finite(p.detach() for p in self.model.parameters()):
            return True
        self._roll_back("parameters")
        return False

    def _roll_back(self, what: str) -> None:
        """A non-finite loss or parameters: :func:`~swarm.trainer._rollback.roll_back`."""
        optimizer = self.inner.optimizer if self.backend.inner_optimizer() is None else None
        joined = roll_back(what, self.progress, self.backend, self.model, optimizer)
        if joined is not None:
            self.join_result = joined
        self.node.announce_soon()

    def _completed(self, rounds: list[RoundResult]) -> None:
        """Book each completed round (:meth:`PeerCore._book_rounds`), then maybe checkpoint; not while
        stopping (the caller saves one checkpoint at the end)."""
        self._book_rounds(rounds)
        if rounds and not self._stopping():
            self._maybe_checkpoint()

    def _after_round(self) -> None:
        with self.phases.phase("dht"):
            self.progress.swarm_samples = self._swarm_samples()

    def _evaluate_round(self) -> None:
        """The evaluation of a round; a stop that arrives meanwhile abandons it (nothing booked)."""
        try:
            self.evaluate(stop=self._stop)
        except Interrupted:
            logger.info("stopping: abandoned the evaluation of round %d", self.progress.round)

    def evaluate(self, *, stop: threading.Event | None = None) -> float:
        """Score the model on the held-out split now; book it in bits per token and per byte.

        A set ``stop`` abandons it (:class:`~swarm.learning.Interrupted`), booking nothing; one that
        does not fit the device even one window at a time is skipped (the last result stays, NaN if
        there is none)."""
        batches = self.config.train.eval_batches
        self.inner.free_gradients()  # the evaluation's activations and logits take their place
        loss = evaluate_fitting(
            self.model,
            self.eval_set,
            batches,
            stop=stop,
            micro_batch_size=self.inner.micro_batch_size,
            precision=self.inner.precision,
        )
        if loss is None:
            return self.progress.eval_loss if self.progress.eval_loss is not None else math.nan
        self.progress.eval_loss = loss
        self.progress.eval_bits_per_byte = self.eval_set.bits_per_byte(loss, batches)
        return loss

    def _schedule_progress(self) -> int:
        """Samples that drive the learning-rate schedule.

        With ``run.target_samples`` the schedule spans the whole swarm's work, so it follows the swarm's
        progress (as announced by live trainers); with only ``train.max_steps`` it is this peer's own.
        """
        if self.config.run.target_samples is not None:
            return max(self.progress.swarm_samples, self.progress.samples_total)
        return self.progress.samples_total

    def _finished(self, max_steps: int | None) -> bool:
        if max_steps is not None and self.progress.step >= max_steps:
            return True
        target = self.config.run.target_samples
        return target is not None and self.progress.swarm_samples >= target

    # ------------------------------------------------------------------ swarm views

    def _swarm_samples(self) -> int:
        """Samples processed by the run's trainers (ours at least): drives the learning-rate schedule.

        The others count as far as the :class:`SwarmLedger` finds their claims plausible, those that
        left included, so the count never drops. A peer that took over a state counts at least that
        state's samples, even once its donors left.
        """
        claims = [
            (m.peer_id, m.record.samples_total)
            for m in self.node.recent_members()
            if m.peer_id != self.node.peer_id and m.record.role == "trainer"
        ]
        others = self.ledger.observe(claims, self.progress.samples_total)
        joined = self.join_result.meta.get("samples_total", 0)
        return max(others, joined) + self.progress.samples_total

    def exchange_metrics(self) -> ExchangeMetrics:
        """The backend's wire and exchange counters (both roles)."""
        return self._backend.metrics() if self._backend is not None else ExchangeMetrics()

    def _backend_details(self) -> dict[str, Any]:
        return self._backend.details() if self._backend is not None else {}

    def _status(self) -> dict[str, Any]:
        status = super()._status()
        if self._backend is not None:
            status.update(self._backend.status())
        return status

    def _current_lr(self) -> float:
        return self.inner.optimizer.param_groups[0]["lr"]

    def _report_details(self) -> dict[str, Any]:
        figures = self.inner.summary()
        return {
            "tokens_per_s": figures["compute_tokens_per_second"],
            "mfu": figures["mfu"],
            "peak_memory_bytes": figures["peak_memory_bytes"],
        }

    def _summary_details(self) -> dict[str, Any]:
        # what the inner trainer chose (precision, optimizer, micro-batch) and measured (MFU, peak memory)
        return self.inner.summary() if hasattr(self, "inner") else {}

    def _final_eval_loss(self) -> float:
        return self.evaluate()

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner.optimizer.state_dict(),
            "inner_optimizer_name": self.inner.optimizer_name,
            "backend": self.backend.checkpoint_state(),
        }

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        return list(self.model.parameters())

    def _resume(self) -> Path | None:
        found = self.checkpoints.load_latest()
        if found is None:
            return None
        state, path = found
        self.model.load_state_dict(state["model"])
        self._load_inner_optimizer(state["inner_optimizer"], state.get("inner_optimizer_name"))
        # checkpoints written before backends existed keep the outer optimizer at the top level
        self.backend.load_checkpoint_state(
            state.get("backend") or {"outer_optimizer": state.get("outer_optimizer")}
        )
        return path

    def _load_inner_optimizer(self, saved: dict[str, Any], name: str | None) -> None:
        """Load the checkpoint's inner-optimizer state, unless it is of another kind than the optimizer
        this run built (8-bit AdamW saved, torch's AdamW now because bitsandbytes broke, or the
        reverse): then the optimizer starts afresh, with a warning."""
        optimizer = self.inner.optimizer
        if not can_load_state(optimizer, saved):
            logger.warning(
                "the checkpoint's inner-optimizer state is %s's (%s), this run uses %s: starting the "
                "inner optimizer afresh (the model and the outer state are resumed)",
                name or state_kind(saved),
                "its moments cannot be loaded into another kind",
                self.inner.optimizer_name,
            )
            return
        optimizer.load_state_dict(saved)

    def close(self) -> None:
        """Stop exchanging, leave the swarm (the record expires), stop the DHT and its daemon."""
        batches = getattr(self, "batches", None)
        if isinstance(batches, Prefetcher):
            batches.close()
        if self._backend is not None:
            self._backend.close()
        if hasattr(self, "node"):
            self.node.close()
