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
from typing import TYPE_CHECKING, Any

import torch

from swarm.pipeline._balance import ACTIVE
from swarm.pipeline._client import StageClient
from swarm.pipeline._compute import DeviceClock, StageWorker
from swarm.pipeline._driver import DataHolder
from swarm.pipeline._plan import StageSpec
from swarm.pipeline._protocol import ServerLimits
from swarm.pipeline._router import Router
from swarm.pipeline._server import StageServer
from swarm.pipeline._stages import build_stage, stage_parameters
from swarm.trainer import BackendContext, JoinResult, PeerGroup, RoundResult, make_backend
from swarm.training import EvalSet, TrainBatches, make_inner_optimizer

if TYPE_CHECKING:
    from swarm.pipeline._peer import StagePeer

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


class StageRole:
    """A stage module with its optimizer and gossip backend."""

    def __init__(self, peer: StagePeer, spec: StageSpec) -> None:
        config = peer.config
        self.peer, self.spec, self.stage = peer, spec, spec.index
        self.module = build_stage(config.model, spec, config.run.seed).to(peer.device)
        self.n_params = stage_parameters(self.module)
        self.optimizer = make_inner_optimizer(self.module, config.train, peer.device)
        self.lr = config.train.lr
        self.clock = DeviceClock(
            config.emulation.step_time_s, config.emulation.slowdown, config.train.batch_size
        )
        self.limits = [ServerLimits.of(config, k, len(peer.specs)) for k in range(len(peer.specs))]
        context = BackendContext(
            config, self.module, peer.device, peer.node, peer.progress, stage_group(self.stage)
        )
        self.backend = make_backend(context, peer.node.network)
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
        """One AdamW step on the accumulated gradient of ``samples`` samples, then the backend's rounds."""
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.peer.config.train.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr
        with self.backend.update_guard():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        now = time.perf_counter()
        self.peer.step_done(samples, loss, now - self._last_step, compute_s, device_s)
        self._last_step = now
        rounds = self.backend.after_step(samples)
        if self.backend.sync_due():
            rounds += self.backend.sync_round()
        return rounds

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

    def __init__(self, peer: StagePeer, spec: StageSpec) -> None:
        super().__init__(peer, spec)
        config, pipe = peer.config, peer.config.pipeline
        self.batches = TrainBatches.of_peer(
            peer.source, config, peer.node.peer_id, peer.progress.samples_drawn
        )
        self.router = Router(len(peer.specs), peer.node.peer_id, pipe.routing)
        try:
            self.client = StageClient(config.run.run_id, self.limits, dht=peer.node.dht)
        except BaseException:
            self.backend.close()
            raise
        self.holder = DataHolder(
            self.module,
            peer.device,
            self.client,
            self.router,
            microbatch_size=pipe.microbatch_size,
            max_inflight=pipe.max_inflight,
            timeout_s=pipe.request_timeout_s,
            clock=self.clock,
        )
        peer.roster.router = self.router
        peer.roster.refresh()

    def work(self, lr: float, stop: threading.Event) -> list[RoundResult]:
        self.lr = lr
        stats = self.holder.train_step(self.batches, self.peer.config.train.batch_size)
        self.peer.progress.samples_drawn = self.batches.samples_drawn
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
        self.holder.drain(self.peer.config.pipeline.request_timeout_s)
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
        if self.peer.roster.router is self.router:
            self.peer.roster.router = None
        self.client.close()
        super().close()


class ServerRole(StageRole):
    """Stages 1..S-1: answer the data holders' requests, step every batch's worth of committed samples."""

    def __init__(self, peer: StagePeer, spec: StageSpec) -> None:
        super().__init__(peer, spec)
        pipe = peer.config.pipeline
        self.worker = StageWorker(
            self.module,
            peer.device,
            batch_size=peer.config.train.batch_size,
            max_queue=pipe.max_queue,
            clock=self.clock,
        )
        self._device_mark = self._compute_mark = 0.0
        try:
            self.server = StageServer(
                self.worker,
                self.limits[self.stage],
                peer.config.run.run_id,
                data_holders=peer.roster.is_data_holder,
                dht=peer.node.dht,
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


def make_role(peer: StagePeer, spec: StageSpec) -> StageRole:
    """The role for stage ``spec``: data holder for stage 0, server for the others."""
    return DataHolderRole(peer, spec) if spec.index == 0 else ServerRole(peer, spec)
