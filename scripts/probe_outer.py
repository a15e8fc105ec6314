"""In-process probe of DiLoCo outer rules: how many inner steps N batch-1 peers need to reach a target.

No network and no processes: N models, optimizers and data shards in one process, stepped in lock
step, with the averaging done in memory (``scripts/_probe_rules.py``). It separates what the
averaging *rule* costs in samples from what the network and the machine cost, which the testbed
report (``scripts/bench_report.py``) measures together. docs/benchmarks.md, "What the averaging rule
costs, in process", quotes it.

    .venv/bin/python -m scripts.probe_outer --mode solo                    # one device, batch 1
    .venv/bin/python -m scripts.probe_outer --mode solo --batch 4          # ideal data-parallel, 4 devices
    .venv/bin/python -m scripts.probe_outer --mode allreduce --peers 4 --sync-every 5
    .venv/bin/python -m scripts.probe_outer --mode gossip --peers 8 --sync-every 5 \
        --exchange model --codec int8 --schedule hypercube --lag 1        # the trainer's default rule
    .venv/bin/python -m scripts.probe_outer --grid --jobs 2 --json         # the older table
    .venv/bin/python -m scripts.probe_outer --scaling --jobs 2 --samples 1600 --target 4.0 --sync-every 5

Modes: ``solo`` (one trainer of ``--batch``), ``allreduce`` (every ``--sync-every`` steps all peers
apply the exact mean pseudo-gradient: OpenDiLoCo), ``gossip`` (the peers meet in pairs, or groups of
``--group``, by ``--schedule``: random or hypercube; each group applies its mean pseudo-gradient
(``--exchange pseudo-gradient``) or averages its models through ``--codec`` (``--exchange model``);
with ``--lag L`` a result lands L rounds later on top of the local progress made meanwhile). With
``--anchor-pull P`` a pseudo-gradient pair first moves its anchors a fraction P of the way together,
every ``--pull-every`` rounds, through ``--pull-codec``, 1 / ``--pull-fragments`` of the tensors per
round. The loss is the peers' mean held-out loss, evaluated every ``--eval-every`` steps on
``--eval-batches`` batches of 32 windows; the loss of the peers' averaged model is reported beside it.
``--cosine true`` runs a full cosine schedule over ``--steps``. ``--scaling`` prints one JSON row per
rule and N (``RULES``; docs/gossip.md explains the fields).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace

from scripts._probe_run import Probe, run


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
    rule = f"{probe.exchange} ({probe.codec}), {probe.schedule} groups of {probe.group}, lag {probe.lag}"
    return f"{probe.mode} x{probe.peers}, H = {probe.sync_every}, {rule}, {outer}{pull}"


RULES: dict[str, dict] = {
    "allreduce": {"mode": "allreduce"},
    "pairs": {"exchange": "pseudo-gradient"},
    "model, random pairs": {"exchange": "model", "codec": "int8"},
    "model, hypercube": {"exchange": "model", "codec": "int8", "schedule": "hypercube"},
    "model, hypercube, lag 1": {"exchange": "model", "codec": "int8", "schedule": "hypercube", "lag": 1},
}
"""The rules ``--scaling`` compares (``Probe`` fields over the gossip mode); groups larger than two
(``--group``) run one at a time."""
DEFAULT_RULE = "model, hypercube, lag 1"
"""The gossip trainer's default: model averaging in one int8 tensor, hypercube partners, applied one
round late on top of the local progress (the trainer overlaps its exchange with the next round)."""
SCALING_PEERS = (2, 4, 8, 16)


def scaling_plan(
    samples: int,
    sync_every: int,
    peers: tuple[int, ...] = SCALING_PEERS,
    target: float = 3.6,
    lrs: tuple[float, ...] = (Probe.lr,),
) -> list[tuple]:
    """``(rule, peers, probe)`` for the scaling table: one device, ideal data-parallel (one device with
    batch N) and every rule at every N, each over ``samples`` samples in all with a full cosine
    schedule, at every inner learning rate of ``lrs`` (:func:`best_per_rule` keeps each one's best)."""

    common = Probe(sync_every=sync_every, cosine=True, eval_batches=2, target=target)

    def base(n: int, lr: float) -> Probe:
        steps = samples // n
        every = max(sync_every, (steps // 24) // sync_every * sync_every)
        return replace(common, peers=n, lr=lr, steps=steps, eval_every=every)

    plan = [("one device", 1, replace(base(1, lr), mode="solo")) for lr in lrs]
    for n in peers:
        for lr in lrs:
            plan.append(("data-parallel", n, replace(base(n, lr), mode="solo", batch=n)))
            plan += [
                (rule, n, replace(base(n, lr), **{"mode": "gossip", **fields}))
                for rule, fields in RULES.items()
            ]
    return plan


def best_per_rule(plan: list[tuple], results: list[dict]) -> tuple[list[tuple], list[dict]]:
    """Of the runs of one rule at one N at several inner learning rates, the one that reached the target
    in the fewest steps (then the lowest final loss), with its ``lr`` added: every rule, the baselines
    included, is compared at the inner lr it wants (Charles et al. find it grows with the peers)."""
    best: dict[tuple, tuple[tuple, dict]] = {}
    for entry, result in zip(plan, results, strict=True):
        rule, n, probe = entry
        kept = best.get((rule, n))
        if kept is None or _rank(result) < _rank(kept[1]):
            best[(rule, n)] = (entry, {**result, "lr": probe.lr if probe is not None else None})
    return [entry for entry, _ in best.values()], [result for _, result in best.values()]


def _rank(result: dict) -> tuple[float, float]:
    return (result["steps_to_target"] or math.inf, result["final_loss_averaged_model"] or math.inf)


def scaling_rows(plan: list[tuple], results: list[dict]) -> list[dict]:
    """The JSON rows of ``--scaling``: speed-up over one device as a share of data-parallel's at the same
    N, and the final loss of the peers' mean model against all-reduce's."""
    by = {(rule, n): result for (rule, n, _), result in zip(plan, results, strict=True)}
    solo = by[("one device", 1)]["steps_to_target"]
    rows = []
    for (rule, n, _probe), result in zip(plan, results, strict=True):
        steps = result["steps_to_target"]
        dp = by.get(("data-parallel", n), {}).get("steps_to_target")
        share = None
        if rule not in ("one device", "data-parallel") and steps and solo and dp:
            share = round((solo / steps) / (solo / dp), 3)
        final = result["final_loss_averaged_model"]
        reference = by.get(("allreduce", n), {}).get("final_loss_averaged_model")
        gap = round(final / reference - 1, 4) if final is not None and reference else None
        row = {
            "rule": rule,
            "peers": n,
            **({"lr": result["lr"]} if "lr" in result else {}),
            "steps_to_target": steps,
            "samples_to_target": result["samples_to_target"],
            "share_of_dataparallel": share,
            "final_loss": final,
            "final_loss_peers_mean": result["final_loss"],
            "final_loss_gap_vs_allreduce": gap if rule not in ("one device", "data-parallel") else None,
        }
        if rule == DEFAULT_RULE:
            row["default"] = True
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Probe()
    for field, value in asdict(defaults).items():
        kind = (lambda text: text.lower() in ("1", "true", "yes")) if isinstance(value, bool) else type(value)
        parser.add_argument("--" + field.replace("_", "-"), type=kind, default=value)
    parser.add_argument("--grid", action="store_true", help="run the docs' table instead of one probe")
    parser.add_argument("--scaling", action="store_true", help="every rule at N = 2..16 (JSON rows)")
    parser.add_argument("--samples", type=int, default=3200, help="samples per run with --scaling")
    parser.add_argument("--scaling-peers", default="2,4,8,16", help="the N of --scaling")
    parser.add_argument(
        "--scaling-lrs", default=None, help="inner lrs of --scaling (0.001,0.002): each rule at its best"
    )
    parser.add_argument("--jobs", type=int, default=1, help="probes run side by side with --grid")
    parser.add_argument("--json", action="store_true", help="print one JSON object per probe")
    args = vars(parser.parse_args(argv))
    names = ("grid", "scaling", "samples", "scaling_peers", "scaling_lrs", "jobs", "json")
    flags = {key: args.pop(key) for key in names}
    if flags["scaling"]:
        peers = tuple(int(n) for n in flags["scaling_peers"].split(","))
        lrs = tuple(float(lr) for lr in (flags["scaling_lrs"] or str(args["lr"])).split(","))
        plan = scaling_plan(flags["samples"], args["sync_every"], peers, args["target"], lrs)
        results = []
        with ProcessPoolExecutor(max_workers=max(1, flags["jobs"])) as pool:
            for (rule, n, _), result in zip(plan, pool.map(run, [p for _, _, p in plan]), strict=True):
                results.append(result)
                print(json.dumps({"rule": rule, "peers": n, **result}), file=sys.stderr, flush=True)
        for row in scaling_rows(*best_per_rule(plan, results)):
            print(json.dumps(row), flush=True)
        return 0
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
