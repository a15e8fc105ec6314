"""One peer's training run: inner steps on local data, gossip syncs, outer steps, checkpoints.

The loop reads top to bottom in :meth:`TrainingPeer.run`::

    every step:   inner optimizer step on the next local batch → serve the live pseudo-gradient
    every H steps or T seconds (a sync):
                  average pseudo-gradients with one random partner (weighted by samples) →
                  outer Nesterov step → sometimes a full-parameter exchange (drift control) →
                  held-out evaluation → announce → maybe checkpoint
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from swarm._device import describe_device
from swarm._node import NodeInfo, SwarmNode
from swarm.config import RunConfig
from swarm.gossip import GossipMetrics, PartnerInfo, SyncResult
from swarm.network import NetworkOptions, ReachabilityResult
from swarm.state import (
    StateServer,
    StateTransferError,
    download_state,
    load_latest_checkpoint,
    save_checkpoint,
)
from swarm.trainer._joining import adopt, choose_donors, progress_of, snapshot_of, state_limits
from swarm.trainer._progress import Progress
from swarm.trainer._sync import OuterSync, make_averager
from swarm.training import (
    InnerTrainer,
    OuterOptimizer,
    TrainBatches,
    build_model,
    count_parameters,
    evaluate,
    lr_at,
    make_eval_set,
    open_source,
    resolve_device,
    total_samples_of,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SyncReport:
    """What one sync did, for the trainer's one-line-per-sync output and its history."""

    round: int
    step: int
    loss: float | None
    eval_loss: float | None
    samples_per_s: float
    outcome: str
    partner: str | None
    bytes_sent: int
    bytes_received: int
    drift: float | None
    lr: float
    weight: float


