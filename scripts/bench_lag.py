"""How far gossip's exchanges may lag: time to target with 4 equal trainers per ``averaging.max_lag_rounds``.

The bench regime of the report (docs/benchmarks.md): emulated devices of 0.1 s per step, H = 20 over
the report's links, on scripts/netlab.py's testbed (needs root). With ``max_lag_rounds`` L a trainer's
device waits only when its own exchange is more than L rounds behind; a larger L idles the device less
and applies updates later. Runs go two at a time (8 trainers), each until the target or ``--cap``.

    sudo .venv/bin/python scripts/bench_lag.py --lags 1 2 3 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts import bench_scaling, bench_testbed, bench_training, netlab  # noqa: E402

PEERS = 4
AT_ONCE = 2
"""Runs at once: 8 trainers keep the emulation honest on 2 cores (the report's --parallel 8)."""


def plans(lags: list[int], cap_s: float) -> list[bench_testbed.Plan]:
    return [
        bench_testbed.Plan(
            f"lag-{lag}",
            "gossip-int8",
            PEERS,
            bench_scaling.gossip_sets("int8", max_lag_rounds=lag),
            f"gossip int8, max_lag_rounds {lag}",
            budget_s=cap_s,
            until_target=True,
        )
        for lag in lags
    ]


def summary(row: dict[str, Any]) -> dict[str, Any]:
    split = row.get("time_split") or {}
    keep = ("name", "seconds_to_target", "samples_to_target", "final_eval_loss", "utilization")
    return {key: row.get(key) for key in keep} | {"sync_share": split.get("sync"), "error": row.get("error")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[1, 2, 3], help="max_lag_rounds to try")
    parser.add_argument("--cap", type=float, default=150.0, help="longest a run may take (s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    reason = netlab.unavailable_reason()
    if reason is not None:
        print(f"bench_lag: the testbed is unavailable: {reason}", file=sys.stderr)
        return 2
    (REPO / "runs").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-lag-", dir=REPO / "runs"))
    rate = bench_scaling.link_rate(bench_training.n_params(), 20, bench_training.REGIME["step_time_s"])
    todo, rows = plans(args.lags, args.cap), []
    for start in range(0, len(todo), AT_ONCE):
        group = todo[start : start + AT_ONCE]
        target = bench_training.REGIME["target"]
        rows += bench_testbed.run_plans(group, root=root, rate=rate, target=target, say=print)
    results = [summary(row) for row in rows]
    for result in results:
        print(result)
    if args.json:
        print(json.dumps({"rate": rate, "logs": str(root), "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
