"""The ``averaging.backend: hivemind`` baseline: the same model and data, averaged by ``hivemind.Optimizer``.

It exists to be measured against the gossip backend (see docs/baselines.md). How it is set up:

* **Local updates.** ``use_local_updates=True``: every peer takes its own AdamW step on every batch
  (as gossip peers do between syncs), and at the end of each hivemind *epoch* the swarm averages
  the parameters by Moshpit all-reduce. An epoch ends when the swarm together has processed
  ``target_batch_size = train.batch_size * averaging.sync_every_steps`` samples, so with ``N`` peers
  each peer averages every ``sync_every_steps / N`` of its own steps; set ``sync_every_steps`` to
  ``N * H`` to average every ``H`` local steps as a gossip peer with ``H`` does.
* **Averaging inside ``step``.** ``delay_state_averaging=False``: the peers that end an epoch
  match up and all-reduce before going on. hivemind's default (background averaging, applied by the
  delta rule) made its epoch tracker thrash on short epochs here, one epoch per step (measured); the
  time spent averaging is booked as communication, not compute, so utilization shows the cost.
* **Compression** of the averaged parameters follows ``compression.codec``
  (:data:`swarm.trainer.baselines._hivemind_wire.HIVEMIND_CODECS`).

hivemind counts no bytes, so the state averager (a forked process) counts them itself: every
length-prefixed protobuf message its P2P streams send or receive (all-reduce parts, matchmaking,
state downloads), libp2p's own framing and encryption excluded
(:mod:`swarm.trainer.baselines._hivemind_wire`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

import hivemind
import torch
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import RunConfig
from swarm.gossip import ExchangeMetrics
from swarm.learning import all_finite
from swarm.learning.inner import parameter_groups
from swarm.trainer._backend import BackendContext, JoinResult, NoGuard, RoundResult
from swarm.trainer.baselines._hivemind_wire import (
    MATCHMAKING_TIME_S,
    REQUEST_TIMEOUT_S,
    CountingAverager,
    WireCounters,
    hivemind_codec,
)


class _CountingStateAverager(CountingAverager, TrainingStateAverager):
    """hivemind's state averager, counting its wire bytes and completed all-reduce rounds."""

    def __init__(self, *, wire: WireCounters, **kwargs):
        self._wire = wire
        super().__init__(**kwargs)


class CountingOptimizer(hivemind.Optimizer):
    """``hivemind.Optimizer`` that counts wire traffic and the seconds ``step`` spends communicating.

    ``communication_seconds`` is time inside epoch transitions and state downloads, which
    ``InnerTrainer`` would otherwise book as compute.
    """

    def __init__(self, *, wire: WireCounters, **kwargs):
        self.wire, self.communication_seconds = wire, 0.0
        super().__init__(**kwargs)

    def _make_state_averager(self, **kwargs) -> TrainingStateAverager:
        # The arguments of hivemind 1.1.12's own _make_state_averager, with our subclass.
        return _CountingStateAverager(
            wire=self.wire,
            dht=self.dht,
            prefix=f"{self.run_id}_state_averager",
            min_matchmaking_time=self.matchmaking_time,
            allreduce_timeout=self.allreduce_timeout,
            shutdown_timeout=self.shutdown_timeout,
            offload_optimizer=self.offload_optimizer,
            custom_gradients=self.offload_optimizer,
            status_loglevel=self.status_loglevel,
            next_chunk_timeout=self.next_chunk_timeout,
            client_mode=self.client_mode,
            auxiliary=self.auxiliary,
            start=True,
            **kwargs,
        )

    def _update_global_epoch(self, grad_scaler) -> None:
        started = time.perf_counter()
        try:
            super()._update_global_epoch(grad_scaler)
        finally:
            self.communication_seconds += time.perf_counter() - started

    def load_state_from_peers(self, **kwargs) -> None:
        started = time.perf_counter()
        try:
            super().load_state_from_peers(**kwargs)
        finally:
            self.communication_seconds += time.perf_counter() - started


def hivemind_run_id(run_id: str) -> str:
    """The hivemind run's name: ours plus ``_hivemind`` (hivemind's prefixes may not contain dots)."""
    return f"{run_id.replace('.', '_')}_hivemind"


