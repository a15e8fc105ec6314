r"""Event-driven simulator of gossip averaging rules: N in-process peers on their own clocks, over links
of a given rate and latency, with churn and disagreeing membership views (docs/simulator.md).

    .venv/bin/python -m scripts.simulate --rules late,factored-int4 --peers 4,8 --samples 2400
    .venv/bin/python -m scripts.simulate --rules late --peers 8 --step-times 0.1x3,0.3 --json
    .venv/bin/python -m scripts.simulate --peers 64 --samples 9600 --churn-per-min 0.1 \
        --model model.n_embd=32,model.n_layer=1
    .venv/bin/python -m scripts.simulate --rules late --views full,sample,lookup --peers 1000 ...
    .venv/bin/python -m scripts.simulate --calibrate                   # the testbed's scaling regime

Every rule at every N runs over the same number of samples in all (``--samples``, a full cosine
schedule unless ``--flat``), and its final loss is the held-out loss of the live peers' mean model on
``--eval-batches`` batches of 32 windows. ``allreduce`` (exact, the reference for the gap) and
data-parallel (one device of batch N, ``scripts/probe_outer.py``) run beside the rules unless
``--no-baselines``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor

from scripts import _probe_run
from scripts._sim_engine import SimConfig, Simulation
from scripts._sim_rules import named
from scripts._sim_views import KINDS as VIEWS

DEFAULT_RULES = ",".join(
    [
        "late",
        "based-int4",
        "based-int4-blocking",
        "factored-int4",
        "factored-int4-blocking",
        "factored-int8",
        "factored-topk",
    ]
)
TRAINER_RULE = "based-int4"
"""The rule the trainer runs (swarm/gossip/_bases.py: int8 bases, int4 deltas, a base still crossing
waited for up to half a round)."""
CALIBRATION = {
    "step_times": "0.1",
    "rate_mbit": 4.0,
    "cosine": False,
    "stop_at_target": True,
    "target": 3.6,
    "eval_every": 40,
    "curve_batches": 1,
    "peer_curve": True,
    "samples": 12000,
}
"""The testbed's scaling regime (scripts/_runner.py ``REGIME``, scripts/_plans.py ``GOSSIP``): 0.1 s
emulated steps, 4 Mbit/s links (the bench's rate for its step: ``--step-time 0.25`` there means 1.5
Mbit/s), a flat lr after the warm-up, H = 5, lag up to 3 rounds, samples until
the mean of the trainers' own held-out losses (one batch each, as they evaluate) reaches 3.6 bits/byte."""


def _say(label: str) -> object:
    def say(text: str) -> None:
        print(f"[{label}] {text}", file=sys.stderr, flush=True)

    return say


def run_one(task: tuple[str, str, int, SimConfig | _probe_run.Probe, bool]) -> dict:
    """One row: a simulated rule, or the data-parallel baseline of the probe."""
    rule, label, n, cfg, quiet = task
    if isinstance(cfg, _probe_run.Probe):
        result = _probe_run.run(cfg)
        return {"rule": rule, "peers": n, "final_loss": result["final_loss_averaged_model"]}
    sim = Simulation(cfg, progress=None if quiet else _say(label))  # type: ignore[arg-type]
    return {"rule": rule, "peers": n, "seed": cfg.seed, "view": cfg.view, **sim.run()}


