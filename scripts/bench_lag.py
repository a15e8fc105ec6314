"""How far gossip's exchanges may lag, and how long its rounds: time to target with 4 equal trainers.

The bench regime of the report (docs/benchmarks.md): emulated devices of 0.1 s per step, gossip's H of
``bench_scaling.GOSSIP`` over the report's links, on the testbed (testbed/; needs root). With
``max_lag_rounds`` L a trainer's device waits only when its own exchange is more than L rounds behind;
a larger L idles the device less and applies updates later. ``--sync-every`` also varies H, each H over
links on which an exchange takes half its round. One device runs first, as the baseline of each run's
``speedup_vs_one``. Runs go one at a time, each until the target or ``--cap``.

    sudo .venv/bin/python scripts/bench_lag.py --lags 1 2 3 --json
    sudo .venv/bin/python scripts/bench_lag.py --lags 3 --sync-every 5 20 --json   # H, each on its links
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts import bench_scaling, bench_testbed, bench_training  # noqa: E402

PEERS = 4


def plans(lags: list[int], cap_s: float, sync_every: list[int] | None = None) -> list[bench_testbed.Plan]:
    """One run per (H, lag): gossip int8 in the bench regime, each H over links sized to it
    (:func:`bench_scaling.link_rate`, as the sweep does), so that an exchange takes half its round."""
    runs = []
    for h in sync_every or [int(bench_scaling.GOSSIP["sync_every_steps"])]:
        rate = bench_scaling.regime_rate(h)
        for lag in lags:
            runs.append(
                bench_testbed.Plan(
                    f"h{h}-lag-{lag}",
                    "gossip-int8",
                    PEERS,
                    bench_scaling.gossip_sets("int8", sync_every_steps=h, max_lag_rounds=lag),
                    f"gossip int8, H = {h}, max_lag_rounds {lag}",
                    budget_s=cap_s,
                    until_target=True,
                    rate=rate,
                )
            )
    return runs


def one_device(cap_s: float) -> bench_testbed.Plan:
    """The baseline measured in the same run: one device, plain AdamW, until the target."""
    sets = bench_scaling.single_sets(int(bench_training.REGIME["batch_size"]))
    return bench_testbed.Plan(
        "one-device", "one device", 1, sets, "one device", budget_s=cap_s, until_target=True
    )


def with_speedup(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's ``speedup_vs_one``: the one-device run's time to target over its own."""
    one = next((r["seconds_to_target"] for r in results if r["name"] == "one-device"), None)
    for result in results:
        mine = result["seconds_to_target"]
        result["speedup_vs_one"] = round(one / mine, 3) if one and mine else None
    return results


def summary(row: dict[str, Any]) -> dict[str, Any]:
    split = row.get("time_split") or {}
    keep = ("name", "rate", "seconds_to_target", "samples_to_target", "final_eval_loss", "utilization")
    compute = row.get("compute_per_step_s")
    return {key: row.get(key) for key in keep} | {
        "sync_share": split.get("sync"),
        "compute_ms_per_step": None if compute is None else round(1000 * compute, 1),
        "error": row.get("error"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[1, 2, 3], help="max_lag_rounds to try")
    parser.add_argument(
        "--sync-every",
        type=int,
        nargs="+",
        help="H values to try, each over links sized to it (the regime's)",
    )
    parser.add_argument("--cap", type=float, default=150.0, help="longest a run may take (s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    root = bench_testbed.logs_root("bench-lag")
    todo, rows = [one_device(args.cap), *plans(args.lags, args.cap, args.sync_every)], []
    rate = bench_scaling.regime_rate()  # only the one-device run uses it: the others carry their own
    target = bench_training.REGIME["target"]
    try:
        for plan in todo:  # one at a time: more than the report's PARALLEL trainers break the emulation
            rows.append(bench_testbed.run_plan(plan, root=root, rate=rate, target=target, say=print))
    except KeyboardInterrupt:  # the labs close at exit (netlab's atexit)
        print("bench_lag: interrupted; leftovers (if any): python -m testbed cleanup", file=sys.stderr)
        return 130
    results = with_speedup([summary(row) for row in rows])
    for result in results:
        print(result)
    if args.json:
        print(json.dumps({"logs": str(root), "runs": results}))
    return 0


if __name__ == "__main__":
    bench_testbed.interrupt_on_sigterm()
    sys.exit(main())
