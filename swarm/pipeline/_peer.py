"""One pipeline stage at a time as what a peer trains (:class:`OneStage`), and :class:`StagePeer`, the
trainer's core with it.

Stage 0 peers are *data holders*: they draw batches from their data shard, run the embeddings and
first blocks, and drive micro-batches through the later stages (:class:`~swarm.pipeline._driver.DataHolder`).
Later stages serve (:class:`~swarm.pipeline.StageServer`, computing on this peer's training thread).
Either way a peer takes an inner AdamW step on its stage every ``train.batch_size`` samples it processed
(SWARM's rule), and keeps its stage in agreement with the other peers of the stage through the gossip
backend (:class:`~swarm.trainer.PeerGroup` ``.stage<k>``: averagers, state server and joiners' state
downloads namespaced by stage, partners restricted to it). The loop::

    join: choose the stage (given, or the lowest capacity), build it, take over its state from its peers
    loop: every ``pipeline.rebalance_every_s``: maybe move to an under-served stage
          data holder: one batch through the pipeline, then the inner step
          server:      serve requests; once a batch's worth of samples is committed, the inner step
          after a step: the backend applies committed exchanges, maybe starts one (rounds)
          each round: evaluate (data holders, through the pipeline), announce, report
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from swarm.config import RunConfig
from swarm.learning import nats_to_bits
from swarm.membership import PeerState
from swarm.network import NetworkOptions
from swarm.pipeline._balance import Rebalancer, choose_stage, stage_loads
from swarm.pipeline._estimate import plan_stages
from swarm.pipeline._plan import StageSpec
from swarm.pipeline._roster import Roster
from swarm.pipeline._stage_role import DataHolderRole, ServerRole, StageRole, make_role
from swarm.trainer import AveragingBackend, PeerCore, RoundResult, SyncReport

logger = logging.getLogger(__name__)


class OneStage:
    """The stage a peer holds (its :class:`StageRole`), how it chose it and when it moves to another:
    a :class:`~swarm.trainer.Trainee`, and the host its roles ask for what they need of the peer."""

    evaluates_alone = False  # a data holder evaluates through the other stages

    def __init__(
        self,
        core: PeerCore[Any],
        resumed: dict[str, Any] | None,
        specs: tuple[StageSpec, ...],
        stage: int | str,
    ) -> None:
        config = core.config
        self.core, self.config, self.device, self.node = core, config, core.device, core.node
        self.progress, self.source, self.specs = core.progress, core.source, specs
        self.num_stages = len(specs)
        if resumed is not None:  # the checkpoint's stage is the one to join
            if stage not in ("auto", int(resumed["stage"])):
                raise ValueError(
                    f"--stage {stage}: the checkpoint {core.resumed_from} holds stage {resumed['stage']}"
                )
            stage = int(resumed["stage"])
        self.requested, self._resumed = stage, resumed
        self.role: StageRole | None = None
        self.moves = 0
        self._capacity = 0.0
        pipe = config.pipeline
        self.rebalancer = Rebalancer(
            min_interval_s=pipe.rebalance_min_interval_s, epoch_s=3 * (pipe.rebalance_every_s or 30.0)
        )
        self._next_rebalance = time.monotonic() + (pipe.rebalance_every_s or 0)
        period = min(1.0, config.network.record_interval_s)
        self.roster = Roster(core.node, config.config_hash(), self.num_stages, period_s=period)

    @property
    def stage(self) -> int | None:
        return None if self.role is None else self.role.stage

    @property
    def module(self) -> torch.nn.Module | None:
        return None if self.role is None else self.role.module

    @property
    def backend(self) -> AveragingBackend | None:
        return None if self.role is None else self.role.backend

    def on_unreachable(self) -> None:
        """A peer nobody can dial can only hold data (stage 0), never serve a stage."""
        if self.requested != 0:
            logger.warning("nobody can dial this peer: it holds data (stage 0) instead of serving a stage")
            self.requested = 0

    # ------------------------------------------------------------------ stages

    def join(self) -> None:
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
        if self.core.state == "joining":
            self.core.state = "idle"  # serving now: others may adopt our state or route to us
        self.node.announce_now()
        logger.info("serving stage %d of %d (%d parameters)", stage, self.num_stages, self.role.n_params)

    def _announce(self, state: PeerState) -> None:
        self.core.state = state
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
            self.core.book_rounds(old.leave())
            old.close()
        self._enter(stage, fresh=True)
        self.core.state = resume
        self.moves += 1  # counts completed moves: the new stage is served by now

    # ------------------------------------------------------------------ the loop

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        """Maybe move to another stage; else one slice of the role's work (a batch through the pipeline,
        or serving), timed as the steps' ``device`` time and the rest (serving, the backend's work after
        each step)."""
        if self._maybe_rebalance():
            return []
        phases, device_before = self.core.phases, self.progress.device_seconds
        with phases.phase("step_other"):
            rounds = self._role().work(lr, stop)
        phases.move(self.progress.device_seconds - device_before, "step_other", "device")
        return rounds

    def finish(self) -> list[RoundResult]:
        return self._role().finish()

    def _role(self) -> StageRole:
        if self.role is None:
            raise RuntimeError("the peer holds no stage (join_swarm first)")
        return self.role

    def schedule_samples(self) -> int:
        """The learning-rate schedule's progress: per data holder (``max_steps``), or the swarm's samples
        (``run.target_samples``, which every sample counts once towards, whatever the stage)."""
        holders = self.roster.holder_samples(exclude=self.node.peer_id)
        own = self.progress.samples_total if self.stage == 0 else 0
        if self.config.run.target_samples is not None:  # plausible claims, leavers' kept (SwarmLedger)
            return self.core.ledger.observe(holders, own) + own
        if self.stage == 0 or not holders:
            return self.progress.samples_total
        return sum(samples for _, samples in holders) // len(holders)

    def finished(self, max_steps: int | None) -> bool:
        target = self.config.run.target_samples
        if target is not None and self.schedule_samples() >= target:
            return True
        if isinstance(self.role, DataHolderRole):
            return max_steps is not None and self.progress.step >= max_steps
        return isinstance(self.role, ServerRole) and self.roster.holders_gone()

    def _maybe_rebalance(self) -> bool:
        """Move to an under-served stage when it is time to look and the move is confirmed; True if it
        moved."""
        every = self.config.pipeline.rebalance_every_s
        now = time.monotonic()
        if every is None or now < self._next_rebalance or self._capacity <= 0:
            return False
        self._next_rebalance = now + every
        me, stage = self.node.peer_id, self._role().stage
        records = self.roster.records()
        target = self.rebalancer.consider(me, stage, self._capacity, records, self.num_stages, time.time())
        if target is None:
            return False
        state = self.core.state
        self._announce("joining")  # the claim: a peer elected from an older view now sees us moving
        self.roster.refresh()
        records = self.roster.records()
        if not self.rebalancer.confirm(me, stage, self._capacity, records, self.num_stages, target):
            logger.info("not moving to stage %d after all: another peer of stage %d is moving", target, stage)
            self._announce(state)
            return False
        logger.info(
            "moving from stage %d to the under-served stage %d (%s)",
            stage,
            target,
            stage_loads(records, self.num_stages),
        )
        self._move(target, resume=state)
        self.rebalancer.moved(time.time())
        return True

    # ------------------------------------------------------------------ what the roles call

    def step_done(
        self, samples: int, loss: float | None, seconds: float, compute: float, device: float
    ) -> None:
        """Book one inner step of the current role.

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

    def rounds_after_step(self, backend: AveragingBackend, samples: int) -> list[RoundResult]:
        return self.core.rounds_after_step(backend, samples)

    # ------------------------------------------------------------------ state, evaluation and figures

    def checkpoint_state(self) -> dict[str, Any] | None:
        return None if self.role is None else {"num_stages": self.num_stages, **self.role.checkpoint_state()}

    def parameters_finite(self) -> bool:
        return self.role is None or self.role.parameters_finite()

    def evaluate(self, stop: threading.Event | None) -> float | None:
        """Data holders: the held-out loss through the pipeline (while the other stages still serve),
        booked in bits per token and per byte; a stage server cannot evaluate alone (None)."""
        if not isinstance(self.role, DataHolderRole):
            return None
        batches, p, eval_set = self.config.train.eval_batches, self.progress, self.core.eval_set
        p.eval_loss = self.role.evaluate(eval_set, batches)
        p.eval_bits_per_byte = None if p.eval_loss is None else eval_set.bits_per_byte(p.eval_loss, batches)
        return p.eval_loss

    def record(self, fields: dict[str, Any]) -> None:
        """Activation bytes count as sent and received; the stage and its measured capacity."""
        sent, received = (0, 0) if self.role is None else self.role.activation_bytes
        fields["bytes_sent"] += sent
        fields["bytes_received"] += received
        fields["stage"] = self.stage or 0
        fields["stage_capacity"] = float(min(self._capacity, 1e12))
        if self.role is None:
            fields["state"] = "joining"

    def report(self) -> dict[str, Any]:
        return {}

    def summary(self) -> dict[str, Any]:
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

    def close(self) -> None:
        """Leave the stage, stop the roster."""
        if self.role is not None:
            with contextlib.suppress(Exception):
                self.role.close()
        self.roster.close()


class StagePeer(PeerCore[OneStage]):
    """A pipeline trainer: the core with :class:`OneStage`. Build it, (check reachability,)
    :meth:`join_swarm`, :meth:`run`, :meth:`close`; ``role``, ``stage``, ``moves`` and ``num_stages``
    are its stage's."""

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
        specs = plan_stages(config)  # a stage the run does not have is refused before the node starts
        if stage != "auto" and not 0 <= int(stage) < len(specs):
            raise ValueError(f"--stage {stage}: the run has stages 0..{len(specs) - 1}")
        build = functools.partial(OneStage, specs=specs, stage=stage)
        super().__init__(config, network, build, public_name=public_name, resume=resume, on_sync=on_sync)
        self.num_stages = self.trainee.num_stages

    @property
    def role(self) -> StageRole | None:
        return self.trainee.role

    @property
    def stage(self) -> int | None:
        return self.trainee.stage

    @property
    def moves(self) -> int:
        return self.trainee.moves
