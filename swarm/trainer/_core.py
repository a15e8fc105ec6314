"""PeerCore: what every trainer is, whatever it trains (the whole model, or one pipeline stage).

:class:`~swarm.trainer.TrainingPeer` and :class:`~swarm.pipeline.StagePeer` build on it. The core
owns the device, the data source and held-out set, the progress counters and the ledger of the
swarm's claims, the node (its record filled from :meth:`PeerCore._status`), the stop path
(:meth:`abort`, :meth:`aborting_on`), the phase timers, the booking of completed rounds, the
per-sync report and the end-of-run summary. A subclass says what it trains and how it averages
through a few hooks: :meth:`exchange_metrics`, :meth:`_backend_details`, :meth:`_abort_work`,
:meth:`_on_unreachable`, :meth:`_evaluate_round`, :meth:`_current_lr` and the ``_*_details`` ones.
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
from typing import Any

import torch

from swarm._device import describe_device
from swarm._node import NodeInfo, SwarmNode
from swarm._periodic import calling_on
from swarm.config import RunConfig
from swarm.gossip import FAILURES, ExchangeMetrics
from swarm.learning import make_eval_set, open_source, resolve_device, total_samples_of
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


class PeerCore:
    """The shell of a trainer (module docstring); subclasses set what they need for their hooks
    before calling ``super().__init__``, since the node may ask for a status at once."""

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        public_name: str = "",
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
        self._state: PeerState = "joining"
        self._stop: threading.Event | None = None
        self.stop_seen_at: float | None = None
        """``time.monotonic()`` when :meth:`abort` was first called: when this peer saw the stop."""
        device_name, memory = describe_device(str(self.device))
        info = NodeInfo(config.run.run_id, config.config_hash(), "trainer", public_name, device_name, memory)
        self.node = SwarmNode(
            network,
            info,
            status=self._status,
            record_interval_s=config.network.record_interval_s,
            record_ttl_s=config.network.record_ttl_s,
        )

    # ------------------------------------------------------------------ hooks

    @property
    def n_params(self) -> int:
        """The parameters this peer trains (the whole model's, or its stage's)."""
        raise NotImplementedError

    def exchange_metrics(self) -> ExchangeMetrics:
        """The averaging backend's wire and exchange counters (both roles)."""
        raise NotImplementedError

    def _backend_details(self) -> dict[str, Any]:
        """The averaging backend's ``details()`` (empty while there is none)."""
        raise NotImplementedError

    def _abort_work(self) -> None:
        """Cancel what is in flight (exchanges, pipeline requests) and refuse new work."""
        raise NotImplementedError

    def _on_unreachable(self) -> None:
        """Nobody could dial this peer back: adapt (client mode, or a role that needs no listener)."""
        raise NotImplementedError

    def _evaluate_round(self) -> None:
        """The held-out evaluation of a completed round, where this peer can make one."""
        raise NotImplementedError

    def _current_lr(self) -> float:
        raise NotImplementedError

    def _after_round(self) -> None:
        """A round was booked, before it is announced and reported."""

    def _report_details(self) -> dict[str, Any]:
        """Fields of :class:`SyncReport` beyond what the progress and the round say."""
        return {}

    def _summary_details(self) -> dict[str, Any]:
        """This kind of peer's own end-of-run numbers."""
        return {}

    def _final_eval_loss(self) -> float | None:
        """The held-out loss of the final model (None where this peer cannot evaluate)."""
        raise NotImplementedError

    evaluates_alone = True
    """Whether the final evaluation needs no other peer (a whole model), so it can wait until this peer
    has left the swarm; a pipeline data holder evaluates through the other stages, before leaving."""

    def _checkpoint_state(self) -> dict[str, Any] | None:
        """What a checkpoint holds beside the progress and the config hash (None: nothing to keep yet)."""
        raise NotImplementedError

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters this peer trains (none before it holds any)."""
        raise NotImplementedError

    def _parameters_finite(self) -> bool:
        """Whether the trained parameters are finite; rolls them back when they are not."""
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint now (if ``train.checkpoint_dir`` is set) unless the newest one already
        holds this step and round; return its path (:class:`~swarm.trainer._checkpoints.Checkpoints`)."""
        state = self._checkpoint_state()
        if state is None:
            return None
        return self.checkpoints.save(lambda: state, self._trained_parameters)

    def _maybe_checkpoint(self) -> None:
        """A periodic checkpoint; parameters gone non-finite since the last check (a round that completed
        in the background is booked after any step) are rolled back first, never saved."""
        if self.checkpoints.due() and self._parameters_finite():
            with self.phases.phase("checkpoint"):
                self.save_checkpoint()

    # ------------------------------------------------------------------ reachability and stopping

    def check_reachability(self) -> ReachabilityResult:
        """Ask other members to dial this peer back (``network.reachability_check``); call before
        :meth:`run`. If none can, :meth:`_on_unreachable` adapts the peer; the program tells the user
        what to do about it."""
        if not self.config.network.reachability_check:
            return ReachabilityResult("disabled")
        result = self.node.check_reachability()
        if result.unreachable:
            self._on_unreachable()
        return result

    def abort(self) -> None:
        """Cancel the work in flight (an exchange does not commit) and refuse more; for shutdown."""
        if self.stop_seen_at is None:
            self.stop_seen_at = time.monotonic()
            self.phases.stop.seen(self.progress.step, self.progress.round, self.phases.current())
        self._abort_work()

    def aborting_on(self, stop: threading.Event) -> AbstractContextManager[None]:
        """While inside, :meth:`abort` is called as soon as ``stop`` is set, so that a stalled partner
        (or stage peer) cannot hold a shutdown, joining or training, past its grace period."""
        return calling_on(stop, self.abort)

    def _stopping(self) -> bool:
        """Whether the loop has ended or a stop arrived: no new evaluation or checkpoint then."""
        return self._state == "leaving" or (self._stop is not None and self._stop.is_set())

    # ------------------------------------------------------------------ rounds

    def rounds_after_step(self, backend: AveragingBackend, samples: int) -> list[RoundResult]:
        """The backend's sequence after an inner step of ``samples`` samples, for every kind of peer and
        run nowhere else: apply what exchanges committed meanwhile; then, when a round is due and no
        stop arrived, start it if the parameters are finite (rolled back, and no round, if not).
        Returns the rounds that completed, for :meth:`_book_rounds`."""
        with self.phases.phase("apply"):
            rounds = backend.after_step(samples)
        if self._stopping() or not backend.sync_due() or not self._parameters_finite():
            return rounds
        logger.debug("step %d: starting round %d", self.progress.step, self.progress.round + 1)
        state = self._state  # a stage peer moving between stages stays "joining" (its claim)
        self._state = "syncing" if state == "training" else state
        try:
            with self.phases.phase("sync"):
                rounds += backend.sync_round()
        finally:
            self._state = state
        return rounds

    def _book_rounds(self, rounds: list[RoundResult]) -> None:
        """Book each completed round: evaluate (unless stopping), announce, report.

        Stopping or leaving, the last rounds are still booked, but a shutdown does not wait for an
        evaluation of each."""
        for result in rounds:
            progress = self.progress
            progress.samples_since_sync = 0
            progress.round += 1
            if result.drift is not None:
                progress.drift = result.drift
            if progress.round % self.config.train.eval_every_rounds == 0 and not self._stopping():
                with self.phases.phase("evaluate"):
                    self._evaluate_round()
            self._after_round()
            self.node.announce_soon()
            self._report(result)

    def _report(self, result: RoundResult) -> None:
        if self._on_sync is not None:
            report = SyncReport.of(self.progress, result, self._current_lr())
            self._on_sync(dataclasses.replace(report, **self._report_details()))

    # ------------------------------------------------------------------ status and summary

    def _status(self) -> dict[str, Any]:
        """The fields of this peer's membership record (``SwarmNode`` asks on every announce)."""
        return self.progress.record_fields(self._state, self.exchange_metrics())

    def summary(self) -> dict[str, Any]:
        """Final numbers of this peer but its held-out evaluation (:meth:`final_evaluation`); read them
        before :meth:`close`. Wire bytes are what this peer sent for averaging (both roles, every
        exchange kind), per round and parameter; an exchange's are the round exchange's (a model
        exchange with the base pushes before it; for the hivemind baseline, one averaging round's), per
        parameter and direction."""
        progress = self.progress
        metrics = self.exchange_metrics()
        details = self._backend_details()
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
            # partners the pseudo-gradient averager holds bans against, and their strike counts
            "banned_peers": details.get("banned_peers", {}),
            "ban_strikes": details.get("ban_strikes", {}),
            "reachability": self.node.reachability,
            # stream bytes over relayed connections (both directions, every service), swarm/p2p/_relay.py
            "relayed": RELAYED.snapshot(),
            **self._summary_details(),
        }

    def final_evaluation(self) -> dict[str, Any]:
        """The held-out loss of the final model for the summary (``eval_loss`` None where this peer
        cannot evaluate), in its unit and per byte."""
        loss = self._final_eval_loss()
        return {
            "eval_loss": loss,
            "eval_loss_unit": self.eval_set.loss_unit,
            "eval_bits_per_byte": None if loss is None else self.progress.eval_bits_per_byte,
        }
