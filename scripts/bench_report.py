#!/usr/bin/env python
"""The benchmark report: codecs, averaging, and training over the emulated internet -> docs/benchmarks.md.

Phases (one progress line each on stderr, with the elapsed time):

1. codecs: ``scripts/bench_codecs.py --json`` (or ``--codecs-json FILE``, a saved last line);
2. averaging: ``scripts/bench_averaging.py --json`` (or ``--averaging-json FILE``);
3. training over the testbed (scripts/bench_testbed.py, needs root): 4 trainer hosts plus a
   bootstrap host, every link shaped to 50 Mbit/s, trainer 4 three times slower in compute
   (``train.slowdown=3``); swarm gossip int8 and int4 (and fp32 without ``--quick``),
   ``hivemind.Optimizer`` and one solo peer, same model, data, learning rate and wall-time budget;
4. scaling: swarm throughput with 2, 4, 6 equal gossip peers, added in stages in one lab.

Writes the generated part of docs/benchmarks.md (between its ``bench_report`` markers; the
hand-written measurements around them are kept) and docs/img/training_loss.png, docs/img/scaling.png.
Without root the testbed phases are skipped with the reason, in the JSON and the markdown.

    .venv/bin/python scripts/bench_report.py --quick          # under 10 minutes on 2 cores
    .venv/bin/python scripts/bench_report.py --json           # full; last line is one JSON object
    .venv/bin/python scripts/bench_report.py --from-json r.json   # only rewrite the doc and plots
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

try:  # imported as scripts.bench_report (tests) or run as python scripts/bench_report.py
    from scripts import bench_testbed, bench_training, netlab
    from scripts.bench_report_doc import write_outputs
except ImportError:  # pragma: no cover - depends on how the caller was started
    import bench_testbed
    import bench_training
    import netlab
    from bench_report_doc import write_outputs

REPO = bench_training.REPO
SCRIPTS = REPO / "scripts"
DOC = REPO / "docs" / "benchmarks.md"
IMG = REPO / "docs" / "img"
RATE = "50mbit"
SLOWDOWN = 3.0
SLOW_PEER = 4


class Progress:
    """One line per phase on stderr, with the time since the report started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[report {time.monotonic() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)


def run_json_script(script: str, args: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``scripts/<script> --json``; return its last line, or ``{"error": ...}``."""
    command = [sys.executable, str(SCRIPTS / script), *args, "--json"]
    try:
        with log.open("w") as err:
            done = subprocess.run(
                command,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                timeout=timeout_s,
                check=False,
            )
    except subprocess.TimeoutExpired:
        return {"error": f"{script} took over {timeout_s:.0f} s; see {log}"}
    lines = done.stdout.strip().splitlines()
    try:
        return {**json.loads(lines[-1]), "command": " ".join([script, *args, "--json"])}
    except (IndexError, ValueError):
        return {"error": f"{script} exited {done.returncode} without a JSON line; see {log}"}


def load_json(path: Path) -> dict[str, Any]:
    """A saved ``--json`` output: the last non-empty line of the file."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path}: empty, expected the JSON line a benchmark printed")
    try:
        return json.loads(lines[-1])
    except ValueError as exc:
        raise SystemExit(f"{path}: the last line is not JSON ({exc})") from exc


def training_phase(args: argparse.Namespace, root: Path, say: Progress) -> dict[str, Any]:
    """The comparison over the testbed, or ``{"skipped": reason}`` without root."""
    reason = netlab.unavailable_reason()
    if reason is not None:
        say(f"training over the testbed skipped: {reason}")
        return {"skipped": reason}
    plans = bench_testbed.comparison_plans(args.peers, args.sync_every, SLOW_PEER, fp32=not args.quick)
    rows = []
    for plan in plans:
        say(f"training: {plan.name} ({plan.peers} trainer(s)), budget {args.budget:.0f} s")
        row = bench_testbed.run_plan(
            plan, root=root, rate=RATE, budget_s=args.budget, target=args.target, slowdown=SLOWDOWN, say=say
        )
        say(f"training: {plan.name} done: {_brief(row)}")
        rows.append(row)
    return {
        "rows": rows,
        "rate": RATE,
        "peers": args.peers,
        "slow_peer": SLOW_PEER,
        "slowdown": SLOWDOWN,
        "budget_s": args.budget,
        "target": args.target,
        "sync_every": args.sync_every,
        "n_params": bench_training.n_params(),
        "config": bench_training.CONFIG,
    }


def scaling_phase(args: argparse.Namespace, root: Path, say: Progress) -> dict[str, Any]:
    reason = netlab.unavailable_reason()
    if reason is not None:
        say(f"scaling skipped: {reason}")
        return {"skipped": reason}
    say(f"scaling: gossip int8 with {', '.join(map(str, args.scaling))} peers, {args.window:.0f} s windows")
    return bench_testbed.run_scaling(args.scaling, root=root, rate=RATE, window_s=args.window, say=say)


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    reached = row.get("seconds_to_target")
    to_target = "not reached" if reached is None else f"{reached:.1f} s"
    return f"to target {to_target}, final eval {row['final_eval_loss']:.3f}, util {row['utilization']:.0%}"


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average_at_start": [round(x, 2) for x in load] if load else None,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter budgets, no fp32 row (under 10 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--codecs-json", type=Path, help="reuse a saved `bench_codecs.py --json` output")
    parser.add_argument(
        "--averaging-json", type=Path, help="reuse a saved `bench_averaging.py --json` output"
    )
    parser.add_argument("--from-json", type=Path, help="reuse a saved report (--json): only rewrite outputs")
    parser.add_argument("--note", help="a sentence for the report's header (e.g. what else ran meanwhile)")
    parser.add_argument("--skip-training", action="store_true", help="codecs and averaging only")
    parser.add_argument("--peers", type=int, default=4, help="trainers in the comparison (4)")
    parser.add_argument("--budget", type=float, help="seconds of training per backend (150; quick 40)")
    parser.add_argument("--target", type=float, default=4.5, help="target eval loss, bits/byte (4.5)")
    parser.add_argument("--sync-every", type=int, default=10, help="H: local steps between syncs (10)")
    parser.add_argument("--scaling", type=int, nargs="*", help="peer counts (2 4 6); none: skip")
    parser.add_argument("--window", type=float, help="seconds per scaling measurement (40; quick 15)")
    parser.add_argument("--doc", type=Path, default=DOC, help="markdown file to (re)write")
    parser.add_argument("--img-dir", type=Path, default=IMG, help="where the PNGs go")
    parser.add_argument("--logs-dir", type=Path, default=REPO / "runs", help="parent of this run's logs")
    args = parser.parse_args(argv)
    args.budget = args.budget or (40.0 if args.quick else 150.0)
    args.window = args.window or (15.0 if args.quick else 40.0)
    args.scaling = [2, 4, 6] if args.scaling is None else args.scaling
    return args


