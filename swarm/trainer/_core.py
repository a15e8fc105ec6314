"""PeerCore: one trainer, whatever it trains (the whole model, or one pipeline stage).

What a peer trains is a :class:`Trainee` (:class:`~swarm.trainer.WholeModel`,
:class:`~swarm.pipeline.OneStage`), built by a function the core is handed and calls once its node is
up (what the trainee averages through needs the node). The core owns the rest: the device, the data
source and held-out set, the progress counters and the ledger of the swarm's claims, the node (its
record filled from :meth:`PeerCore._status`), the stop path (:meth:`abort`, :meth:`aborting_on`), the
phase timers, the learning-rate schedule, the loop (:meth:`run`), the booking of completed rounds
(:meth:`book_rounds`), checkpoints, the per-sync report and the end-of-run summary.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import torch

from swarm._device import describe_device
from swarm._node import NodeInfo, SwarmNode
from swarm._periodic import calling_on
from swarm.config import RunConfig
from swarm.gossip import FAILURES, ExchangeMetrics
from swarm.learning import (
    Interrupted,
    count_parameters,
    lr_at,
    make_eval_set,
    open_source,
    resolve_device,
    total_samples_of,
)
from swarm.membership import PeerState
from swarm.network import NetworkOptions, ReachabilityResult
from swarm.p2p import RELAYED
from swarm.trainer._backend import AveragingBackend, RoundResult
from swarm.trainer._checkpoints import Checkpoints
from swarm.trainer._ledger import SwarmLedger
from swarm.trainer._phases import PhaseTimers
from swarm.trainer._progress import Progress
from swarm.trainer._report import SyncReport

logger = logging.getLogger(__name__)


class Trainee(Protocol):
    """What a peer trains, and all that the core asks of it."""

    evaluates_alone: bool
    """Whether its evaluation needs no other peer, so that it can wait until the peer left the swarm (a
    pipeline data holder evaluates through the other stages)."""

    @property
    def module(self) -> torch.nn.Module | None:
        """The module it trains now, with its averaging :attr:`backend` (None: between stages)."""

    @property
    def backend(self) -> AveragingBackend | None: ...

    def join(self) -> None:
        """Take over the swarm's state (a fresh peer), then serve: the core's state leaves ``joining``."""

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        """A slice of training at ``lr`` (an inner step, a batch through the pipeline, a while of
        serving); the rounds that completed (:meth:`PeerCore.rounds_after_step`)."""

    def finish(self) -> list[RoundResult]:
        """On the way out: end the exchanges; the rounds that completed meanwhile."""

    def schedule_samples(self) -> int:
        """The samples that drive the learning-rate schedule."""

    def finished(self, max_steps: int | None) -> bool:
        """Whether its part is done: the step limit, the swarm's target, no data holders left."""

    def evaluate(self, stop: threading.Event | None) -> float | None:
        """Book the held-out loss now and return it (None: cannot); ``stop`` may abandon it."""

    def parameters_finite(self) -> bool:
        """Whether the trained parameters are finite; rolls them back when they are not."""

    def checkpoint_state(self) -> dict[str, Any] | None:
        """What a checkpoint holds beside the progress and the config hash (None: nothing yet)."""

    def on_unreachable(self) -> None:
        """Nobody could dial this peer back: adapt (client mode, or a role that needs no listener)."""

    def record(self, fields: dict[str, Any]) -> None:
        """Add its own fields to the membership record's ``fields``."""

    def report(self) -> dict[str, Any]:
        """Its fields of a :class:`SyncReport`."""

    def summary(self) -> dict[str, Any]:
        """Its own end-of-run numbers."""

    def close(self) -> None: ...


T = TypeVar("T", bound=Trainee)

Build = Callable[["PeerCore[Any]", dict[str, Any] | None], T]
"""Makes what a peer trains, from the core and the checkpoint to resume from (None: fresh)."""


