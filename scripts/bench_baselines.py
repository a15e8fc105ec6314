"""Time to the target for gossip int8 against all-reduce and hivemind.Optimizer, each run to the end.

The report's comparison (scripts/bench_report.py) gives every backend the same budget, and in the
bench regime all-reduce and hivemind.Optimizer do not reach the target within it, so the report can
only bound gossip's ratio against them. This runs the same plans (``_plans.comparison_plans``:
4 trainers on emulated devices, the last one 3x slower, over the report's links), each until it reaches
the target or ``--cap``, one at a time, and prints gossip's time over each baseline's.

    sudo .venv/bin/python -m scripts.bench_baselines --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from datetime import UTC, datetime
from typing import Any

from scripts import _plans, _rows, _runner

BACKENDS = ("gossip-int8", "allreduce", "hivemind")
PEERS = 4


def plans(cap_s: float, backends: tuple[str, ...] = BACKENDS) -> list[_runner.Plan]:
    """The comparison's plans of ``backends``, each run until the target or ``cap_s``."""
    everything = _plans.comparison_plans(PEERS, cap_s, slow_peer=PEERS)
    chosen = [p for p in everything if p.backend in backends]
    return [dataclasses.replace(p, until_target=True) for p in chosen]


def ratios(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """gossip int8's time to the target over each other backend's (None where one did not reach it)."""
    times = {row["name"]: row.get("seconds_to_target") for row in rows}
    gossip = times.get("gossip-int8")
    return {
        f"gossip_over_{name}": round(gossip / mine, 3) if gossip and mine else None
        for name, mine in times.items()
        if name != "gossip-int8"
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap", type=float, default=600.0, help="longest a run may take (s)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    args = parser.parse_args(argv)
    root = _runner.logs_root("bench-baselines")
    rate, target, rows = _plans.regime_rate(), _runner.REGIME["target"], []
    started = datetime.now(UTC)
    try:
        for plan in plans(args.cap, tuple(args.backends)):  # one at a time: 4 trainers hold on 2 cores
            rows.append(_runner.run_plan(plan, root=root, rate=rate, target=target, say=print))
    except KeyboardInterrupt:  # the labs close at exit (netlab's atexit)
        print("bench_baselines: interrupted; leftovers: python -m testbed cleanup", file=sys.stderr)
        return 130
    results = [_rows.short_row(row) for row in rows]
    for result in results:
        print(result)
    print(ratios(results))
    if args.json:
        saved = {"date": started.strftime("%Y-%m-%d %H:%M UTC"), "logs": str(root), "rate": rate}
        print(json.dumps(saved | {"runs": results, "ratios": ratios(results)}))
    return 0


if __name__ == "__main__":
    _runner.interrupt_on_sigterm()
    sys.exit(main())
