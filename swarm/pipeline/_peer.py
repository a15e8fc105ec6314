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
from pathlib import Path
from typing import Any

import torch

from swarm.config import RunConfig
from swarm.gossip import ExchangeMetrics
from swarm.learning import lr_at, nats_to_bits
from swarm.membership import PeerState
from swarm.network import NetworkOptions
from swarm.pipeline._balance import Rebalancer, choose_stage, stage_loads
from swarm.pipeline._estimate import plan_stages
from swarm.pipeline._roster import Roster
from swarm.pipeline._stage_role import DataHolderRole, ServerRole, StageRole, make_role
from swarm.trainer import PeerCore, RoundResult, SyncReport

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05


class StagePeer(PeerCore):
    """A pipeline trainer. Build it, (check reachability,) :meth:`join_swarm`, :meth:`run`, :meth:`close`.

    The shell it shares with whole-model trainers is :class:`~swarm.trainer.PeerCore`."""

    evaluates_alone = False  # a data holder evaluates through the other stages

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        stage: int | str = "auto",
        public_name: str = "",
        resume: bool = False,
        on_sync: Callable[[SyncReport], None] | None = None,
    ) -> None:
        self.specs = plan_stages(config)
        self.num_stages = len(self.specs)
        if stage != "auto" and not 0 <= int(stage) < self.num_stages:
            raise ValueError(f"--stage {stage}: the run has stages 0..{self.num_stages - 1}")
        self.requested = stage
        self.role: StageRole | None = None
        self.moves = 0
        self._capacity = 0.0
        super().__init__(config, network, public_name=public_name, on_sync=on_sync)
        interval = config.network.record_interval_s
        pipe = config.pipeline
        self.rebalancer = Rebalancer(
            min_interval_s=pipe.rebalance_min_interval_s, epoch_s=3 * (pipe.rebalance_every_s or 30.0)
        )
        self._next_rebalance = time.monotonic() + (pipe.rebalance_every_s or 0)
        try:
            self._resumed, self.resumed_from = self._resume() if resume else (None, None)
            period = min(1.0, interval)
            self.roster = Roster(self.node, config.config_hash(), self.num_stages, period_s=period)
        except BaseException:
            self.node.close()
            raise

    def _resume(self) -> tuple[dict[str, Any] | None, Path | None]:
        """The newest checkpoint (its progress restored), and the stage it holds as the one to join."""
        found = self.checkpoints.load_latest()
        if found is None:
            return None, None
        state, path = found
        stage = int(state["stage"])
        if self.requested not in ("auto", stage):
            raise ValueError(f"--stage {self.requested}: the checkpoint {path} holds stage {stage}")
        self.requested = stage
        return state, path

    @property
    def stage(self) -> int | None:
        return None if self.role is None else self.role.stage

    @property
    def n_params(self) -> int:
        return 0 if self.role is None else self.role.n_params

    def _on_unreachable(self) -> None:
        """A peer nobody can dial can only hold data (stage 0), never serve a stage."""
        if self.requested != 0:
            logger.warning("nobody can dial this peer: it holds data (stage 0) instead of serving a stage")
            self.requested = 0

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
        if self._resumed is not None and self._resumed["stage"] == stage:  # only the first stage held
            self.role.load_checkpoint_state(self._resumed)
            fresh = False
        self._resumed = None
        self.role.join(fresh)
        if self._state == "joining":
            self._state = "idle"  # serving now: others may adopt our state or route to us
        self.node.announce_now()
        logger.info("serving stage %d of %d (%d parameters)", stage, self.num_stages, self.n_params)

    def _announce(self, state: PeerState) -> None:
        self._state = state
        self.node.announce_now()

    def _move(self, stage: int, resume: PeerState) -> None:
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
        self._stop = stop
        if self.role is None:
            self.join_swarm()
        self._state = "training"
        with self.phases.loop():
            with self.aborting_on(stop):
                while not stop.is_set() and not self._finished(max_steps):
                    self._completed(self._work(stop))
                    self._maybe_rebalance()
            self._state = "leaving"
            self.node.announce_soon()  # partners stop dialling us, and do not count our going as a fault
            with self.phases.phase("finish"):
                rounds = self._role().finish()
            self._completed(rounds)

    def _work(self, stop: threading.Event) -> list[RoundResult]:
        """One slice of the role's work (a batch through the pipeline, or serving), timed as the
        steps' ``device`` time and the rest (serving, the backend's work after each step)."""
        device_before = self.progress.device_seconds
        with self.phases.phase("step_other"):
            rounds = self._role().work(self._lr(), stop)
        self.phases.move(self.progress.device_seconds - device_before, "step_other", "device")
        return rounds

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
        """Book each completed round, then maybe checkpoint; not while stopping (the caller saves one
        checkpoint at the end)."""
        self._book_rounds(rounds)
        if rounds and not self._stopping():
            self._maybe_checkpoint()

    def _checkpoint_state(self) -> dict[str, Any] | None:
        return None if self.role is None else {"num_stages": self.num_stages, **self.role.checkpoint_state()}

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        return [] if self.role is None else list(self.role.module.parameters())

    def _parameters_finite(self) -> bool:
        return self.role is None or self.role.parameters_finite()

    def _evaluate_round(self) -> None:
        if isinstance(self.role, DataHolderRole):
            self._evaluate(self.role)

    def _evaluate(self, role: DataHolderRole) -> float | None:
        """The held-out loss through the pipeline, booked in bits per token and per byte."""
        batches = self.config.train.eval_batches
        p = self.progress
        p.eval_loss = role.evaluate(self.eval_set, batches)
        p.eval_bits_per_byte = (
            None if p.eval_loss is None else self.eval_set.bits_per_byte(p.eval_loss, batches)
        )
        return p.eval_loss

    def _current_lr(self) -> float:
        return self.role.lr if self.role is not None else self.config.train.lr

    def _abort_work(self) -> None:
        if self.role is not None:
            self.role.abort()

    # ------------------------------------------------------------------ status

    def exchange_metrics(self) -> ExchangeMetrics:
        return self.role.backend.metrics() if self.role is not None else ExchangeMetrics()

    def _backend_details(self) -> dict[str, Any]:
        return self.role.backend.details() if self.role is not None else {}

    def _status(self) -> dict[str, Any]:
        status = super()._status()
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

    def _summary_details(self) -> dict[str, Any]:
        role = self.role
        sent, received = role.activation_bytes if role is not None else (0, 0)
        return {
            "stage": self.stage,
            "num_stages": self.num_stages,
            "activation_bytes_sent": sent,
            "activation_bytes_received": received,
            "stage_capacity": self._capacity,
            "stage_moves": self.moves,
            "pipeline": role.details() if role is not None else {},
        }

    def _final_eval_loss(self) -> float | None:
        """Data holders evaluate through the pipeline (while the other stages still serve); a stage
        server cannot alone."""
        return self._evaluate(self.role) if isinstance(self.role, DataHolderRole) else None

    def close(self) -> None:
        """Leave the stage, stop the roster, close the node (the DHT and its daemon)."""
        if self.role is not None:
            with contextlib.suppress(Exception):
                self.role.close()
        self.roster.close()
        self.node.close()
