"""What a :class:`~swarm.pipeline.StagePeer` does for the stage it holds: hold data, or serve.

Both roles own the stage module, its inner AdamW, and a gossip backend restricted to the stage's
peers (:class:`~swarm.trainer.PeerGroup`, namespace ``.stage<k>``). :meth:`StageRole.inner_step` is the
one place the stage's parameters change by training: gradient clip (per stage: the global norm would
need a round trip through every stage), the optimizer step under the backend's guard, then the backend
applies what its exchanges committed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

import torch

from swarm._node import SwarmNode
from swarm.config import RunConfig
from swarm.learning import (
    Corpus,
    EvalSet,
    HFStreamSource,
    TokenFile,
    TrainBatches,
    all_finite,
    make_inner_optimizer,
)
from swarm.pipeline._balance import ACTIVE
from swarm.pipeline._client import StageClient
from swarm.pipeline._clock import DeviceClock
from swarm.pipeline._compute import StageWorker
from swarm.pipeline._driver import DataHolder
from swarm.pipeline._plan import StageSpec
from swarm.pipeline._protocol import ServerLimits
from swarm.pipeline._roster import Roster
from swarm.pipeline._router import Router
from swarm.pipeline._server import StageServer
from swarm.pipeline._stages import build_stage, stage_parameters
from swarm.trainer import (
    AveragingBackend,
    BackendContext,
    JoinResult,
    PeerGroup,
    Progress,
    RoundResult,
    make_backend,
    roll_back,
)

logger = logging.getLogger(__name__)

SERVE_SLICE_S = 0.5
"""A server's loop returns to the peer this often (stop, end of run, rebalancing)."""


def stage_group(stage: int) -> PeerGroup:
    """The peers that average stage ``stage``: trainers serving it (a joining peer's record says stage 0
    before it has chosen, so joining ones are left out)."""
    return PeerGroup(
        f".stage{stage}",
        lambda record: record.role == "trainer" and record.stage == stage and record.state in ACTIVE,
    )


class StageHost(Protocol):
    """What a role needs of the peer that holds it (:class:`~swarm.pipeline.StagePeer`), and no more."""

    config: RunConfig
    device: torch.device
    node: SwarmNode
    progress: Progress
    roster: Roster
    source: Corpus | HFStreamSource | TokenFile
    specs: tuple[StageSpec, ...]

    def step_done(
        self, samples: int, loss: float | None, seconds: float, compute: float, device: float
    ) -> None:
        """Book one inner step of the role."""

    def rounds_after_step(self, backend: AveragingBackend, samples: int) -> list[RoundResult]:
        """The backend's sequence after the step (:meth:`~swarm.trainer.PeerCore.rounds_after_step`)."""