class PeerCore(Generic[T]):
    """A trainer (module docstring). Build it with what it trains, (check reachability,)
    :meth:`join_swarm`, :meth:`run` until a stop event, then :meth:`close`."""

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        build: Build[T],
        *,
        public_name: str = "",
        resume: bool = False,
        on_sync: Callable[[SyncReport], None] | None = None,
    ) -> None:
        self.config, self._on_sync = config, on_sync
        self.device = resolve_device(config.train.device)
        self.source = open_source(config.data)
        self.eval_set = make_eval_set(self.source, config.model.block_size)
        self.progress = Progress(loss_unit=self.eval_set.loss_unit)
        self.total_samples = total_samples_of(config.train, config.run.target_samples)
        self.ledger = SwarmLedger()
        self.phases = PhaseTimers()
        self.checkpoints = Checkpoints(config, self.progress)
        self.state: PeerState = "joining"
        """This peer's state in its record; what it trains may claim ``joining`` while moving."""
        self._stop: threading.Event | None = None
        self._joined = False
        self._lr = config.train.lr  # the learning rate of the last work: the reports show it
        self.stop_seen_at: float | None = None
        """``time.monotonic()`` when :meth:`abort` was first called: when this peer saw the stop."""
        # the node announces at once, while the trainee is still being built: a joining peer's record
        self._fields = lambda: self.progress.record_fields("joining", ExchangeMetrics())
        device_name, memory = describe_device(str(self.device))
        info = NodeInfo(
            config.run.run_id,
            config.config_hash(),
            "trainer",
            public_name,
            device_name,
            memory,
            member_shards=config.run.member_shards,
        )
        self.node = SwarmNode(
            network,
            info,
            status=lambda: self._fields(),
            record_interval_s=config.network.record_interval_s,
            record_ttl_s=config.network.record_ttl_s,
        )
        try:
            found = self.checkpoints.load_latest() if resume else None
            self.resumed_from: Path | None = None if found is None else found[1]
            self.trainee: T = build(self, None if found is None else found[0])
        except BaseException:
            self.node.close()
            raise
        self._fields = self._status

    @property
    def n_params(self) -> int:
        """The parameters this peer trains (the whole model's, or its stage's)."""
        module = self.trainee.module
        return 0 if module is None else count_parameters(module)

    @property
    def evaluates_alone(self) -> bool:
        return self.trainee.evaluates_alone

    # ------------------------------------------------------------------ the loop

    def join_swarm(self) -> None:
        """Before the first step: a fresh peer takes over the swarm's state (a resumed one keeps its
        checkpoint's); :meth:`run` calls this once by itself."""
        self._joined = True
        self.trainee.join()

    def run(self, stop: threading.Event, *, max_steps: int | None = None) -> None:
        """Train until ``stop`` is set or the trainee's part is done (``max_steps``, else
        ``train.max_steps``; the swarm's target; no data holders left to serve).

        A stop starts no new work, so that a shutdown does not grow with the model: the work in progress
        is abandoned (an inner step before its next micro-batch, an evaluation before its next batch),
        and no round, evaluation or periodic checkpoint starts after it. Rounds that completed meanwhile
        are booked and reported (not evaluated); the caller saves the checkpoint (:meth:`save_checkpoint`).
        """
        max_steps = max_steps or self.config.train.max_steps
        self._stop = stop
        if not self._joined:
            self.join_swarm()
        trainee, train = self.trainee, self.config.train
        self.state = "training"
        with self.phases.loop():
            with self.aborting_on(stop):
                while not stop.is_set() and not trainee.finished(max_steps):
                    self._lr = lr_at(trainee.schedule_samples(), train, self.total_samples)
                    self.book_rounds(trainee.work(self._lr, stop))
            self.state = "leaving"
            self.node.announce_soon()  # partners stop dialling us, and do not count our going as a fault
            with self.phases.phase("finish"):
                rounds = trainee.finish()
            self.book_rounds(rounds)

    def rounds_after_step(self, backend: AveragingBackend, samples: int) -> list[RoundResult]:
        """The backend's sequence after an inner step of ``samples`` samples, for every kind of peer and
        run nowhere else: apply what exchanges committed meanwhile; then, when a round is due and no
        stop arrived, start it if the parameters are finite (rolled back, and no round, if not).
        Returns the rounds that completed, for :meth:`book_rounds`."""
        with self.phases.phase("apply"):
            rounds = backend.after_step(samples)
        if self._stopping() or not backend.sync_due() or not self.trainee.parameters_finite():
            return rounds
        logger.debug("step %d: starting round %d", self.progress.step, self.progress.round + 1)
        state = self.state  # a stage peer moving between stages stays "joining" (its claim)
        self.state = "syncing" if state == "training" else state
        try:
            with self.phases.phase("sync"):
                rounds += backend.sync_round()
        finally:
            self.state = state
        return rounds

    def book_rounds(self, rounds: list[RoundResult]) -> None:
        """Book each completed round: evaluate (unless stopping), announce, report; then maybe checkpoint.

        Stopping or leaving, the last rounds are still booked, but a shutdown does not wait for an
        evaluation of each, nor for a periodic checkpoint (the caller saves one at the end)."""
        for result in rounds:
            progress = self.progress
            progress.samples_since_sync = 0
            progress.round += 1
            if result.drift is not None:
                progress.drift = result.drift
            if progress.round % self.config.train.eval_every_rounds == 0 and not self._stopping():
                with self.phases.phase("evaluate"):
                    self._evaluate_round()
            self.node.announce_soon()
            self._report(result)
        if rounds and not self._stopping():
            self._maybe_checkpoint()

    def _evaluate_round(self) -> None:
        """The evaluation of a round; a stop that arrives meanwhile abandons it (nothing booked)."""
        try:
            self.trainee.evaluate(self._stop)
        except Interrupted:
            logger.info("stopping: abandoned the evaluation of round %d", self.progress.round)

    def _report(self, result: RoundResult) -> None:
        if self._on_sync is not None:
            report = SyncReport.of(self.progress, result, self._lr)
            self._on_sync(dataclasses.replace(report, **self.trainee.report()))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint now (if ``train.checkpoint_dir`` is set) unless the newest one already
        holds this step and round; return its path (:class:`~swarm.trainer._checkpoints.Checkpoints`)."""
        state = self.trainee.checkpoint_state()
        if state is None:
            return None
        module = self.trainee.module
        return self.checkpoints.save(
            lambda: state, lambda: [] if module is None else list(module.parameters())
        )

    def _maybe_checkpoint(self) -> None:
        """A periodic checkpoint; parameters gone non-finite since the last check (a round that completed
        in the background is booked after any step) are rolled back first, never saved."""
        if self.checkpoints.due() and self.trainee.parameters_finite():
            with self.phases.phase("checkpoint"):
                self.save_checkpoint()

    # ------------------------------------------------------------------ reachability and stopping

    def check_reachability(self) -> ReachabilityResult:
        """Ask other members to dial this peer back (``network.reachability_check``); call before
        :meth:`run`. If none can, the trainee adapts (:meth:`Trainee.on_unreachable`); the program tells
        the user what to do about it."""
        if not self.config.network.reachability_check:
            return ReachabilityResult("disabled")
        result = self.node.check_reachability()
        if result.unreachable:
            self.trainee.on_unreachable()
        return result

    def abort(self) -> None:
        """Cancel the work in flight (an exchange does not commit) and refuse more; for shutdown."""
        if self.stop_seen_at is None:
            self.stop_seen_at = time.monotonic()
            self.phases.stop.seen(self.progress.step, self.progress.round, self.phases.current())
        backend = self.trainee.backend
        if backend is not None:
            backend.abort()

    def aborting_on(self, stop: threading.Event) -> AbstractContextManager[None]:
        """While inside, :meth:`abort` is called as soon as ``stop`` is set, so that a stalled partner
        (or stage peer) cannot hold a shutdown, joining or training, past its grace period."""
        return calling_on(stop, self.abort)

    def _stopping(self) -> bool:
        """Whether the loop has ended or a stop arrived: no new evaluation or checkpoint then."""
        return self.state == "leaving" or (self._stop is not None and self._stop.is_set())

    def close(self) -> None:
        """Release what the trainee holds, leave the swarm (the record expires), stop the DHT and its
        daemon."""
        try:
            self.trainee.close()
        finally:
            self.node.close()

    # ------------------------------------------------------------------ status and summary

    def exchange_metrics(self) -> ExchangeMetrics:
        """The averaging backend's wire and exchange counters (both roles)."""
        backend = self.trainee.backend
        return ExchangeMetrics() if backend is None else backend.metrics()

    def _status(self) -> dict[str, Any]:
        """The fields of this peer's membership record (``SwarmNode`` asks on every announce)."""
        fields = self.progress.record_fields(self.state, self.exchange_metrics())
        backend = self.trainee.backend
        if backend is not None:
            fields.update(backend.status())
        self.trainee.record(fields)
        return fields

    def summary(self) -> dict[str, Any]:
        """Final numbers of this peer but its held-out evaluation (:meth:`final_evaluation`); read them
        before :meth:`close`. Wire bytes are what this peer sent for averaging (both roles, every
        exchange kind), per round and parameter; an exchange's are the round's model exchange's (with
        the base pushes before it; for the hivemind baseline, one averaging round's), per parameter
        and direction."""
        progress = self.progress
        metrics = self.exchange_metrics()
        backend = self.trainee.backend
        details = {} if backend is None else backend.details()
        exchanges = details.get("exchange_metrics", metrics)
        n_params = max(self.n_params, 1)
        return {
            "peer_id": self.node.peer_id,
            "n_params": self.n_params,
            "steps": progress.step,
            "rounds": progress.round,
            "samples": progress.samples_total,
            "tokens_per_second": progress.samples_per_s * self.config.model.block_size,
            "wire_bytes_per_param_per_sync": metrics.bytes_sent / max(progress.round, 1) / n_params,
            "exchange_bytes_per_param": exchanges.bytes_sent / max(exchanges.exchanges_ok, 1) / n_params,
            # of those, what left after a round's last inner step (the rest, base pushes, overlapped it)
            "waiting_bytes_per_param": (exchanges.bytes_sent - exchanges.base_bytes_sent)
            / max(exchanges.exchanges_ok, 1)
            / n_params,
            # a committed exchange's data phase, and a dial's wait for the partner's answer (our syncs)
            "exchange_seconds": exchanges.mean_latency_s,
            "dial_seconds": exchanges.mean_dial_latency_s,
            "wire_bytes_sent": metrics.bytes_sent,
            "wire_bytes_total": metrics.bytes_sent + metrics.bytes_received,
            "device_seconds": progress.device_seconds,
            "compute_seconds": progress.compute_seconds,
            "utilization": progress.utilization(),
            # the training loop's wall time split by phase (swarm/trainer/_phases.py)
            "phase_seconds": self.phases.summary(),
            # where a stop found the loop and how long the way out took (None without a stop)
            "stop": self.phases.stop.summary(),
            # the largest resident set this process had (Linux reports KiB): to check the memory estimate
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "rounds_by_role": details.get("rounds_by_role", {}),
            "drift": progress.drift,
            "rollbacks": progress.rollbacks,
            "exchanges_ok": metrics.exchanges_ok,
            "exchanges_clipped": metrics.exchanges_clipped,
            "exchanges_suspect": metrics.exchanges_suspect,
            # exchanges sent relative to a base the pair shared, and bases we pushed (swarm/gossip/_bases.py)
            "exchanges_relative": metrics.exchanges_relative,
            "bases_pushed": metrics.bases_pushed,
            # exchanges that did not commit in this process, {role: {cause: count}} (swarm/gossip/_metrics.py)
            "exchanges_failed_by_cause": FAILURES.snapshot(),
            # partners the model averager holds bans against, and their strike counts
            "banned_peers": details.get("banned_peers", {}),
            "ban_strikes": details.get("ban_strikes", {}),
            "reachability": self.node.reachability,
            # stream bytes over relayed connections (both directions, every service), swarm/p2p/_relay.py
            "relayed": RELAYED.snapshot(),
            **self.trainee.summary(),
        }

    def final_evaluation(self) -> dict[str, Any]:
        """The held-out loss of the final model for the summary (``eval_loss`` None where this peer
        cannot evaluate), in its unit and per byte."""
        loss = self.trainee.evaluate(None)
        return {
            "eval_loss": loss,
            "eval_loss_unit": self.eval_set.loss_unit,
            "eval_bits_per_byte": None if loss is None else self.progress.eval_bits_per_byte,
        }