def collect(args: argparse.Namespace, argv: list[str], say: Progress) -> dict[str, Any]:
    """Run (or reuse) every phase; return the report's data."""
    args.logs_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-report-", dir=args.logs_dir))
    say(f"logs in {root}")
    report: dict[str, Any] = {
        "command": " ".join(["scripts/bench_report.py", *argv]),
        "quick": args.quick,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "logs": str(root),
    }
    quick = ["--quick"] if args.quick else []
    if args.codecs_json:
        report["codecs"] = {**load_json(args.codecs_json), "reused": str(args.codecs_json)}
    else:
        say("codecs: " + " ".join(["bench_codecs.py", *quick, "--json"]))
        report["codecs"] = run_json_script("bench_codecs.py", quick, root / "codecs.log", 600)
    if args.averaging_json:
        report["averaging"] = {**load_json(args.averaging_json), "reused": str(args.averaging_json)}
    else:
        say("averaging: " + " ".join(["bench_averaging.py", *quick, "--json"]))
        report["averaging"] = run_json_script("bench_averaging.py", quick, root / "averaging.log", 900)
    if args.skip_training:
        report["training"] = report["scaling"] = {"skipped": "--skip-training"}
    else:
        report["training"] = training_phase(args, root, say)
        report["scaling"] = scaling_phase(args, root, say) if args.scaling else {"skipped": "no peer counts"}
    report["machine"]["load_average_at_end"] = machine()["load_average_at_start"]
    return report


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM tears the labs down like Ctrl+C


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    say = Progress()
    try:
        report = load_json(args.from_json) if args.from_json else collect(args, argv, say)
        if args.note:
            report["note"] = args.note
    except KeyboardInterrupt:
        say("interrupted: labs torn down; leftovers (if any): python scripts/netlab.py cleanup")
        return 130
    report["outputs"] = [str(p) for p in write_outputs(report, args.doc, args.img_dir)]
    say(f"wrote {', '.join(report['outputs'])}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(main())
