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
* **Compression** of the averaged parameters follows ``compression.codec`` (:data:`HIVEMIND_CODECS`).

hivemind counts no bytes, so the state averager (a forked process) counts them itself: every
length-prefixed protobuf message its P2P streams send or receive (all-reduce parts, matchmaking,
state downloads), libp2p's own framing and encryption excluded. See :class:`WireCounters`.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import hivemind
import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
)
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P
from hivemind.utils.crypto import RSAPrivateKey

from swarm._device import describe_device
from swarm._node import NodeInfo, SwarmNode
from swarm.config import RunConfig
from swarm.gossip import GossipMetrics
from swarm.network import NetworkOptions
from swarm.state import load_latest_checkpoint
from swarm.trainer._peer import SyncReport, TrainingPeer
from swarm.trainer._progress import Progress
from swarm.training import (
    InnerTrainer,
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
from swarm.training.inner import parameter_groups

logger = logging.getLogger(__name__)

MATCHMAKING_TIME_S = 3.0
"""How long peers gather for an all-reduce: hivemind's advice for small local runs is 3-5 s."""
REQUEST_TIMEOUT_S = 2.0
"""Matchmaking requests must time out before the matchmaking time (hivemind warns otherwise)."""

HIVEMIND_CODECS: dict[str, type[CompressionBase]] = {
    "fp32": NoCompression,
    "fp16": Float16Compression,
    "bf16": Float16Compression,  # hivemind has no bf16 codec; fp16 is the same size
    "int8": BlockwiseQuantization,  # bitsandbytes' dynamic 8-bit, blocks of 4096
}


def hivemind_codec(name: str) -> CompressionBase:
    """hivemind's counterpart of one of our codec names."""
    if name not in HIVEMIND_CODECS:
        raise ValueError(
            f"compression.codec {name!r} has no hivemind counterpart; use one of {sorted(HIVEMIND_CODECS)}"
        )
    return HIVEMIND_CODECS[name]()


class WireCounters:
    """Bytes sent and received, all-reduce rounds and their group sizes, shared with forked processes."""

    SENT, RECEIVED, ROUNDS, PEERS = range(4)

    def __init__(self) -> None:
        self._values = [mp.Value(ctypes.c_int64, 0) for _ in range(4)]

    def add(self, index: int, amount: int) -> None:
        with self._values[index].get_lock():
            self._values[index].value += amount

    def snapshot(self) -> tuple[int, int, int, int]:
        sent, received, rounds, peers = (v.value for v in self._values)
        return sent, received, rounds, peers


def _count_stream_bytes(wire: WireCounters) -> None:
    """In this process, count every message P2P streams send or receive (payload and length prefix).

    Only ever called inside the averager's own process, so nothing else there is counted.
    """
    send, receive = P2P.send_raw_data, P2P.receive_raw_data

    async def counted_send(data: bytes, writer, *, chunk_size: int = 2**16) -> None:
        wire.add(WireCounters.SENT, len(data) + P2P.HEADER_LEN)
        await send(data, writer, chunk_size=chunk_size)

    async def counted_receive(reader) -> bytes:
        data = await receive(reader)
        wire.add(WireCounters.RECEIVED, len(data) + P2P.HEADER_LEN)
        return data

    P2P.send_raw_data = staticmethod(counted_send)
    P2P.receive_raw_data = staticmethod(counted_receive)


class _CountingStateAverager(TrainingStateAverager):
    """hivemind's state averager, counting its wire bytes and completed all-reduce rounds."""

    def __init__(self, *, wire: WireCounters, **kwargs):
        self._wire = wire
        super().__init__(**kwargs)

    def run(self) -> None:
        _count_stream_bytes(self._wire)
        super().run()

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        self._wire.add(WireCounters.ROUNDS, 1)
        self._wire.add(WireCounters.PEERS, len(group_info.peer_ids))
        return gathered


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


def _signing_key(node: SwarmNode) -> RSAPrivateKey:
    """The private key of the node's DHT signature validator (SwarmNode exposes no accessor yet)."""
    return node.identity_key


class HivemindTrainingPeer:
    """A trainer whose averaging is ``hivemind.Optimizer``; the same public interface as TrainingPeer.

    ``deltas`` and ``params`` (the gossip averagers) are ``None``; one hivemind epoch is one "sync"
    (one ``on_sync`` report, one ``progress.round``).
    """

    def __init__(
        self,
        config: RunConfig,
        network: NetworkOptions,
        *,
        public_name: str = "",
        resume: bool = False,
        on_sync: Callable[[SyncReport], None] | None = None,
    ):
        if network.swarm_key is not None:  # hivemind's averaging RPCs would be open to anyone
            raise ValueError("averaging.backend 'hivemind' cannot run in a private swarm; use 'gossip'")
        self.config, self._on_sync = config, on_sync
        self.device = resolve_device(config.train.device)
        self.source = open_source(config.data)
        self.model = build_model(config.model, config.run.seed).to(self.device)
        self.n_params = count_parameters(self.model)
        self.eval_set = make_eval_set(self.source, config.model.block_size)
        self.progress = Progress()
        self.total_samples = total_samples_of(config.train, config.run.target_samples)
        self.deltas = self.params = None
        self.wire = WireCounters()
        self._state = "joining"
        self._state_hash = ""  # we serve no swarm state transfer: hivemind joiners use its own
        self._last_checkpoint = time.monotonic()
        self._reported = self.wire.snapshot()
        self._joined_samples = 0  # read by TrainingPeer._swarm_samples; hivemind joiners load no snapshot

        device_name, memory = describe_device(str(self.device))
        info = NodeInfo(config.run.run_id, config.config_hash(), "trainer", public_name, device_name, memory)
        self.node = SwarmNode(
            network,
            info,
            status=self._status,
            record_interval_s=config.network.record_interval_s,
            record_ttl_s=config.network.record_ttl_s,
        )
        self.optimizer: CountingOptimizer | None = None
        try:
            self.optimizer = make_hivemind_optimizer(
                config, self.node.dht, self.model, self.wire, _signing_key(self.node)
            )
            self.inner = InnerTrainer(
                self.model,
                config.train,
                self.device,
                optimizer=self.optimizer,
                block_size=config.model.block_size,
            )
            self.resumed_from = self._resume() if resume else None
        except BaseException:
            self.close()
            raise
        self._epoch = self.optimizer.local_epoch
        self.batches = TrainBatches(
            self.source,
            config.model.block_size,
            config.train.batch_size,
            peer_key=self.node.peer_id,
            seed=config.run.seed,
            start_sample=self.progress.samples_drawn,
        )

    # What does not depend on the averaging backend is TrainingPeer's own code.
    _schedule_progress = TrainingPeer._schedule_progress
    _finished = TrainingPeer._finished
    _swarm_samples = TrainingPeer._swarm_samples
    _status = TrainingPeer._status
    _maybe_checkpoint = TrainingPeer._maybe_checkpoint
    save_checkpoint = TrainingPeer.save_checkpoint

    def run(self, stop: threading.Event, *, max_steps: int | None = None) -> None:
        """Train until ``stop`` is set, ``max_steps`` (or ``train.max_steps``) or the swarm's target."""
        max_steps = max_steps or self.config.train.max_steps
        self._state = "training"
        while not stop.is_set() and not self._finished(max_steps):
            self._inner_step()
            if self.optimizer.local_epoch != self._epoch:
                self._epoch_done()
                self._maybe_checkpoint()
        self._state = "leaving"

    def join_swarm(self) -> None:
        """hivemind catches up by itself: a peer behind the swarm's epoch downloads state in ``step``."""

    def _inner_step(self) -> None:
        lr = lr_at(self._schedule_progress(), self.config.train, self.total_samples)
        for group in self.optimizer.opt.param_groups:  # Optimizer.param_groups are copies
            group["lr"] = lr
        waited_before = self.optimizer.communication_seconds
        stats = self.inner.step(self.batches)
        waited = self.optimizer.communication_seconds - waited_before
        self.progress.samples_drawn = self.batches.samples_drawn
        self.progress.record_step(
            stats.samples, stats.loss, stats.seconds, max(stats.compute_seconds - waited, 0.0)
        )

    def _epoch_done(self) -> None:
        """After a hivemind epoch transition: evaluate, and report it like a gossip sync."""
        self._state = "syncing"
        self._epoch = self.optimizer.local_epoch
        weight = self.progress.samples_since_sync
        self.progress.samples_since_sync = 0
        self.progress.round += 1
        if self.progress.round % self.config.train.eval_every_rounds == 0:
            self.progress.eval_loss = evaluate(self.model, self.eval_set, self.config.train.eval_batches)
        self.progress.swarm_samples = self._swarm_samples()
        self._state = "training"
        self._report(weight)

    def _report(self, weight: float) -> None:
        now = self.wire.snapshot()
        sent, received, rounds, peers = (a - b for a, b in zip(now, self._reported, strict=True))
        self._reported = now
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
                outcome="ok" if rounds else "no_group",
                partner=f"{peers / rounds:.1f} peers" if rounds else None,
                bytes_sent=sent,
                bytes_received=received,
                drift=None,
                lr=self.optimizer.opt.param_groups[0]["lr"],
                weight=weight,
            )
        )

    def gossip_metrics(self) -> GossipMetrics:
        """Measured wire bytes; ``exchanges_ok`` counts completed all-reduce rounds."""
        sent, received, rounds, _ = self.wire.snapshot()
        return GossipMetrics(exchanges_ok=rounds, bytes_sent=sent, bytes_received=received)

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "inner_optimizer": self.optimizer.state_dict(),  # includes hivemind's local epoch
            "progress": self.progress.checkpoint_state(),
            "config_hash": self.config.config_hash(),
        }

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
        self.optimizer.load_state_dict(state["inner_optimizer"])
        self.progress.restore(state["progress"])
        return path

    def close(self) -> None:
        """Say goodbye to the hivemind run, stop its averager process, then leave the swarm."""
        optimizer, self.optimizer = getattr(self, "optimizer", None), None
        if optimizer is not None:
            optimizer.shutdown()
        self.node.close()