def plan(args: argparse.Namespace) -> list[tuple]:
    """``(rule, label, N, config, quiet)`` for every rule, view, N and seed, the baselines first
    (all-reduce needs no view: it runs with the first)."""
    rules = [r for r in args.rules.split(",") if r]
    views = [v for v in args.views.split(",") if v]
    if args.baselines and "allreduce" not in rules:
        rules = ["allreduce", *rules]
    sets = tuple(s for s in args.model.split(",") if s)
    tasks: list[tuple] = []
    for n in (int(x) for x in args.peers.split(",")):
        samples = args.samples
        if args.baselines and not args.flat:
            probe = _probe_run.Probe(
                mode="solo", batch=n, lr=args.lr, steps=samples // n, cosine=True,
                eval_every=samples // n, eval_batches=args.eval_batches, target=args.target,
                model=",".join(sets),
            )  # fmt: skip
            tasks.append(("data-parallel", f"data-parallel N={n}", n, probe, args.quiet))
        for name, view in ((name, view) for name in rules for view in views):
            if name == "allreduce" and view != views[0]:
                continue
            for seed in range(args.seed, args.seed + args.seeds):
                cfg = SimConfig(
                    rule=named(name, args.sync_every, args.max_lag),
                    peers=n,
                    samples=samples,
                    step_times=args.step_times,
                    step_jitter=args.step_jitter,
                    rate_mbit=args.rate_mbit,
                    goodput=args.goodput,
                    latency_s=args.latency_ms / 1000,
                    dial_s=args.dial_ms / 1000 if args.dial_ms is not None else None,
                    exchange_overhead_s=args.exchange_overhead_s,
                    clock_round_s=args.clock_round_s,
                    base_wait_rounds=args.base_wait_rounds,
                    churn_per_min=args.churn_per_min,
                    join_delay_s=args.join_delay_s,
                    view_refresh_s=args.view_refresh_s,
                    record_ttl_s=args.record_ttl_s,
                    view=view,
                    cosine=not args.flat,
                    lr=args.lr,
                    target=args.target,
                    stop_at_target=args.stop_at_target,
                    eval_every=args.eval_every,
                    curve_batches=args.curve_batches,
                    peer_curve=args.peer_curve,
                    eval_batches=args.eval_batches,
                    model_sets=sets,
                    training=not args.consensus_only,
                    init_spread=args.consensus_only or 0.0,
                    seed=seed,
                )
                tasks.append((name, f"{name} {view} N={n} seed={seed}", n, cfg, args.quiet))
    return tasks


def add_gaps(rows: list[dict]) -> list[dict]:
    """Each row's final loss against exact all-reduce's and data-parallel's at the same N (the mean
    over seeds of the reference)."""
    ref: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if row.get("final_loss") is not None:
            ref.setdefault((row["rule"], row["peers"]), []).append(row["final_loss"])
    for row in rows:
        for base, key in (("allreduce", "gap_vs_allreduce"), ("data-parallel", "gap_vs_dataparallel")):
            losses = ref.get((base, row["peers"]))
            if losses and row.get("final_loss") is not None:
                row[key] = round(row["final_loss"] / (sum(losses) / len(losses)) - 1, 4)
    return rows


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value * 100:+.2f}%"


def table(rows: list[dict]) -> str:
    """The markdown table of the rows (one line per rule, view, N and seed)."""
    head = (
        "| rule | view | N | seed | final loss | vs all-reduce | vs data-parallel | B/param overlapped | "
        "B/param critical | idle mean / max | exchanges (fallbacks, aborted) | pairing (scheduled) | "
        "membership B/s per peer | samples to target | sim s | spread at end |"
    )
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in rows:
        gaps = f"{_pct(r.get('gap_vs_allreduce'))} | {_pct(r.get('gap_vs_dataparallel'))}"
        if "bytes_per_param_per_round" not in r:  # data-parallel: a loss and nothing else
            lines.append(f"| {r['rule']} | | {r['peers']} | | {r['final_loss']} | {gaps} |" + " |" * 9)
            continue
        b, idle, ex, pair = r["bytes_per_param_per_round"], r["idle_share"], r["exchanges"], r["pairing"]
        spread = r["curve"][-1][3] if r["curve"] else ""
        scheduled = pair["scheduled_partner"] / pair["initiated"] if pair["initiated"] else 0.0
        lines.append(
            f"| {r['rule']} | {r['view']} | {r['peers']} | {r['seed']} | {r['final_loss']} | {gaps} | "
            f"{b['overlapped']} | {b['critical']} | {idle['mean']:.3f} / {idle['max']:.3f} | "
            f"{ex['committed']} ({ex['fallbacks']}, {ex['aborted']}) | {pair['success']} ({scheduled:.2f}) | "
            f"{r['membership']['bytes_per_peer_s']} | {r['samples_to_target']} | {r['sim_time_s']} | "
            f"{spread} |"
        )
    return "\n".join(lines)


