"""How far gossip's exchanges may lag, and how long its rounds: time to target with 4 equal trainers.

The bench regime of the report (docs/benchmarks.md): emulated devices of 0.1 s per step, gossip's H of
``_plans.GOSSIP`` over the report's links, on the testbed (testbed/; needs root). With
``max_lag_rounds`` L a trainer's device waits only when its own exchange is more than L rounds behind;
a larger L idles the device less and applies updates later. ``--sync-every`` also varies H, each H over
links on which an exchange takes half its round. One device runs first, as the baseline of each run's
``speedup_vs_one``. Runs go one at a time, each until the target or ``--cap``.

    sudo .venv/bin/python -m scripts.bench_lag --lags 1 2 3 --json
    sudo .venv/bin/python -m scripts.bench_lag --lags 3 --sync-every 5 20 --json   # H, each on its links
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from scripts import _plans, _rows, _runner

PEERS = 4


def plans(lags: list[int], cap_s: float, sync_every: list[int] | None = None) -> list[_runner.Plan]:
    """One run per (H, lag): gossip int8 in the bench regime, each H over links sized to it
    (:func:`_plans.link_rate`, as the sweep does), so that an exchange takes half its round."""
    runs = []
    for h in sync_every or [int(_plans.GOSSIP["sync_every_steps"])]:
        rate = _plans.regime_rate(h)
        for lag in lags:
            runs.append(
                _runner.Plan(
                    f"h{h}-lag-{lag}",
                    "gossip-int8",
                    PEERS,
                    _plans.gossip_sets("int8", sync_every_steps=h, max_lag_rounds=lag),
                    f"gossip int8, H = {h}, max_lag_rounds {lag}",
                    budget_s=cap_s,
                    until_target=True,
                    rate=rate,
                )
            )
    return runs


def one_device(cap_s: float) -> _runner.Plan:
    """The baseline measured in the same run: one device, plain AdamW, until the target."""
    sets = _plans.single_sets(int(_runner.REGIME["batch_size"]))
    return _runner.Plan("one-device", "one device", 1, sets, "one device", budget_s=cap_s, until_target=True)


def with_speedup(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run's ``speedup_vs_one``: the one-device run's time to target over its own."""
    one = next((r["seconds_to_target"] for r in results if r["name"] == "one-device"), None)
    for result in results:
        mine = result["seconds_to_target"]
        result["speedup_vs_one"] = round(one / mine, 3) if one and mine else None
    return results


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
    root = _runner.logs_root("bench-lag")
    todo, rows = [one_device(args.cap), *plans(args.lags, args.cap, args.sync_every)], []
    rate = _plans.regime_rate()  # only the one-device run uses it: the others carry their own
    target = _runner.REGIME["target"]
    try:
        for plan in todo:  # one at a time: more than the report's PARALLEL trainers break the emulation
            rows.append(_runner.run_plan(plan, root=root, rate=rate, target=target, say=print))
    except KeyboardInterrupt:  # the labs close at exit (netlab's atexit)
        print("bench_lag: interrupted; leftovers (if any): python -m testbed cleanup", file=sys.stderr)
        return 130
    results = with_speedup([_rows.short_row(row) for row in rows])
    for result in results:
        print(result)
    if args.json:
        print(json.dumps({"logs": str(root), "runs": results}))
    return 0


if __name__ == "__main__":
    _runner.interrupt_on_sigterm()
    sys.exit(main())
