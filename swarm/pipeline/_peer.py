"""StagePeer: a trainer that holds one pipeline stage, its role in the swarm, and its loop.

Stage 0 peers are *data holders*: they draw batches from their data shard, run the embeddings and
first blocks, and drive micro-batches through the later stages (:class:`~swarm.pipeline._driver.DataHolder`).
Later stages serve (:class:`~swarm.pipeline.StageServer`, computing on this peer's training thread).
Either way a peer takes an inner AdamW step on its stage every ``train.batch_size`` samples it processed
(SWARM's rule), and keeps its stage in agreement with the other peers of the stage through the gossip
backend (:class:`~swarm.trainer.PeerGroup` ``.stage<k>``: averagers, state server and joiners' state
downloads namespaced by stage, partners restricted to it). The loop::

    join: choose the stage (given, or the lowest capacity), build it, take over its state from its peers
    loop: data holder: one batch through the pipeline, then the inner step
          server:      serve requests; once a batch's worth of samples is committed, the inner step
          after a step: the backend applies committed exchanges, maybe starts one (rounds)
          each round: evaluate (data holders, through the pipeline), announce, report
          every ``pipeline.rebalance_every_s``: maybe move to an under-served stage
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from swarm._device import describe_device
from swarm._node import NodeInfo, SwarmNode
from swarm._periodic import calling_on
from swarm.config import RunConfig
from swarm.gossip import GossipMetrics
from swarm.network import NetworkOptions, ReachabilityResult
from swarm.pipeline._balance import Rebalancer, choose_stage, stage_loads
from swarm.pipeline._estimate import plan_stages
from swarm.pipeline._roster import Roster
from swarm.pipeline._stage_role import DataHolderRole, ServerRole, StageRole, make_role
from swarm.trainer import Progress, RoundResult, SwarmLedger, SyncReport
from swarm.training import (
    lr_at,
    make_eval_set,
    nats_to_bits,
    open_source,
    resolve_device,
    total_samples_of,
)

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class StagePeer:
    """A pipeline trainer. Build it, (check reachability,) :meth:`join_swarm`, :meth:`run`, :meth:`close`."""

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        stage: int | str = "auto",
        public_name: str = "",
        on_sync: Callable[[SyncReport], None] | None = None,
    ) -> None:
        self.config, self._on_sync = config, on_sync
        self.specs = plan_stages(config)
        self.num_stages = len(self.specs)
        if stage != "auto" and not 0 <= int(stage) < self.num_stages:
            raise ValueError(f"--stage {stage}: the run has stages 0..{self.num_stages - 1}")
        self.requested = stage
        self.device = resolve_device(config.train.device)
        self.source = open_source(config.data)
        self.eval_set = make_eval_set(self.source, config.model.block_size)
        self.progress = Progress(loss_unit=self.eval_set.loss_unit)
        self.total_samples = total_samples_of(config.train, config.run.target_samples)
        self.role: StageRole | None = None
        self.moves = 0
        self.ledger = SwarmLedger()
        self._state = "joining"
        self._capacity = 0.0
        device_name, memory = describe_device(str(self.device))
        info = NodeInfo(config.run.run_id, config.config_hash(), "trainer", public_name, device_name, memory)
        interval = config.network.record_interval_s
        self.node = SwarmNode(
            network,
            info,
            status=self._status,
            record_interval_s=interval,
            record_ttl_s=config.network.record_ttl_s,
        )
        pipe = config.pipeline
        self.rebalancer = Rebalancer(
            min_interval_s=pipe.rebalance_min_interval_s, epoch_s=3 * (pipe.rebalance_every_s or 30.0)
        )
        self._next_rebalance = time.monotonic() + (pipe.rebalance_every_s or 0)
        try:
            period = min(1.0, interval)
            self.roster = Roster(self.node, config.config_hash(), self.num_stages, period_s=period)
        except BaseException:
            self.node.close()
            raise

    @property
    def stage(self) -> int | None:
        return None if self.role is None else self.role.stage

    @property
    def n_params(self) -> int:
        return 0 if self.role is None else self.role.n_params

    def check_reachability(self) -> ReachabilityResult:
        """As a trainer does; a peer nobody can dial can only hold data (stage 0), never serve a stage."""
        if not self.config.network.reachability_check:
            return ReachabilityResult("disabled")
        result = self.node.check_reachability()
        if result.unreachable and self.requested != 0:
            logger.warning("nobody can dial this peer: it holds data (stage 0) instead of serving a stage")
            self.requested = 0
        return result

    # ------------------------------------------------------------------ stages

    def join_swarm(self) -> None:
        """Choose the stage, build it and take over its state from the stage's peers."""
        self.roster.refresh()
        if self.requested == "auto":
            stage = choose_stage(stage_loads(self.roster.records(), self.num_stages))
        else:
            stage = int(self.requested)
        self._enter(stage, fresh=True)

    def _enter(self, stage: int, fresh: bool) -> None:
        self.role = make_role(self, self.specs[stage])
        self.role.join(fresh)
        if self._state == "joining":
            self._state = "idle"  # serving now: others may adopt our state or route to us
        self.node.announce_now()
        logger.info("serving stage %d of %d (%d parameters)", stage, self.num_stages, self.n_params)

    def _announce(self, state: str) -> None:
        self._state = state
        self.node.announce_now()

    def _move(self, stage: int, resume: str) -> None:
        """Leave the current stage (its last steps applied), serve ``stage`` with that stage's state, then
        go back to state ``resume``.

        Our record already says ``joining`` (the claim, :meth:`_maybe_rebalance`), so that the others stop
        routing to us and no other peer of the old stage takes our leaving as its own chance to move
        (docs/pipeline.md).
        """
        old = self.role
        self.role = None
        if old is not None:
            self._completed(old.leave())
            old.close()
        self._enter(stage, fresh=True)
        self._state = resume
        self.moves += 1  # counts completed moves: the new stage is served by now

    # ------------------------------------------------------------------ the loop

    def run(self, stop: threading.Event, *, max_steps: int | None = None) -> None:
        """Train until ``stop``, the step limit (data holders) or the end of the data holders (servers)."""
        max_steps = max_steps or self.config.train.max_steps
        if self.role is None:
            self.join_swarm()
        self._state = "training"
        with self.aborting_on(stop):
            while not stop.is_set() and not self._finished(max_steps):
                self._completed(self._role().work(self._lr(), stop))
                self._maybe_rebalance()
        self._state = "leaving"
        self.node.announce_soon()  # partners stop dialling us, and do not count our going as a fault
        self._completed(self._role().finish())

    def _role(self) -> StageRole:
        if self.role is None:
            raise RuntimeError("the peer holds no stage (join_swarm first)")
        return self.role

    def _lr(self) -> float:
        return lr_at(self._schedule_samples(), self.config.train, self.total_samples)

    def _schedule_samples(self) -> int:
        """The learning-rate schedule's progress: per data holder (``max_steps``), or the swarm's samples
        (``run.target_samples``, which every sample counts once towards, whatever the stage)."""
        holders = self.roster.holder_samples(exclude=self.node.peer_id)
        own = self.progress.samples_total if self.stage == 0 else 0
        if self.config.run.target_samples is not None:  # plausible claims, leavers' kept (SwarmLedger)
            return self.ledger.observe(holders, own) + own
        if self.stage == 0 or not holders:
            return self.progress.samples_total
        return sum(samples for _, samples in holders) // len(holders)

    def _finished(self, max_steps: int | None) -> bool:
        target = self.config.run.target_samples
        if target is not None and self._schedule_samples() >= target:
            return True
        if isinstance(self.role, DataHolderRole):
            return max_steps is not None and self.progress.step >= max_steps
        return isinstance(self.role, ServerRole) and self.roster.holders_gone()

    def _maybe_rebalance(self) -> None:
        every = self.config.pipeline.rebalance_every_s
        now = time.monotonic()
        if every is None or now < self._next_rebalance or self._capacity <= 0:
            return
        self._next_rebalance = now + every
        me, stage = self.node.peer_id, self._role().stage
        records = self.roster.records()
        target = self.rebalancer.consider(me, stage, self._capacity, records, self.num_stages, time.time())
        if target is None:
            return
        state = self._state
        self._announce("joining")  # the claim: a peer elected from an older view now sees us moving
        self.roster.refresh()
        records = self.roster.records()
        if not self.rebalancer.confirm(me, stage, self._capacity, records, self.num_stages, target):
            logger.info("not moving to stage %d after all: another peer of stage %d is moving", target, stage)
            self._announce(state)
            return
        logger.info(
            "moving from stage %d to the under-served stage %d (%s)",
            stage,
            target,
            stage_loads(records, self.num_stages),
        )
        self._move(target, resume=state)
        self.rebalancer.moved(time.time())

    def step_done(
        self, samples: int, loss: float | None, seconds: float, compute: float, device: float
    ) -> None:
        """Book one inner step of the current role (called by the role).

        ``loss`` is the stages' cross-entropy in nats; it is booked, like every loss, in bits.
        """
        previous = self.progress.loss
        bits = 0.0 if loss is None else nats_to_bits(loss)
        self.progress.record_step(samples, bits, seconds, compute, device)
        if loss is None:
            self.progress.loss = previous
        if device > 0:
            capacity = samples / device
            self._capacity = capacity if self._capacity == 0 else 0.8 * self._capacity + 0.2 * capacity

    def _completed(self, rounds: list[RoundResult]) -> None:
        for result in rounds:
            p = self.progress
            p.samples_since_sync = 0
            p.round += 1
            if result.drift is not None:
                p.drift = result.drift
            if p.round % self.config.train.eval_every_rounds == 0 and isinstance(self.role, DataHolderRole):
                self._evaluate(self.role)
            self.node.announce_soon()
            self._report(result)

    def _evaluate(self, role: DataHolderRole) -> float | None:
        """The held-out loss through the pipeline, booked in bits per token and per byte."""
        batches = self.config.train.eval_batches
        p = self.progress
        p.eval_loss = role.evaluate(self.eval_set, batches)
        p.eval_bits_per_byte = (
            None if p.eval_loss is None else self.eval_set.bits_per_byte(p.eval_loss, batches)
        )
        return p.eval_loss

    def _report(self, result: RoundResult) -> None:
        if self._on_sync is not None and self.role is not None:
            self._on_sync(SyncReport.of(self.progress, result, self.role.lr))

    def abort(self) -> None:
        if self.role is not None:
            self.role.abort()

    def aborting_on(self, stop: threading.Event) -> AbstractContextManager[None]:
        """While inside, :meth:`abort` is called as soon as ``stop`` is set, so that a stalled partner
        (or stage peer) cannot hold a shutdown, joining or training, past its grace period."""
        return calling_on(stop, self.abort)

    # ------------------------------------------------------------------ status

    def gossip_metrics(self) -> GossipMetrics:
        return self.role.backend.metrics() if self.role is not None else GossipMetrics()

    def _status(self) -> dict[str, Any]:
        status = self.progress.record_fields(self._state, self.gossip_metrics())
        activation = self.role.activation_bytes if self.role is not None else (0, 0)
        status["bytes_sent"] += activation[0]
        status["bytes_received"] += activation[1]
        status["stage"] = self.stage or 0
        status["stage_capacity"] = float(min(self._capacity, 1e12))
        if self.role is not None:
            status.update(self.role.backend.status())
        if self.role is None:
            status["state"] = "joining"
        return status

    def summary(self) -> dict[str, Any]:
        """Final numbers of this peer (``swarm local``'s summary); data holders evaluate once more."""
        p = self.progress
        role = self.role
        eval_loss = self._evaluate(role) if isinstance(role, DataHolderRole) else None
        metrics = self.gossip_metrics()
        details = role.backend.details() if role is not None else {}
        exchanges = details.get("pseudo_gradient_metrics", metrics)
        n_params = max(self.n_params, 1)
        sent, received = role.activation_bytes if role is not None else (0, 0)
        return {
            "peer_id": self.node.peer_id,
            "stage": self.stage,
            "num_stages": self.num_stages,
            "n_params": self.n_params,
            "steps": p.step,
            "rounds": p.round,
            "samples": p.samples_total,
            "eval_loss": eval_loss,
            "eval_loss_unit": self.eval_set.loss_unit,
            "eval_bits_per_byte": p.eval_bits_per_byte if eval_loss is not None else None,
            "tokens_per_second": p.samples_per_s * self.config.model.block_size,
            "wire_bytes_per_param_per_sync": metrics.bytes_sent / max(p.round, 1) / n_params,
            "exchange_bytes_per_param": exchanges.bytes_sent / max(exchanges.exchanges_ok, 1) / n_params,
            "wire_bytes_sent": metrics.bytes_sent,
            "activation_bytes_sent": sent,
            "activation_bytes_received": received,
            "device_seconds": p.device_seconds,
            "compute_seconds": p.compute_seconds,
            "utilization": p.utilization(),
            "drift": p.drift,
            "exchanges_ok": metrics.exchanges_ok,
            "stage_capacity": self._capacity,
            "stage_moves": self.moves,
            "pipeline": role.details() if role is not None else {},
        }

    def close(self) -> None:
        """Leave the stage, stop the roster, close the node (the DHT and its daemon)."""
        if self.role is not None:
            with contextlib.suppress(Exception):
                self.role.close()
        self.roster.close()
        self.node.close()