def _results(tasks: list[tuple], jobs: int) -> Iterator[dict]:
    """The runs' rows in plan order, each as soon as it and those before it are done."""
    if jobs <= 1:
        yield from map(run_one, tasks)
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        yield from pool.map(run_one, tasks)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = SimConfig(rule=named("late", 5, None))
    add = p.add_argument
    add(
        "--rules", default=DEFAULT_RULES, help="comma-separated (scripts/_sim_rules.py RULES; name@h10 for H)"
    )
    add("--peers", default="4,8", help="comma-separated N")
    add("--samples", type=int, default=defaults.samples, help="samples in all, per run")
    add("--step-times", default=defaults.step_times, help="0.1 | 0.1x3,0.3 (cycled) | lognormal:0.1:0.3")
    add("--step-jitter", type=float, default=0.0, help="log-normal sigma of each step's time")
    add("--rate-mbit", type=float, default=defaults.rate_mbit, help="each peer's link, each way")
    add(
        "--goodput",
        type=float,
        default=defaults.goodput,
        help="share of the link rate a message gets (TCP's headers: 0.957)",
    )
    add("--latency-ms", type=float, default=defaults.latency_s * 1000)
    add("--dial-ms", type=float, default=None, help="ms per partner dialled, busy or not (a round trip)")
    add("--exchange-overhead-s", type=float, default=0.0, help="fixed seconds before an exchange's bytes")
    add("--clock-round-s", type=float, default=0.0, help="schedule rounds by a shared clock (0: exchanges)")
    add("--base-wait-rounds", type=float, default=0.5, help="based: rounds to wait for a base still crossing")
    add("--churn-per-min", type=float, default=0.0, help="share of N replaced per minute")
    add("--join-delay-s", type=float, default=defaults.join_delay_s)
    add("--view-refresh-s", type=float, default=defaults.view_refresh_s)
    add("--record-ttl-s", type=float, default=defaults.record_ttl_s, help="a membership record's lifetime")
    add("--views", default="full", help=f"comma-separated membership designs: {', '.join(VIEWS)}")
    add("--sync-every", type=int, default=5, help="H, inner steps per round")
    add("--max-lag", type=int, default=None, help="rounds a non-blocking exchange may lag (default 3)")
    add("--lr", type=float, default=defaults.lr, help="inner AdamW peak lr")
    add("--flat", action="store_true", help="flat lr after the warm-up instead of a cosine over --samples")
    add("--target", type=float, default=defaults.target, help="bits/byte for samples to target")
    add("--stop-at-target", action="store_true")
    add("--eval-every", type=int, default=0, help="samples between curve points (0: samples / 24)")
    add("--curve-batches", type=int, default=defaults.curve_batches)
    add("--peer-curve", action="store_true", help="curve of the peers' mean loss, not their mean model's")
    add("--eval-batches", type=int, default=defaults.eval_batches, help="batches of the final loss")
    add(
        "--consensus-only",
        type=float,
        metavar="SPREAD",
        help="no training: the models start SPREAD apart (relative to their norm) and only averaging runs",
    )
    add("--model", default="", help="config overrides, e.g. model.n_embd=32,model.n_layer=1")
    add("--seed", type=int, default=0)
    add("--seeds", type=int, default=1, help="runs per rule and N, seeds --seed, --seed + 1, ...")
    add("--no-baselines", dest="baselines", action="store_false", help="no all-reduce and data-parallel rows")
    add(
        "--calibrate",
        action="store_true",
        help=f"the testbed's scaling regime, N = 4 and 8, rule {TRAINER_RULE}; other options override it",
    )
    add("--jobs", type=int, default=1, help="runs side by side (processes)")
    add("--quiet", action="store_true", help="no progress lines on stderr")
    add("--json", action="store_true", help="one JSON row per run instead of the table")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The options; with ``--calibrate``, :data:`CALIBRATION` and the trainer's rule are the defaults
    and any option given still wins (``--step-times 0.25 --rate-mbit 1.5`` for a longer step)."""
    p = parser()
    if p.parse_args(argv).calibrate:
        calibration = {
            ("flat" if k == "cosine" else k): (not v if k == "cosine" else v) for k, v in CALIBRATION.items()
        }
        p.set_defaults(**calibration, rules=TRAINER_RULE, baselines=False)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    tasks = plan(args)
    rows: list[dict] = []
    try:
        for row in _results(tasks, args.jobs):
            rows.append(row)
            add_gaps(rows)
            if args.json:  # as each run ends (the baselines of an N come before its rules)
                print(json.dumps(row), flush=True)
            print(
                f"[done] {row['rule']} N={row['peers']}: final loss {row['final_loss']}",
                file=sys.stderr,
                flush=True,
            )
    except KeyboardInterrupt:
        print(f"interrupted: {len(rows)} of {len(tasks)} runs done", file=sys.stderr, flush=True)
        if rows and not args.json:
            print(table(rows), flush=True)
        return 130
    if not args.json:
        print(table(rows))
        print(json.dumps({"settings": vars(args)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
