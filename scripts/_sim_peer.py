"""The simulator's peers: one in-process model, inner AdamW, data shard and exchange state each, and
the shared world they are built from (the probe's local-tiny model and stdlib data)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scripts._sim_rules import Tensors, clone
from swarm.config import load_config
from swarm.learning import InnerTrainer, TrainBatches, build_model, evaluate, make_eval_set, open_source

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local-tiny.yaml"


@dataclass
class Prefetch:
    """A partner's anchor as it reached us: its version, the tensors as decoded, when it lands."""

    version: int
    anchor: Tensors
    lands: float


@dataclass
class Peer:
    pid: str
    params: Tensors
    anchor: Tensors
    trainer: InnerTrainer | None
    batches: TrainBatches | None
    step_time: float
    born: float
    version: int = 0
    """Bumped whenever the anchor changes: a prefetched copy of another version is stale."""
    round: int = 0
    round_steps: int = 0
    steps: int = 0
    rounds: int = 0
    alive: bool = True
    died: float | None = None
    view: list[str] = field(default_factory=list)
    """The peers this one could dial (``scripts/_sim_views.py``: all listed, a sample, or fingers)."""
    order: list[str] = field(default_factory=list)
    position: dict[str, int] = field(default_factory=dict)
    """``full``: the view in the shared hash order, and each member's place in it."""
    sample: dict[str, tuple[float, str]] = field(default_factory=dict)
    """``sample``: peer id -> (when last seen alive, who said so)."""
    fingers: dict[int, tuple[str, float]] = field(default_factory=dict)
    neighbours: list[str] = field(default_factory=list)
    dims: int = 1
    """``lookup``: the partner found per dimension (and when), the nearest nodes, and d."""
    membership_sent: float = 0.0
    membership_received: float = 0.0
    exchange: Any = None
    """The exchange in flight (one at a time), or None."""
    lag: int = 0
    """Round ends passed while :attr:`exchange` was in flight."""
    step_pending: bool = False
    blocked: bool = False
    """A blocking exchange holds the device: the step in progress finishes, no new one starts."""
    waiting: str | None = None
    """Why the device is idle: ``"initiate"`` (its round ended while it lags ``max_lag`` rounds),
    ``"step"`` (a blocking exchange), ``"barrier"`` (all-reduce), or None (training)."""
    wait_since: float = 0.0
    idle_s: float = 0.0
    residual: Tensors | None = None
    prefetched: dict[str, Prefetch] = field(default_factory=dict)
    bases: dict[str, Prefetch] = field(default_factory=dict)
    """``based``: the base we share with each partner (its id in ``version``), as both sides decode it."""
    prefetch_sent: set[tuple[str, int]] = field(default_factory=set)
    bytes_overlapped: float = 0.0
    bytes_critical: float = 0.0

    def snapshot(self) -> Tensors:
        return clone(self.params)

    def delta(self) -> Tensors:
        return {name: self.anchor[name] - p.detach() for name, p in self.params.items()}

    @torch.no_grad()
    def set_anchor(self, anchor: Tensors) -> None:
        self.anchor = clone(anchor)
        self.version += 1

    def start_wait(self, reason: str, now: float) -> None:
        self.waiting, self.wait_since = reason, now

    def end_wait(self, now: float) -> str | None:
        reason, self.waiting = self.waiting, None
        if reason is not None:
            self.idle_s += now - self.wait_since
        return reason


class World:
    """The model, data and evaluation every peer of one simulation shares (``--set`` style config
    overrides select a smaller model for large N)."""

    def __init__(self, sets: list[str], training: bool = True, lr: float = 1e-3) -> None:
        base = ["train.batch_size=1", "train.micro_batch_size=1", f"train.lr={lr}"]
        self.config = load_config(CONFIG, base + sets, env={})
        self.training = training
        self.source = open_source(self.config.data)
        self.eval_set = make_eval_set(self.source, self.config.model.block_size)
        self._eval_model = build_model(self.config.model, seed=self.config.run.seed)
        self.shapes = {n: p.numel() for n, p in self._eval_model.named_parameters()}
        self.n_params = sum(self.shapes.values())

    def peer(self, pid: str, step_time: float, now: float, anchor: Tensors | None = None) -> Peer:
        """A peer whose model starts at ``anchor`` (a joiner: a live peer's), else at the seed's init."""
        model = build_model(self.config.model, seed=self.config.run.seed)
        params = dict(model.named_parameters())
        if anchor is not None:
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(anchor[name])
        trainer = batches = None
        if self.training:
            block = self.config.model.block_size
            trainer = InnerTrainer(model, self.config.train, torch.device("cpu"), block_size=block)
            params = dict(trainer.model.named_parameters())
            batches = TrainBatches(self.source, block, 1, pid, self.config.run.seed)
        return Peer(pid, params, clone(params), trainer, batches, step_time, born=now)

    @torch.no_grad()
    def loss_of_mean(self, peers: list[Peer], batches: int) -> float:
        """Held-out loss (bits/byte) of the live peers' mean model: what an export would produce."""
        for name, param in self._eval_model.named_parameters():
            param.copy_(sum(p.params[name].detach() for p in peers) / len(peers))
        return float(evaluate(self._eval_model, self.eval_set, batches=batches))

    @torch.no_grad()
    def mean_loss(self, peers: list[Peer], batches: int) -> float:
        """The mean of the live peers' own held-out losses: what the testbed's curve shows."""
        losses = []
        for peer in peers:
            for name, param in self._eval_model.named_parameters():
                param.copy_(peer.params[name].detach())
            losses.append(float(evaluate(self._eval_model, self.eval_set, batches=batches)))
        return sum(losses) / len(losses)


def step_times(spec: str, count: int, rng: random.Random) -> list[float]:
    """Per-peer seconds per inner step from ``spec``: comma-separated ``seconds[xcount]`` cycled over
    the peers (``0.1x3,0.3``: one in four 3x slower), or ``lognormal:median:sigma``."""
    if spec.startswith("lognormal:"):
        _, median, sigma = spec.split(":")
        return [float(median) * rng.lognormvariate(0.0, float(sigma)) for _ in range(count)]
    pattern: list[float] = []
    for part in spec.split(","):
        seconds, _, times = part.partition("x")
        pattern += [float(seconds)] * (int(times) if times else 1)
    if not pattern or min(pattern) <= 0:
        raise ValueError(f"step times must be positive, got {spec!r}")
    return [pattern[i % len(pattern)] for i in range(count)]
