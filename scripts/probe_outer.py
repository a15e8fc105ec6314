"""In-process probe of DiLoCo outer rules: how many inner steps N batch-1 peers need to reach a target.

No network and no processes: N models, optimizers and data shards in one process, stepped in lock
step, with the averaging done exactly (or by random pairs) in memory. It separates what the averaging
*rule* costs in samples from what the network and the machine cost, which the testbed report
(`scripts/bench_report.py`) measures together. docs/benchmarks.md, "Choosing the regime", quotes it.

    .venv/bin/python scripts/probe_outer.py --mode solo                    # one device, batch 1
    .venv/bin/python scripts/probe_outer.py --mode solo --batch 4          # ideal data-parallel, 4 devices
    .venv/bin/python scripts/probe_outer.py --mode allreduce --peers 4 --sync-every 5
    .venv/bin/python scripts/probe_outer.py --mode gossip --peers 4 --sync-every 5 --anchor-pull 1
    .venv/bin/python scripts/probe_outer.py --grid --jobs 2 --json         # the table in the docs

Modes: ``solo`` (one trainer of ``--batch``), ``allreduce`` (every ``--sync-every`` steps all peers
apply the exact mean pseudo-gradient: OpenDiLoCo), ``gossip`` (a random perfect matching; each pair
applies its mean pseudo-gradient, as the gossip trainer does, and with ``--anchor-pull P`` first moves
the two anchors a fraction P of the way together, every ``--pull-every`` rounds, each side seeing the
other's anchor through ``--pull-codec`` and only 1 / ``--pull-fragments`` of the tensors moving per
round; P = 1 with outer lr 1 and no momentum is pairwise model averaging). The loss is the peers'
mean held-out loss, evaluated every ``--eval-every`` steps on ``--eval-batches`` batches of 32 windows.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from swarm.compression import get_codec
from swarm.config import load_config
from swarm.training import (
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
    anchor_pull: float = 0.0
    pull_every: int = 1
    pull_fragments: int = 1
    pull_codec: str = "fp32"
    steps: int = 1600
    eval_every: int = 40
    eval_batches: int = 4
    target: float = 3.6
    seed: int = 0


def _pull(outers: list[OuterOptimizer], a: int, b: int, probe: Probe, round_: int) -> None:
    """Move the anchors of ``a`` and ``b`` a fraction ``anchor_pull`` of the way together; each side sees
    the other's anchor through ``pull_codec``, and only the tensors of this round's fragment move."""
    codec = get_codec(probe.pull_codec)
    for index, (name, anchor_a) in enumerate(outers[a].anchor.items()):
        if index % probe.pull_fragments != round_ % probe.pull_fragments:
            continue
        anchor_b = outers[b].anchor[name]
        seen_by_a, seen_by_b = codec.roundtrip(anchor_b).clone(), codec.roundtrip(anchor_a).clone()
        anchor_a.add_((seen_by_a - anchor_a) * (probe.anchor_pull / 2))
        anchor_b.add_((seen_by_b - anchor_b) * (probe.anchor_pull / 2))


def _pair_round(outers: list[OuterOptimizer], probe: Probe, round_: int, rng: random.Random) -> None:
    grads = [outer.pseudo_gradient() for outer in outers]
    order = list(range(len(outers)))
    rng.shuffle(order)
    for a, b in zip(order[0::2], order[1::2], strict=False):
        if probe.anchor_pull and round_ % probe.pull_every == 0:
            _pull(outers, a, b, probe, round_)
        mean = {name: (grads[a][name] + grads[b][name]) / 2 for name in grads[a]}
        outers[a].apply(mean)
        outers[b].apply(mean)
    if len(order) % 2:
        outers[order[-1]].apply(grads[order[-1]])


def _spread(outers: list[OuterOptimizer]) -> float:
    """RMS relative distance of the peers' anchors to their mean."""
    names = list(outers[0].anchor)
    mean = {name: sum(outer.anchor[name] for outer in outers) / len(outers) for name in names}
    num = sum(float((o.anchor[n] - mean[n]).pow(2).sum()) for o in outers for n in names) / len(outers)
    den = sum(float(mean[n].pow(2).sum()) for n in names)
    return (num / den) ** 0.5