class TrainingPeer:
    """A trainer in the swarm. Build it, call :meth:`run` until a stop event, then :meth:`close`."""

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        public_name: str = "",
        resume: bool = False,
        on_sync: Callable[[SyncReport], None] | None = None,
    ):
        self.config, self._on_sync = config, on_sync
        self.device = resolve_device(config.train.device)
        self.source = open_source(config.data)
        self.model = build_model(config.model, config.run.seed)
        self.n_params = count_parameters(self.model)
        self.inner = InnerTrainer(
            self.model,
            config.train,
            self.device,
            block_size=config.model.block_size,
            activation_checkpointing=config.train.activation_checkpointing,
        )
        self.outer = OuterOptimizer.from_config(self.model, config.averaging)
        self.eval_set = make_eval_set(self.source, config.model.block_size)
        self.progress = Progress()
        self.total_samples = total_samples_of(config.train, config.run.target_samples)
        self._state = "joining"
        self._last_checkpoint = time.monotonic()
        self._joined = False
        self.joined_from: list[str] = []
        self.joined_state: dict | None = None
        """The progress meta (round, step, samples_total) of the state this peer took over at join."""
        self.joined_digest = ""
        self._joined_samples = 0
        self.resumed_from = self._resume() if resume else None

        self.deltas = self.params = self.state_server = None
        self._state_hash = ""
        device_name, memory = describe_device(str(self.device))
        info = NodeInfo(config.run.run_id, config.config_hash(), "trainer", public_name, device_name, memory)
        self.node = SwarmNode(
            network,
            info,
            status=self._status,
            record_interval_s=config.network.record_interval_s,
            record_ttl_s=config.network.record_ttl_s,
        )
        try:
            if config.averaging.backend == "gossip":
                self._make_averagers(client_mode=None)
                self.state_server = StateServer(self.node.dht, config.run.run_id)
        except BaseException:
            self.close()
            raise
        self.sync = OuterSync(self.model, self.outer, self.deltas, self.params)
        self.batches = TrainBatches(
            self.source,
            config.model.block_size,
            config.train.batch_size,
            peer_key=self.node.peer_id,
            seed=config.run.seed,
            start_sample=self.progress.samples_drawn,
        )

    def _make_averagers(self, client_mode: bool | None) -> None:
        config = self.config
        self.deltas = make_averager(config, self.node.dht, self._partners, client_mode=client_mode)
        self.params = make_averager(
            config,
            self.node.dht,
            self._partners,
            suffix=".params",
            codec=config.averaging.param_codec,
            client_mode=client_mode,
            respect_bans_of=self.deltas,  # a peer banned for its updates is not trusted with parameters
        )

    def check_reachability(self) -> ReachabilityResult:
        """Ask other members to dial this peer back (``network.reachability_check``); call before :meth:`run`.

        If none can, the peer goes on in client mode: its averagers stop serving (it still starts its own
        exchanges), it stops serving its state, and its record says ``client_mode``, ``reachability:
        client`` and lists no addresses. The program tells the user what to do about it.
        """
        if not self.config.network.reachability_check:
            return ReachabilityResult("disabled")
        result = self.node.check_reachability()
        if result.unreachable and self.deltas is not None:
            for service in (self.state_server, self.params, self.deltas):
                if service is not None:
                    service.close()
            self.state_server = None
            self._make_averagers(client_mode=True)
            self.sync.deltas, self.sync.params = self.deltas, self.params
        return result

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, *, max_steps: int | None = None) -> None:
        """Train until ``stop`` is set, ``max_steps`` (or ``train.max_steps``) or the swarm's target."""
        max_steps = max_steps or self.config.train.max_steps
        if not self._joined:
            self.join_swarm()
        self.sync.serve_anchor()
        self._publish_state()
        self._state = "training"
        last_sync = time.monotonic()
        with self.aborting_on(stop):
            while not stop.is_set() and not self._finished(max_steps):
                self._inner_step()
                if self._sync_due(last_sync):
                    self._sync_round()
                    last_sync = time.monotonic()
                    self._maybe_checkpoint()
        self._state = "leaving"

    def abort(self) -> None:
        """Cancel the exchange in flight (it does not commit) and refuse further ones; for shutdown."""
        for averager in (self.deltas, self.params):
            if averager is not None:
                averager.abort()

    @contextlib.contextmanager
    def aborting_on(self, stop: threading.Event, period_s: float = 0.5) -> Iterator[None]:
        """While inside, a watcher thread calls :meth:`abort` as soon as ``stop`` is set, so that a
        stalled partner cannot hold a shutdown (joining or training) past its grace period."""
        finished = threading.Event()

        def watch() -> None:
            while not finished.is_set():
                if stop.wait(period_s):
                    self.abort()
                    return

        watcher = threading.Thread(target=watch, name="abort-on-stop", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            finished.set()
            watcher.join()

    def _inner_step(self) -> None:
        stats = self.inner.step(
            self.batches, lr=lr_at(self._schedule_progress(), self.config.train, self.total_samples)
        )
        self.progress.samples_drawn = self.batches.samples_drawn
        self.progress.record_step(stats.samples, stats.loss, stats.seconds, stats.compute_seconds)
        self.sync.serve_current(weight=self.progress.samples_since_sync)

    def _schedule_progress(self) -> int:
        """Samples that drive the learning-rate schedule.

        With ``run.target_samples`` the schedule spans the whole swarm's work, so it follows the swarm's
        progress (as announced by live trainers); with only ``train.max_steps`` it is this peer's own.
        """
        if self.config.run.target_samples is not None:
            return max(self.progress.swarm_samples, self.progress.samples_total)
        return self.progress.samples_total

    def _sync_due(self, last_sync: float) -> bool:
        avg = self.config.averaging
        steps_due = self.progress.step % avg.sync_every_steps == 0
        time_due = (
            avg.sync_every_seconds is not None and time.monotonic() - last_sync >= avg.sync_every_seconds
        )
        return steps_due or time_due

    def _sync_round(self) -> None:
        self._state = "syncing"
        weight = self.progress.samples_since_sync
        result = self.sync.step(weight=weight)
        self.progress.samples_since_sync = 0
        self.progress.round += 1
        self._control_drift()
        if self.progress.round % self.config.train.eval_every_rounds == 0:
            self.progress.eval_loss = evaluate(self.model, self.eval_set, self.config.train.eval_batches)
        self.progress.swarm_samples = self._swarm_samples()
        self._publish_state()
        self._state = "training"
        self._report(result, weight)

    def _control_drift(self) -> None:
        """Exchange full parameters every ``param_sync_every`` rounds, and every round while drifting."""
        avg = self.config.averaging
        drifting = self.progress.drift is not None and self.progress.drift > avg.max_drift
        if self.params is None or not (drifting or self.progress.round % avg.param_sync_every == 0):
            return
        exchanged = self.sync.exchange_parameters()
        if exchanged is not None and exchanged.drift is not None:
            self.progress.drift = exchanged.drift

    def join_swarm(self) -> None:
        """Before the first step, a fresh peer in a running swarm takes over the live trainers' state.

        It downloads the state several donors announce (verified frame by frame; the mean of their
        states when they differ), and falls back to a full-parameter exchange with one partner. A
        resumed peer keeps its checkpoint's state; :meth:`run` calls this once by itself.
        """
        self._joined = True
        if self.resumed_from is not None or self.progress.step > 0 or self.params is None:
            return
        if self._download_state():
            return
        if not self._other_trainers():
            logger.info("no other trainers and no kept state: starting from the config seed")
            return
        exchanged = self.sync.exchange_parameters(adopt_partner=True)
        if exchanged is None or exchanged.drift is None:
            logger.warning("could not fetch state from a live peer; starting from the config seed")
            return
        self.progress.swarm_samples = self._swarm_samples()
        logger.info(
            "adopted parameters of %s (distance before: %.3g)", exchanged.result.partner, exchanged.drift
        )

    def _other_trainers(self) -> list:
        """Live trainers other than us that can be dialled (not in client mode)."""
        return [
            m
            for m in self.node.members()
            if m.record.role == "trainer" and m.peer_id != self.node.peer_id and not m.record.client_mode
        ]

    def _download_state(self, attempts: int = 3) -> bool:
        """Download the donors' announced state; retry with fresh records when a donor moved on meanwhile.

        Donors are live trainers; a bootstrap that keeps the state (``--serve-state``) when no trainer
        announces one, and for the retries (a trainer that just left is still listed until its record
        expires; the bootstrap's copy is a stable fallback).
        """
        for attempt in range(1, attempts + 1):
            roles = ("trainer", "bootstrap") if attempt == 1 else ("bootstrap", "trainer")
            donors = choose_donors(self.node.members(), self.node.peer_id, roles=roles)
            if not donors:
                return False
            try:
                snapshot = download_state(
                    self.node.dht, donors, run_id=self.config.run.run_id, limits=state_limits(self.model)
                )
                progress = progress_of(snapshot.meta)
                adopt(self.model, self.outer, snapshot)
                break
            except (StateTransferError, ValueError) as exc:
                logger.warning("state download attempt %d/%d failed: %s", attempt, attempts, exc)
        else:
            return False
        self.joined_state, self.joined_digest = progress, snapshot.digest
        self._joined_samples = progress["samples_total"]
        self.progress.swarm_samples = self._swarm_samples()
        self.joined_from = [peer for peer, _ in donors]
        logger.info("took over the state of %d donor(s), digest %s", len(donors), snapshot.digest[:12])
        return True

    def _publish_state(self) -> None:
        if self.state_server is not None:
            snapshot = snapshot_of(self.outer, self.progress)
            self.state_server.publish(snapshot)
            self._state_hash = snapshot.digest
            self.node.announce_now()  # joiners ask for the digest in our record: keep it current

    def _finished(self, max_steps: int | None) -> bool:
        if max_steps is not None and self.progress.step >= max_steps:
            return True
        target = self.config.run.target_samples
        return target is not None and self.progress.swarm_samples >= target

    # ------------------------------------------------------------------ swarm views

    def _partners(self) -> list[PartnerInfo]:
        return [
            PartnerInfo(m.peer_id, m.record.protocol_version, m.record.config_hash, m.record.client_mode)
            for m in self.node.members()
            if m.record.role == "trainer"
        ]

    def _swarm_samples(self) -> int:
        """Samples processed by all live trainers (ours at least): drives the learning-rate schedule.

        A peer that took over a state counts at least that state's samples, even once its donors left.
        """
        seen = sum(m.record.samples_total for m in self.node.members() if m.peer_id != self.node.peer_id)
        return max(seen, self._joined_samples) + self.progress.samples_total

    def gossip_metrics(self) -> GossipMetrics:
        """Both averagers' counters added up (latencies are the pseudo-gradient averager's)."""
        parts = [a.metrics() for a in (self.deltas, self.params) if a is not None]
        return _add_metrics(parts) if parts else GossipMetrics()

    def _status(self) -> dict:
        p = self.progress
        metrics = self.gossip_metrics()
        return {
            "state": self._state,
            "step": p.step,
            "round": p.round,
            "samples_total": p.samples_total,
            "samples_per_s": float(p.samples_per_s),
            "loss": _bounded(p.loss),
            "eval_loss": _bounded(p.eval_loss),
            "drift": _bounded(p.drift),
            "bytes_sent": metrics.bytes_sent,
            "bytes_received": metrics.bytes_received,
            "exchanges_ok": metrics.exchanges_ok,
            "exchanges_failed": metrics.exchanges_failed,
            "exchanges_rejected": metrics.exchanges_rejected,
            "state_hash": self._state_hash,
        }

    def _report(self, result: SyncResult | None, weight: float) -> None:
        if self._on_sync is None:
            return
        p = self.progress
        self._on_sync(
            SyncReport(
                round=p.round,
                step=p.step,
                loss=p.loss,
                eval_loss=p.eval_loss,
                samples_per_s=p.samples_per_s,
                outcome=result.outcome.value if result is not None else "solo",
                partner=result.partner if result is not None else None,
                bytes_sent=result.bytes_sent if result is not None else 0,
                bytes_received=result.bytes_received if result is not None else 0,
                drift=p.drift,
                lr=self.inner.optimizer.param_groups[0]["lr"],
                weight=weight,
            )
        )

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "inner_optimizer": self.inner.optimizer.state_dict(),
            "outer_optimizer": self.outer.state_dict(),
            "progress": self.progress.checkpoint_state(),
            "config_hash": self.config.config_hash(),
        }

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint now (if ``train.checkpoint_dir`` is set); return its path."""
        directory = self.config.train.checkpoint_dir
        if directory is None:
            return None
        self._last_checkpoint = time.monotonic()
        return save_checkpoint(directory, self._checkpoint_state(), self.progress.step)

    def _maybe_checkpoint(self) -> None:
        if time.monotonic() - self._last_checkpoint >= self.config.train.checkpoint_every_s:
            self.save_checkpoint()

    def _resume(self) -> Path | None:
        directory = self.config.train.checkpoint_dir
        if directory is None:
            raise ValueError("--resume needs train.checkpoint_dir")
        found = load_latest_checkpoint(directory, config_hash=self.config.config_hash())
        if found is None:
            logger.warning("no valid checkpoint in %s: starting fresh", directory)
            return None
        state, path = found
        self.model.load_state_dict(state["model"])
        self.inner.optimizer.load_state_dict(state["inner_optimizer"])
        self.outer.load_state_dict(state["outer_optimizer"])
        self.progress.restore(state["progress"])
        return path

    def close(self) -> None:
        """Stop exchanging, leave the swarm (the record expires), stop the DHT and its daemon."""
        for service in (self.state_server, self.params, self.deltas):
            if service is not None:
                service.close()
        self.node.close()


def _bounded(value: float | None) -> float | None:
    """Records accept finite losses in [0, 1e6]; anything else is reported as unknown."""
    if value is None or not (0.0 <= value <= 1e6):
        return None
    return float(value)


def _add_metrics(parts: list[GossipMetrics]) -> GossipMetrics:
    counters = {
        f.name: sum(getattr(p, f.name) for p in parts)
        for f in dataclasses.fields(GossipMetrics)
        if not f.name.endswith("latency_s")
    }
    return dataclasses.replace(parts[0], **counters)
