"""The probe's in-process run (``scripts/probe_outer.py``), shared with ``scripts/simulate.py``: a
:class:`Probe` describes N batch-1 peers and their outer rule, and :func:`run` trains them in lock step
with the averaging done in memory (``scripts/_probe_rules.py``)."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from scripts._probe_rules import Pending, groups_of, land, meet, spread
from swarm.compression import get_codec
from swarm.config import load_config
from swarm.learning import (
    InnerTrainer,
    OuterOptimizer,
    TrainBatches,
    build_model,
    evaluate,
    lr_at,
    make_eval_set,
    open_source,
)

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "local-tiny.yaml"


@dataclass(frozen=True)
class Probe:
    mode: str = "gossip"
    peers: int = 4
    batch: int = 1
    lr: float = 1e-3
    sync_every: int = 20
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    exchange: str = "pseudo-gradient"
    schedule: str = "random"
    group: int = 2
    lag: int = 0
    codec: str = "fp32"
    anchor_pull: float = 0.0
    pull_every: int = 1
    pull_fragments: int = 1
    pull_codec: str = "fp32"
    steps: int = 1600
    cosine: bool = False
    eval_every: int = 40
    eval_batches: int = 4
    target: float = 3.6
    seed: int = 0
    model: str = ""
    """Config overrides, comma-separated (``model.n_embd=32,model.n_layer=1``): a smaller model."""


@torch.no_grad()
def _pull(outers: list[OuterOptimizer], a: int, b: int, probe: Probe, round_: int) -> None:
    """Move the anchors (and the models with them) of ``a`` and ``b`` a fraction ``anchor_pull`` of the
    way together; each side sees the other's anchor through ``pull_codec``, and only the tensors of this
    round's fragment move."""
    codec = get_codec(probe.pull_codec)
    shifts: dict[int, dict[str, torch.Tensor]] = {a: {}, b: {}}
    for index, (name, anchor_a) in enumerate(outers[a].anchor.items()):
        if index % probe.pull_fragments != round_ % probe.pull_fragments:
            continue
        anchor_b = outers[b].anchor[name]
        seen_by_a, seen_by_b = codec.roundtrip(anchor_b).clone(), codec.roundtrip(anchor_a).clone()
        shifts[a][name] = (seen_by_a - anchor_a) * (probe.anchor_pull / 2)
        shifts[b][name] = (seen_by_b - anchor_b) * (probe.anchor_pull / 2)
    for peer, shift in shifts.items():
        params = outers[peer].copy_parameters()
        outers[peer].load_parameters({name: params[name] + moved for name, moved in shift.items()})
        for name, moved in shift.items():
            outers[peer].anchor[name].add_(moved)


@torch.no_grad()
def _sync(
    outers: list[OuterOptimizer],
    probe: Probe,
    round_: int,
    rng: random.Random,
    pending: dict[int, Pending] | None = None,
) -> None:
    """One round at the end of round ``round_``: the updates due land, then the free peers meet; what
    they compute lands ``probe.lag`` rounds later (at once with lag 0)."""
    pending = {} if pending is None else pending
    for peer in [peer for peer, update in pending.items() if update.due <= round_]:
        land(outers[peer], pending.pop(peer))
    free = [peer for peer in range(len(outers)) if peer not in pending]
    if probe.mode == "allreduce":
        groups = [free]
    else:
        groups = groups_of(free, probe.schedule, probe.group, round_, rng)
    for group in groups:
        if len(group) == 1:  # nobody to meet: an outer step on its own pseudo-gradient
            grads = {group[0]: outers[group[0]].pseudo_gradient()}
        else:
            grads = meet(outers, group, probe.exchange, probe.codec)
            if probe.anchor_pull and len(group) == 2 and round_ % probe.pull_every == 0:
                _pull(outers, group[0], group[1], probe, round_)
        for peer in group:
            snapshot = outers[peer].copy_parameters()
            pending[peer] = Pending(grads[peer], snapshot, round_ + probe.lag)
    if probe.lag == 0:
        for peer in list(pending):
            land(outers[peer], pending.pop(peer))


def _average_into(model: torch.nn.Module, trainers: list[InnerTrainer]) -> torch.nn.Module:
    """``model`` with the mean of the peers' parameters: the one model an export would produce."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(sum(dict(t.model.named_parameters())[name] for t in trainers) / len(trainers))
    return model


def _check(probe: Probe) -> None:
    if probe.mode not in ("solo", "allreduce", "gossip"):
        raise ValueError(f"unknown mode {probe.mode!r}: solo, allreduce or gossip")
    if probe.exchange not in ("pseudo-gradient", "model"):
        raise ValueError(f"unknown exchange {probe.exchange!r}: pseudo-gradient or model")
    if probe.group < 2 or probe.lag < 0:
        raise ValueError(f"need group >= 2 and lag >= 0, got {probe.group} and {probe.lag}")


def run(probe: Probe) -> dict:
    """Train until the mean held-out loss reaches ``probe.target`` or ``probe.steps`` pass; with
    ``cosine``, run all the steps (a full cosine schedule) and report the final losses too."""
    _check(probe)
    torch.set_num_threads(1)
    sets = [
        f"train.batch_size={probe.batch}",
        f"train.lr={probe.lr}",
        f"train.micro_batch_size={probe.batch}",
        *(s for s in probe.model.split(",") if s),
    ]
    config = load_config(CONFIG, sets, env={})
    source = open_source(config.data)
    eval_set = make_eval_set(source, config.model.block_size)
    peers = 1 if probe.mode == "solo" else probe.peers
    trainers, outers, batches = [], [], []
    for index in range(peers):
        model = build_model(config.model, seed=config.run.seed)
        trainer = InnerTrainer(model, config.train, torch.device("cpu"), block_size=config.model.block_size)
        trainers.append(trainer)
        outers.append(OuterOptimizer(trainer.model, probe.outer_lr, probe.outer_momentum, nesterov=True))
        batches.append(
            TrainBatches(source, config.model.block_size, probe.batch, f"peer-{index}", config.run.seed)
        )
    averaged = build_model(config.model, seed=config.run.seed)
    rng = random.Random(probe.seed)
    pending: dict[int, Pending] = {}
    curve: list[tuple[int, float, float, float]] = []
    reached = None
    for step in range(1, probe.steps + 1):
        if probe.cosine:  # every device's own schedule over its steps: warm-up, then cosine to the end
            lr = lr_at((step - 1) * probe.batch, config.train, probe.steps * probe.batch)
        else:  # the swarm's warm-up, then flat
            lr = lr_at((step - 1) * peers * probe.batch, config.train, None)
        for trainer, batch in zip(trainers, batches, strict=True):
            trainer.step(batch, lr=lr)
        if step % probe.sync_every == 0 and peers > 1:
            _sync(outers, probe, step // probe.sync_every, rng, pending)
        if step % probe.eval_every == 0 or step == probe.steps:
            loss = sum(evaluate(t.model, eval_set, batches=probe.eval_batches) for t in trainers) / peers
            mean_model = evaluate(_average_into(averaged, trainers), eval_set, batches=probe.eval_batches)
            spread_now = round(spread(outers), 4) if peers > 1 else 0.0
            curve.append((step, round(loss, 4), round(mean_model, 4), spread_now))
            if reached is None and loss <= probe.target:
                reached = step
                if not probe.cosine:
                    break
    return {
        "probe": asdict(probe),
        "steps_to_target": reached,
        "samples_to_target": reached and reached * peers * probe.batch,
        "final_loss": curve[-1][1] if curve else None,
        "final_loss_averaged_model": curve[-1][2] if curve else None,
        "curve": curve,
    }
