"""What the simulator's parts share without importing the engine: its settings, its counters, and the
view of the simulation (:class:`Host`) that membership views read. The engine
(``scripts/_sim_engine.py``) builds the parts and is the only module that imports them all."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

from scripts._sim_net import Clock
from scripts._sim_peer import Peer
from scripts._sim_rules import Rule


@dataclass(frozen=True)
class SimConfig:
    rule: Rule
    peers: int = 4
    samples: int = 2400
    step_times: str = "0.1"
    step_jitter: float = 0.0
    rate_mbit: float = 4.0
    goodput: float = 0.957
    latency_s: float = 0.005
    dial_s: float | None = None
    """Seconds a dial costs the initiator, answered busy or accepted (a handshake); None: a round
    trip. On loaded links the trainer's handshakes take far longer than a round trip."""
    exchange_overhead_s: float = 0.0
    """Seconds every exchange spends before its first byte (handshake, lookups, encoding): what the
    real trainer has beyond the bytes, for calibration."""
    clock_round_s: float = 0.0
    """Seconds per schedule round by a clock all peers share; 0: rounds counted by exchanges (each
    leaves the pair at ``max(r_i, r_j) + 1``), as the trainer counts them."""
    base_wait_rounds: float = 0.5
    """``based``: how long (in rounds) an exchange waits for its pair's base still crossing."""
    churn_per_min: float = 0.0
    join_delay_s: float = 5.0
    view_refresh_s: float = 2.0
    view: str = "full"
    """The membership design (``scripts/_sim_views.py`` KINDS)."""
    record_ttl_s: float = 8.0
    max_attempts: int = 4
    cosine: bool = True
    lr: float = 1e-3
    target: float = 3.6
    stop_at_target: bool = False
    eval_every: int = 0
    curve_batches: int = 2
    peer_curve: bool = False
    """The curve (and samples to target) on the mean of the peers' own losses, as the testbed's, instead
    of the loss of their mean model."""
    eval_batches: int = 16
    training: bool = True
    model_sets: tuple[str, ...] = ()
    init_spread: float = 0.0
    seed: int = 0


@dataclass
class Counters:
    initiated: int = 0
    paired: int = 0
    scheduled: int = 0
    solo: int = 0
    fallbacks: int = 0
    factored: int = 0
    aborted: int = 0
    committed: int = 0
    left: int = 0
    joined: int = 0
    exchange_s: list[float] = field(default_factory=list)


class Host(Protocol):
    """What a membership view reads of the simulation."""

    cfg: SimConfig
    clock: Clock
    rng: random.Random
    peers: dict[str, Peer]