@torch.no_grad()
def _sync(outers: list[OuterOptimizer], probe: Probe, round_: int, rng: random.Random) -> None:
    if probe.mode == "allreduce":
        grads = [outer.pseudo_gradient() for outer in outers]
        mean = {name: sum(grad[name] for grad in grads) / len(grads) for name in grads[0]}
        for outer in outers:
            outer.apply(mean)
    elif probe.mode == "gossip":
        _pair_round(outers, probe, round_, rng)


def run(probe: Probe) -> dict:
    """Train until the mean held-out loss reaches ``probe.target`` or ``probe.steps`` pass."""
    if probe.mode not in ("solo", "allreduce", "gossip"):
        raise ValueError(f"unknown mode {probe.mode!r}: solo, allreduce or gossip")
    torch.set_num_threads(1)
    sets = [
        f"train.batch_size={probe.batch}",
        f"train.lr={probe.lr}",
        f"train.micro_batch_size={probe.batch}",
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
    rng = random.Random(probe.seed)
    curve: list[tuple[int, float, float]] = []
    for step in range(1, probe.steps + 1):
        lr = lr_at((step - 1) * peers * probe.batch, config.train, None)  # the swarm's warm-up, then flat
        for trainer, batch in zip(trainers, batches, strict=True):
            trainer.step(batch, lr=lr)
        if step % probe.sync_every == 0:
            _sync(outers, probe, step // probe.sync_every, rng)
        if step % probe.eval_every == 0:
            loss = sum(evaluate(t.model, eval_set, batches=probe.eval_batches) for t in trainers) / peers
            curve.append((step, round(loss, 4), round(_spread(outers), 4)))
            if loss <= probe.target:
                break
    reached = curve[-1][0] if curve and curve[-1][1] <= probe.target else None
    return {
        "probe": asdict(probe),
        "steps_to_target": reached,
        "samples_to_target": reached and reached * peers * probe.batch,
        "curve": curve,
    }


def grid(peers: int, steps: int) -> list[Probe]:
    """The table of docs/benchmarks.md: one device, ideal data-parallel, all-reduce and gossip rules."""
    base = Probe(peers=peers, steps=steps)
    rows = [replace(base, mode="solo"), replace(base, mode="solo", batch=peers)]
    for h in (20, 5):
        rows.append(replace(base, mode="allreduce", sync_every=h))
        rows.append(replace(base, mode="gossip", sync_every=h))
        rows.append(replace(base, mode="gossip", sync_every=h, anchor_pull=1.0))
    rows.append(replace(base, mode="gossip", sync_every=5, anchor_pull=1.0, pull_every=4))
    rows.append(replace(base, mode="gossip", sync_every=5, anchor_pull=1.0, pull_fragments=4))
    for codec in ("int8", "int4"):
        rows.append(replace(base, mode="gossip", sync_every=5, anchor_pull=1.0, pull_codec=codec))
    return rows


def _label(probe: Probe) -> str:
    if probe.mode == "solo":
        return f"solo, batch {probe.batch}"
    pull = f", anchor pull {probe.anchor_pull:g} every {probe.pull_every}" if probe.anchor_pull else ""
    if probe.anchor_pull and (probe.pull_fragments > 1 or probe.pull_codec != "fp32"):
        pull += f" ({probe.pull_codec}, 1/{probe.pull_fragments} of the tensors a round)"
    outer = f"outer lr {probe.outer_lr:g}, momentum {probe.outer_momentum:g}"
    return f"{probe.mode} x{probe.peers}, H = {probe.sync_every}, {outer}{pull}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Probe()
    for field, value in asdict(defaults).items():
        parser.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    parser.add_argument("--grid", action="store_true", help="run the docs' table instead of one probe")
    parser.add_argument("--jobs", type=int, default=1, help="probes run side by side with --grid")
    parser.add_argument("--json", action="store_true", help="print one JSON object per probe")
    args = vars(parser.parse_args(argv))
    flags = {key: args.pop(key) for key in ("grid", "jobs", "json")}
    probes = grid(args["peers"], args["steps"]) if flags["grid"] else [Probe(**args)]
    with ProcessPoolExecutor(max_workers=max(1, flags["jobs"])) as pool:
        for probe, result in zip(probes, pool.map(run, probes), strict=True):
            if flags["json"]:
                print(json.dumps(result), flush=True)
            else:
                step = result["steps_to_target"]
                reached = f"{step} steps" if step else f"not in {probe.steps} steps"
                last = result["curve"][-1] if result["curve"] else None
                print(f"{_label(probe)}: {probe.target} bits/byte after {reached} (last {last})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