def make_hivemind_optimizer(
    config: RunConfig,
    dht: hivemind.DHT,
    model: torch.nn.Module,
    wire: WireCounters,
    private_key: RSAPrivateKey,
) -> CountingOptimizer:
    """``hivemind.Optimizer`` over the model's AdamW groups, configured as the module docstring says.

    ``private_key`` must be the key the DHT's signature validator signs with: hivemind merges all
    ``RSASignatureValidator``s of a DHT into the first one, so progress records that the tracker
    marks with any other key are stored unsigned and every peer rejects them.
    """
    codec = hivemind_codec(config.compression.codec)
    train, avg = config.train, config.averaging
    return CountingOptimizer(
        wire=wire,
        dht=dht,
        run_id=hivemind_run_id(config.run.run_id),
        target_batch_size=train.batch_size * avg.sync_every_steps,
        batch_size_per_step=train.batch_size,
        params=parameter_groups(model, train.weight_decay),
        optimizer=partial(torch.optim.AdamW, lr=train.lr, betas=(0.9, 0.95)),
        use_local_updates=True,
        delay_state_averaging=False,
        matchmaking_time=MATCHMAKING_TIME_S,
        averaging_timeout=avg.exchange_timeout_s,
        grad_compression=codec,
        state_averaging_compression=codec,
        # hivemind 1.1.12 ignores Optimizer(client_mode=...): client mode comes from the DHT.
        client_mode=None,
        tracker_opts={"private_key": private_key},
        averager_opts={"request_timeout": REQUEST_TIMEOUT_S},
    )


class HivemindBackend(NoGuard):
    """Averaging by ``hivemind.Optimizer``: one hivemind epoch is one round (one ``on_sync`` report).

    The optimizer wraps the inner AdamW (:meth:`inner_optimizer`), so averaging happens inside the
    core's inner step; the core books its waiting as communication, not device time.
    """

    def __init__(self, context: BackendContext) -> None:
        self._context = context
        self.wire = WireCounters()
        self._reported = self.wire.snapshot()
        self._samples = 0
        # the node's key: hivemind merges all RSASignatureValidators of a DHT into the first one
        self._optimizer: CountingOptimizer | None = make_hivemind_optimizer(
            context.config, context.node.dht, context.model, self.wire, context.node.identity_key
        )
        self._epoch = self.optimizer.local_epoch

    @property
    def optimizer(self) -> CountingOptimizer:
        """The ``hivemind.Optimizer`` (wrapping the inner AdamW), from construction until :meth:`close`."""
        if self._optimizer is None:
            raise RuntimeError("the hivemind backend is closed")
        return self._optimizer

    def inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def join(self, fresh: bool) -> JoinResult:
        """hivemind catches up by itself: a peer behind the swarm's epoch downloads state in ``step``."""
        return JoinResult()

    def after_step(self, samples: int) -> list[RoundResult]:
        self._samples += samples
        if self.optimizer.local_epoch == self._epoch:
            return []
        self._epoch = self.optimizer.local_epoch
        now = self.wire.snapshot()
        sent, received, rounds, peers = (a - b for a, b in zip(now, self._reported, strict=True))
        self._reported = now
        weight, self._samples = self._samples, 0
        return [
            RoundResult(
                "ok" if rounds else "no_group",
                partner=f"{peers / rounds:.1f} peers" if rounds else None,
                bytes_sent=sent,
                bytes_received=received,
                weight=weight,
            )
        ]

    def sync_due(self) -> bool:
        return False  # rounds end inside the optimizer's step

    def sync_round(self) -> list[RoundResult]:
        return []

    def rollback(self) -> bool:
        """hivemind keeps no anchor of ours: take the swarm's state again (its own catch-up path)."""
        self.optimizer.load_state_from_peers()
        return all_finite(p.detach() for p in self._context.model.parameters())

    def on_client_mode(self) -> None:
        """hivemind takes client mode from the DHT only at start-up; nothing to switch here."""

    def status(self) -> dict[str, Any]:
        return {}

    def metrics(self) -> ExchangeMetrics:
        """Measured wire bytes; ``exchanges_ok`` counts completed all-reduce rounds."""
        sent, received, rounds, _ = self.wire.snapshot()
        return ExchangeMetrics(exchanges_ok=rounds, bytes_sent=sent, bytes_received=received)

    def details(self) -> dict[str, Any]:
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        return {}  # the optimizer's state (hivemind's local epoch included) is the core's inner_optimizer

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        pass

    def abort(self) -> None:
        pass

    def finish(self) -> list[RoundResult]:
        return []

    def close(self) -> None:
        """Say goodbye to the hivemind run and stop its averager process."""
        optimizer, self._optimizer = self._optimizer, None
        if optimizer is not None:
            optimizer.shutdown()