class StageRole:
    """A stage module with its optimizer and gossip backend."""

    def __init__(self, host: StageHost, spec: StageSpec) -> None:
        config = host.config
        self.host, self.spec, self.stage = host, spec, spec.index
        self.module = build_stage(config.model, spec, config.run.seed).to(host.device)
        self.n_params = stage_parameters(self.module)
        self.optimizer = make_inner_optimizer(self.module, config.train, host.device)
        self.lr = config.train.lr
        self.clock = DeviceClock(
            config.emulation.step_time_s, config.emulation.slowdown, config.train.batch_size
        )
        self.limits = [ServerLimits.of(config, k, len(host.specs)) for k in range(len(host.specs))]
        context = BackendContext(
            config, self.module, host.device, host.node, host.progress, stage_group(self.stage)
        )
        self.backend = make_backend(context, host.node.network)
        self._last_step = time.perf_counter()
        self.join_result = JoinResult()

    def join(self, fresh: bool) -> None:
        """Take over the stage's state from its peers (verified multi-donor download), then serve it."""
        self.join_result = self.backend.join(fresh)
        if self.join_result.donors:
            logger.info(
                "took over stage %d's state from %d donor(s)", self.stage, len(self.join_result.donors)
            )

    def inner_step(
        self, samples: int, loss: float | None, compute_s: float, device_s: float
    ) -> list[RoundResult]:
        """One AdamW step on the accumulated gradient of ``samples`` samples, then the backend's rounds.

        Parameters gone non-finite are rolled back (:func:`~swarm.trainer.roll_back`) before anything
        of them is averaged or served; that step then starts no round."""
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.host.config.train.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        with self.backend.update_guard():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        self.host.step_done(samples, loss, now - self._last_step, compute_s, device_s)
        self._last_step = now
        if not self.parameters_finite():  # every step: NaN activations would reach the other stages
            return []
        return self.host.rounds_after_step(self.backend, samples)

    def parameters_finite(self) -> bool:
        """Whether the stage's parameters are finite; rolls them back (:func:`~swarm.trainer.roll_back`)
        when they are not."""
        if all_finite(p.detach() for p in self.module.parameters()):
            return True
        what, progress = f"stage {self.stage} parameters", self.host.progress
        joined = roll_back(what, progress, self.backend, self.module, self.optimizer)
        self.join_result = joined or self.join_result
        self.host.node.announce_soon()
        return False

    def checkpoint_state(self) -> dict[str, Any]:
        """The stage's part of a checkpoint: its index, module, inner optimizer and backend state."""
        return {
            "stage": self.stage,
            "stage_module": self.module.state_dict(),
            "inner_optimizer": self.optimizer.state_dict(),
            "backend": self.backend.checkpoint_state(),
        }

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`checkpoint_state` (of this stage) before :meth:`join`."""
        self.module.load_state_dict(state["stage_module"])
        self.optimizer.load_state_dict(state["inner_optimizer"])
        self.backend.load_checkpoint_state(state["backend"])

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        raise NotImplementedError

    def evaluate(self, eval_set: EvalSet, batches: int) -> float | None:
        return None

    @property
    def activation_bytes(self) -> tuple[int, int]:
        """Activation and gradient bytes sent and received on stage streams."""
        return (0, 0)

    def details(self) -> dict[str, Any]:
        return {}

    def finish(self) -> list[RoundResult]:
        return self.backend.finish()

    def leave(self) -> list[RoundResult]:
        """Before moving to another stage: stop serving, use what was committed, end the exchanges."""
        return self.finish()

    def abort(self) -> None:
        self.backend.abort()

    def close(self) -> None:
        self.backend.close()


class DataHolderRole(StageRole):
    """Stage 0: local data, embeddings and first blocks; micro-batches routed through the swarm."""

    def __init__(self, host: StageHost, spec: StageSpec) -> None:
        super().__init__(host, spec)
        config, pipe = host.config, host.config.pipeline
        self.batches = TrainBatches.of_peer(
            host.source, config, host.node.peer_id, host.progress.samples_drawn
        )
        self.router = Router(len(host.specs), host.node.peer_id, pipe.routing)
        try:
            self.client = StageClient(config.run.run_id, self.limits, dht=host.node.dht)
        except BaseException:
            self.backend.close()
            raise
        self.holder = DataHolder(
            self.module,
            host.device,
            self.client,
            self.router,
            microbatch_size=pipe.microbatch_size,
            max_inflight=pipe.max_inflight,
            timeout_s=pipe.request_timeout_s,
            clock=self.clock,
        )
        host.roster.router = self.router
        host.roster.refresh()

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        self.lr = lr
        stats = self.holder.train_step(self.batches, self.host.config.train.batch_size)
        self.host.progress.samples_drawn = self.batches.samples_drawn
        if stats.samples == 0:
            logger.warning(
                "no micro-batch of this batch got through the pipeline (%d dropped)", stats.dropped
            )
            self.optimizer.zero_grad(set_to_none=True)
            stop.wait(1.0)
            return []
        return self.inner_step(stats.samples, stats.loss, stats.compute_s, stats.device_s)

    def evaluate(self, eval_set: EvalSet, batches: int) -> float | None:
        return self.holder.evaluate(eval_set, batches)

    def finish(self) -> list[RoundResult]:
        self.holder.drain(self.host.config.pipeline.request_timeout_s)
        return super().finish()

    @property
    def activation_bytes(self) -> tuple[int, int]:
        return (self.client.bytes_sent, self.client.bytes_received)

    def details(self) -> dict[str, Any]:
        return {
            "microbatches_by_peer": dict(self.router.served()),
            "dropped_microbatches": self.holder.dropped,
            "retries": self.holder.retries,
        }

    def close(self) -> None:
        if self.host.roster.router is self.router:
            self.host.roster.router = None
        self.client.close()
        super().close()


class ServerRole(StageRole):
    """Stages 1..S-1: answer the data holders' requests, step every batch's worth of committed samples."""

    def __init__(self, host: StageHost, spec: StageSpec) -> None:
        super().__init__(host, spec)
        pipe = host.config.pipeline
        self.worker = StageWorker(
            self.module,
            host.device,
            batch_size=host.config.train.batch_size,
            max_queue=pipe.max_queue,
            clock=self.clock,
        )
        self._device_mark = self._compute_mark = 0.0
        try:
            self.server = StageServer(
                self.worker,
                self.limits[self.stage],
                host.config.run.run_id,
                data_holders=host.roster.is_data_holder,
                dht=host.node.dht,
                request_timeout_s=pipe.request_timeout_s,
            )
        except BaseException:
            self.backend.close()
            raise

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        self.lr = lr
        until = time.monotonic() + SERVE_SLICE_S
        while not stop.is_set() and time.monotonic() < until:
            self.worker.process(0.05)
            if self.worker.step_ready:
                return self._step()
        return []

    def _step(self) -> list[RoundResult]:
        worker = self.worker
        samples = worker.samples_since_step
        loss = worker.loss_sum / worker.loss_samples if worker.loss_samples else None
        device = worker.stats.train_device_s - self._device_mark
        self._device_mark = worker.stats.train_device_s
        worker.stepped()
        self.host.roster.holders_active()  # the samples came from data holders: they were here
        return self.inner_step(samples, loss, device, device)

    def leave(self) -> list[RoundResult]:
        """Stop serving; settle every provisional micro-batch; step on what was committed."""
        self.worker.closing = True
        self.server.close()  # its streams end: every provisional micro-batch gets its rollback queued
        deadline = time.monotonic() + 30.0
        while (self.worker.process(0.1) or self.worker.provisional) and time.monotonic() < deadline:
            pass
        rounds = self._step() if self.worker.samples_since_step else []
        return rounds + self.finish()

    @property
    def activation_bytes(self) -> tuple[int, int]:
        stats = self.server.stats
        return (stats.bytes_sent, stats.bytes_received)

    def details(self) -> dict[str, Any]:
        w, s = self.worker.stats, self.server.stats
        return {
            "committed_microbatches": w.committed,
            "committed_samples": w.committed_samples,
            "rolled_back": w.rolled_back,
            "refused": w.refused,
            "busy": w.busy,
            "rejected_requests": s.rejected,
            "duplicates_committed": len(self.worker.committed_log) - len(set(self.worker.committed_log)),
        }

    def close(self) -> None:
        self.server.close()
        self.worker.forget_inputs()
        super().close()


def make_role(host: StageHost, spec: StageSpec) -> StageRole:
    """The role for stage ``spec``: data holder for stage 0, server for the others."""
    return DataHolderRole(host, spec) if spec.index == 0 else ServerRole(host, spec)
