"""The whole model as what a peer trains (:class:`WholeModel`), and :class:`TrainingPeer`, the core with it.

The loop (:meth:`~swarm.trainer.PeerCore.run`) reads, for the whole model::

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
from typing import Any

import torch

from swarm.config import RunConfig
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
    evaluate_fitting,
    is_oom,
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


class WholeModel:
    """The whole model, its inner trainer, batches and averaging backend (``averaging.backend``,
    :func:`swarm.trainer._factory.make_backend`): a :class:`~swarm.trainer.Trainee`."""

    evaluates_alone = True

    def __init__(self, core: PeerCore[Any], resumed: dict[str, Any] | None) -> None:
        config, device = core.config, core.device
        self.core, self.config, self.device = core, config, device
        self.module = build_model(config.model, config.run.seed).to(device)
        context = BackendContext(config, self.module, device, core.node, core.progress)
        self.backend: AveragingBackend = make_backend(context, core.node.network)
        try:
            self.inner = InnerTrainer(
                self.module,
                config.train,
                device,
                optimizer=self.backend.inner_optimizer(),
                block_size=config.model.block_size,
                activation_checkpointing=config.train.activation_checkpointing,
                emulation=config.emulation,
                reserve_bytes=self._exchange_reserve(),
            )
            if resumed is not None:
                self._resume(resumed)
        except BaseException:
            self.backend.close()
            raise
        self.join_result = JoinResult()
        self.batches: TrainBatches | Prefetcher = TrainBatches.of_peer(
            core.source, config, core.node.peer_id, core.progress.samples_drawn
        )
        if device.type == "cuda":  # draw the next batch into pinned memory while the GPU computes
            self.batches = Prefetcher(self.batches, pin_memory=True)

    def _exchange_reserve(self) -> int:
        """What the exchanges will allocate on the device, for a micro-batch sized automatically."""
        if self.config.train.micro_batch_size is not None or self.device.type != "cuda":
            return 0
        from swarm.learning.estimate import exchange_reserve_bytes

        return exchange_reserve_bytes(self.config, self.device)

    def join(self) -> None:
        """A fresh peer in a running swarm takes over the live trainers' state; a resumed one keeps its
        checkpoint's."""
        core = self.core
        fresh = core.resumed_from is None and core.progress.step == 0
        self.join_result = self.backend.join(fresh)
        core.progress.swarm_samples = self._swarm_samples()
        core.state = "idle"  # joined: partners may dial us now (they do not dial a joining peer)
        core.node.announce_soon()

    def on_unreachable(self) -> None:
        """Client mode: the backend stops serving (it still starts its own exchanges) and the record
        says ``client_mode``, ``reachability: client`` and lists no addresses."""
        self.backend.on_client_mode()

    # ------------------------------------------------------------------ steps

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        """One inner step on the next local batch, then the backend's rounds."""
        core = self.core
        try:
            with core.phases.phase("step_other"):
                stats = self.inner.step(self.batches, lr=lr, guard=self.backend.update_guard, stop=stop)
            core.phases.move(stats.device_seconds, "step_other", "device")
        except Interrupted:
            self.batches.give_back()  # untrained: a resumed peer trains it next
            logger.info("stopping: abandoned step %d (nothing of it applied)", core.progress.step + 1)
            return []
        except OutOfDeviceMemory as error:
            self.batches.give_back()  # untrained: drawn again after the move
            self._out_of_device_memory(error)
            return []
        finally:
            core.progress.samples_drawn = self.batches.samples_drawn
        if not math.isfinite(stats.loss):
            self._roll_back(f"loss ({stats.loss})")
            return []
        core.progress.record_step(
            stats.samples, stats.loss, stats.seconds, stats.compute_seconds, stats.device_seconds
        )
        logger.debug("step %d took %.3f s", core.progress.step, stats.seconds)
        return self._counted(self._rounds_after_step(stats.samples))

    def finish(self) -> list[RoundResult]:
        return self._counted(self.backend.finish())

    def _counted(self, rounds: list[RoundResult]) -> list[RoundResult]:
        """``rounds``, after reading the swarm's samples anew when there are any."""
        if rounds:
            with self.core.phases.phase("dht"):
                self.core.progress.swarm_samples = self._swarm_samples()
        return rounds

    def _rounds_after_step(self, samples: int) -> list[RoundResult]:
        """The core's ``rounds_after_step``; out of memory while applying an update (or starting a
        round) drops that update and goes on training: the next exchange brings the swarm's state again."""
        try:
            return self.core.rounds_after_step(self.backend, samples)
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
        outer = getattr(self.backend, "outer", None)  # the backends that keep an outer optimizer
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

    def parameters_finite(self) -> bool:
        """Checked before each round (the model we exchange must be finite to be worth anything); rolls
        back when they are not."""
        if all_finite(p.detach() for p in self.module.parameters()):
            return True
        self._roll_back("parameters")
        return False

    def _roll_back(self, what: str) -> None:
        """A non-finite loss or parameters: :func:`~swarm.trainer._rollback.roll_back`."""
        optimizer = self.inner.optimizer if self.backend.inner_optimizer() is None else None
        joined = roll_back(what, self.core.progress, self.backend, self.module, optimizer)
        if joined is not None:
            self.join_result = joined
        self.core.node.announce_soon()

    # ------------------------------------------------------------------ the schedule and the swarm

    def schedule_samples(self) -> int:
        """With ``run.target_samples`` the schedule spans the whole swarm's work, so it follows the swarm's
        progress (as announced by live trainers); with only ``train.max_steps`` it is this peer's own."""
        progress = self.core.progress
        if self.config.run.target_samples is not None:
            return max(progress.swarm_samples, progress.samples_total)
        return progress.samples_total

    def finished(self, max_steps: int | None) -> bool:
        progress = self.core.progress
        if max_steps is not None and progress.step >= max_steps:
            return True
        target = self.config.run.target_samples
        return target is not None and progress.swarm_samples >= target

    def _swarm_samples(self) -> int:
        """Samples processed by the run's trainers (ours at least): drives the learning-rate schedule.

        The others count as far as the :class:`SwarmLedger` finds their claims plausible, those that
        left included, so the count never drops. A peer that took over a state counts at least that
        state's samples, even once its donors left.
        """
        node, own = self.core.node, self.core.progress.samples_total
        claims = [
            (m.peer_id, m.record.samples_total)
            for m in node.recent_members()
            if m.peer_id != node.peer_id and m.record.role == "trainer"
        ]
        others = self.core.ledger.observe(claims, own)
        joined = self.join_result.meta.get("samples_total", 0)
        return max(others, joined) + own

    # ------------------------------------------------------------------ evaluation and figures

    def evaluate(self, stop: threading.Event | None = None) -> float:
        """Score the model on the held-out split now; book it in bits per token and per byte.

        A set ``stop`` abandons it (:class:`~swarm.learning.Interrupted`), booking nothing; one that
        does not fit the device even one window at a time is skipped (the last result stays, NaN if
        there is none)."""
        batches, progress, eval_set = self.config.train.eval_batches, self.core.progress, self.core.eval_set
        self.inner.free_gradients()  # the evaluation's activations and logits take their place
        loss = evaluate_fitting(
            self.module,
            eval_set,
            batches,
            stop=stop,
            micro_batch_size=self.inner.micro_batch_size,
            precision=self.inner.precision,
        )
        if loss is None:
            return progress.eval_loss if progress.eval_loss is not None else math.nan
        progress.eval_loss = loss
        progress.eval_bits_per_byte = eval_set.bits_per_byte(loss, batches)
        return loss

    def record(self, fields: dict[str, Any]) -> None:
        """The record has nothing of the whole model's beside the progress and the backend's."""

    def report(self) -> dict[str, Any]:
        figures = self.inner.summary()
        return {
            "tokens_per_s": figures["compute_tokens_per_second"],
            "mfu": figures["mfu"],
            "peak_memory_bytes": figures["peak_memory_bytes"],
        }

    def summary(self) -> dict[str, Any]:
        """What the inner trainer chose (precision, optimizer, micro-batch) and measured (MFU, memory)."""
        return self.inner.summary()

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> dict[str, Any]:
        return {
            "model": self.module.state_dict(),
            "inner_optimizer": self.inner.optimizer.state_dict(),
            "inner_optimizer_name": self.inner.optimizer_name,
            "backend": self.backend.checkpoint_state(),
        }

    def _resume(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["model"])
        self._load_inner_optimizer(state["inner_optimizer"], state.get("inner_optimizer_name"))
        # checkpoints written before backends existed keep the outer optimizer at the top level
        self.backend.load_checkpoint_state(
            state.get("backend") or {"outer_optimizer": state.get("outer_optimizer")}
        )

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
        """Stop the prefetcher and exchanging."""
        if isinstance(self.batches, Prefetcher):
            self.batches.close()
        self.backend.close()


class TrainingPeer(PeerCore[WholeModel]):
    """A trainer of the whole model: the core with a :class:`WholeModel`. Build it, call :meth:`run`
    until a stop event, then :meth:`close`; ``model``, ``inner``, ``backend`` and ``join_result`` are
    the whole model's."""

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        public_name: str = "",
        resume: bool = False,
        on_sync: Callable[[SyncReport], None] | None = None,
    ) -> None:
        super().__init__(config, network, WholeModel, public_name=public_name, resume=resume, on_sync=on_sync)

        whole = self.trainee
        self.model, self.inner, self.backend = whole.module, whole.inner, whole.backend

    @property
    def join_result(self) -> JoinResult:
        return self.trainee.join_result
