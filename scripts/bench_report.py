"""The benchmark report: codecs, averaging, and training over the emulated internet -> docs/benchmarks.md.

Phases (one progress line each on stderr, with the elapsed time):

1. codecs: ``python -m scripts.bench_codecs --json`` (or ``--codecs-json FILE``, a saved last line);
2. averaging: ``python -m scripts.bench_averaging --json`` (or ``--averaging-json FILE``);
3. training over the testbed (needs root; scripts/_plans.py says what runs): in the bench
   regime (per-peer batch 1, emulated devices of ``emulation.step_time_s``, links shaped so that one int8
   exchange takes at least half a round), the comparison of gossip int8 and int4, all-reduce,
   data-parallel, hivemind.Optimizer and solo with 4 trainers, one 3x slower; the speed-up over one
   device with N = 1, 2, 4, 8; with ``--sweep``, gossip's outer settings. Runs go several at a time
   (``--parallel`` trainers at most), each in its own lab.

Writes the generated part of docs/benchmarks.md (between its ``bench_report`` markers; the
hand-written measurements around them are kept) and docs/img/training_loss.png, docs/img/scaling.png.
Without root the testbed phases are skipped with the reason, in the JSON and the markdown.

    .venv/bin/python -m scripts.bench_report --quick --json   # about 20 minutes on 2 cores
    .venv/bin/python -m scripts.bench_report --json           # full; last line is one JSON object
    .venv/bin/python -m scripts.bench_report --from-json r.json   # only rewrite the doc and plots
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from peers.local import terminate_and_wait
from scripts import _plans, _runner
from scripts.bench_report_doc import write_outputs
from testbed import netlab

REPO = _runner.REPO
DOC = REPO / "docs" / "benchmarks.md"
PARALLEL = 5
"""Trainers at once, at most: a trainer of the bench regime keeps 0.4-0.5 of a core busy (``ps``, H = 5:
about 0.3 its main process, 0.17 its DHT process and daemon), so on 2 cores five still leave the
emulated devices mostly asleep (35-43 ms of real compute per 100 ms step); eight took 97-117 ms."""
IMG = REPO / "docs" / "img"
SLOW_PEER = 4
STOP_GRACE_S = 60.0
"""How long a benchmark stopped by Ctrl+C, SIGTERM or its timeout has to close its peers and daemons."""


class Progress:
    """One line per phase on stderr, with the time since the report started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[report {time.monotonic() - self.started:6.1f}s] {message}", file=sys.stderr, flush=True)


def run_json_script(script: str, args: list[str], log: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m scripts.<script> --json``; return its last line, or ``{"error": ...}``."""
    command = [sys.executable, "-m", f"scripts.{script}", *args, "--json"]
    with log.open("w") as err:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return {"error": f"{script} took over {timeout_s:.0f} s; see {log}"}
        except BaseException:  # Ctrl+C or SIGTERM: the benchmark closes its peers and daemons first
            _stop(proc)
            raise
    lines = out.strip().splitlines()
    try:
        return {
            **json.loads(lines[-1]),
            "command": " ".join(["python", "-m", f"scripts.{script}", *args, "--json"]),
        }
    except (IndexError, ValueError):
        return {"error": f"{script} exited {proc.returncode} without a JSON line; see {log}"}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM a benchmark, give it time to close what it started, then kill it. Not SIGKILL at once:
    its workers, forkserver and p2pd daemons would outlive it."""
    for left in terminate_and_wait([proc], STOP_GRACE_S):
        left.kill()
        left.wait()


def load_json(path: Path) -> dict[str, Any]:
    """A saved ``--json`` output: the last non-empty line of the file."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path}: empty, expected the JSON line a benchmark printed")
    try:
        return json.loads(lines[-1])
    except ValueError as exc:
        raise SystemExit(f"{path}: the last line is not JSON ({exc})") from exc


def saved_section(path: Path, key: str) -> dict[str, Any]:
    """Section ``key`` of a saved report (``--json``), marked as reused from ``path``."""
    report = load_json(path)
    if not isinstance(report.get(key), dict):
        raise SystemExit(f"{path}: no {key!r} section; expected the JSON line of a bench_report --json run")
    return {**report[key], "reused": str(path)}


def regime() -> dict[str, Any]:
    """The settings every testbed run shares, with the link rate they imply."""
    h = int(_plans.GOSSIP["sync_every_steps"])
    step = _runner.REGIME["step_time_s"]
    return {
        **_runner.REGIME,
        **_plans.GOSSIP,
        "rate": _plans.regime_rate(),
        "n_params": _runner.n_params(),
        "config": _runner.CONFIG,
        "half_round_s": h * step / 2,
        "eval_seconds": _plans.EVAL_SECONDS,
    }


def schedule(plans: list[_runner.Plan], parallel: int) -> list[list[_runner.Plan]]:
    """Groups of plans to run at once, at most ``parallel`` trainers each: first fit, longest budgets
    and then most trainers first, so that runs of about the same length share a group."""
    groups: list[list[_runner.Plan]] = []
    for plan in sorted(plans, key=lambda p: (-p.budget_s, -p.peers)):
        group = next((g for g in groups if sum(p.peers for p in g) + plan.peers <= parallel), None)
        if group is None:
            groups.append([plan])
        else:
            group.append(plan)
    return groups


def links(args: argparse.Namespace) -> str | None:
    """The rate every testbed run's links get unless its plan says otherwise (None: unshaped)."""
    if args.rate is None:
        return regime()["rate"]
    return None if args.rate == "none" else args.rate


def run_all(plans: list[_runner.Plan], args: argparse.Namespace, root: Path, say: Progress) -> dict:
    """Every plan's row by name, the groups run one after the other."""
    rows: dict[str, dict[str, Any]] = {}
    target, rate = args.target, links(args)
    for group in schedule(plans, args.parallel):
        names = ", ".join(f"{p.name} ({p.peers})" for p in group)
        say(f"testbed: {names} over {rate or 'unshaped'} links")
        done = _runner.run_plans(group, root=root, rate=rate, target=target, say=say)
        rows |= {plan.name: row for plan, row in zip(group, done, strict=True)}
    return rows


def testbed_phases(args: argparse.Namespace, root: Path, say: Progress) -> dict[str, Any]:
    """training (the comparison), scaling and sweep, or each ``{"skipped": reason}`` without root."""
    reason = netlab.unavailable_reason()
    if reason is not None:
        say(f"training over the testbed skipped: {reason}")
        return {"training": {"skipped": reason}, "scaling": {"skipped": reason}, "sweep": {"skipped": reason}}
    comparison = [] if args.scaling_only else _plans.comparison_plans(args.peers, args.budget, SLOW_PEER)
    scaling = _plans.scaling_plans(args.scaling, args.cap) if args.scaling else []
    sweep = _plans.sweep_plans(_plans.SWEEP, args.peers, args.budget) if args.sweep else []
    rows = run_all([*comparison, *scaling, *sweep], args, root, say)
    setting = {"target": args.target, **regime(), "rate": links(args) or "unshaped"}
    scaled = _scaling(args, scaling, rows, setting)
    if not comparison:
        return {
            "training": {"skipped": "--scaling-only"},
            "scaling": scaled,
            "sweep": _sweep(sweep, rows, args, setting),
        }
    training = {
        "rows": [rows[p.name] for p in comparison],
        "peers": args.peers,
        "slow_peer": SLOW_PEER,
        "slowdown": comparison[0].slowdown,
        "budget_s": args.budget,
        **setting,
    }
    training |= _plans.equal_samples(training["rows"])
    return {
        "training": training,
        "scaling": scaled,
        "sweep": _sweep(sweep, rows, args, setting),
    }


def _scaling(args, plans: list, rows: dict[str, dict[str, Any]], setting: dict[str, Any]) -> dict[str, Any]:
    if not plans:
        return {"skipped": "no device counts (--scaling)"}
    runs = [rows[p.name] for p in plans]
    points = _plans.scaling_points(runs)
    return {"points": points, "runs": runs, "counts": args.scaling, "cap_s": args.cap, **setting}


def _sweep(plans: list, rows: dict[str, dict[str, Any]], args, setting: dict[str, Any]) -> dict[str, Any]:
    if not plans:
        return {"skipped": "not run (--sweep)"}
    sweep = {"rows": [rows[p.name] for p in plans], "budget_s": args.budget, **setting}
    return sweep | _plans.equal_samples(sweep["rows"])


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
    parser.add_argument("--quick", action="store_true", help="shorter budgets (under 10 min on 2 cores)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--codecs-json", type=Path, help="reuse a saved `bench_codecs.py --json` output")
    parser.add_argument("--averaging-json", type=Path, help="reuse a saved `bench_averaging.py --json`")
    parser.add_argument("--from-json", type=Path, help="reuse a saved report (--json): only rewrite outputs")
    parser.add_argument("--sweep-json", type=Path, help="take the sweep from a saved report (--json)")
    parser.add_argument(
        "--scaling-json",
        type=Path,
        help="take the speed-up runs from a saved report (--json), e.g. a --scaling-only run at a longer "
        "--step-time; none are run",
    )
    parser.add_argument(
        "--baselines-json",
        type=Path,
        help="a saved `bench_baselines.py --json`: times to the target, run to the end",
    )
    parser.add_argument("--note", help="a sentence for the report's header (e.g. what else ran meanwhile)")
    parser.add_argument("--skip-training", action="store_true", help="codecs and averaging only")
    parser.add_argument("--peers", type=int, default=4, help="trainers in the comparison (4)")
    parser.add_argument("--budget", type=float, help="seconds of training per comparison run (150; quick 90)")
    parser.add_argument("--target", type=float, default=_runner.REGIME["target"], help="bits/byte")
    parser.add_argument("--scaling", type=int, nargs="*", help="device counts (1 2 4 8); none: skip")
    parser.add_argument("--cap", type=float, help="longest a scaling run may take (300 s; quick 150)")
    parser.add_argument("--sweep", action="store_true", help="also sweep gossip's outer lr, momentum and H")
    parser.add_argument(
        "--step-time",
        type=float,
        help="seconds per emulated inner step, every backend (0.1); the link rate follows, so that one "
        "int8 exchange still takes half a round. Longer: N trainers' real work fits beside 2 cores",
    )
    parser.add_argument(
        "--rate",
        help="the links' rate for every run (tc's syntax, e.g. 1500kbit), or 'none' for unshaped links; "
        "default: the regime's, from --step-time",
    )
    parser.add_argument(
        "--scaling-only",
        action="store_true",
        help="only the speed-up runs: print their table on stderr (and --json's line); write no doc or plot",
    )
    parser.add_argument("--parallel", type=int, default=PARALLEL, help=f"trainers at once ({PARALLEL})")
    parser.add_argument("--doc", type=Path, default=DOC, help="markdown file to (re)write")
    parser.add_argument("--img-dir", type=Path, default=IMG, help="where the PNGs go")
    parser.add_argument("--logs-dir", type=Path, default=REPO / "runs", help="parent of this run's logs")
    args = parser.parse_args(argv)
    args.budget = args.budget or (90.0 if args.quick else 150.0)
    args.cap = args.cap or (150.0 if args.quick else 300.0)
    if args.scaling_json:
        if args.scaling_only or args.scaling:
            parser.error(
                "--scaling-json reuses the speed-up runs: --scaling-only and --scaling would run them"
            )
        args.scaling = []
    args.scaling = [1, 2, 4, 8] if args.scaling is None else args.scaling
    if args.step_time is not None and args.step_time <= 0:
        parser.error(f"--step-time {args.step_time}: must be positive")
    if args.rate not in (None, "none"):
        try:
            netlab.parse_rate(args.rate)
        except ValueError as exc:
            parser.error(f"--rate: {exc}, or none")
    if args.scaling_only and not args.scaling:
        parser.error("--scaling-only needs device counts (--scaling 1 2 4 8)")
    return args


def collect(args: argparse.Namespace, argv: list[str], say: Progress) -> dict[str, Any]:
    """Run (or reuse) every phase; return the report's data."""
    args.logs_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-report-", dir=args.logs_dir))
    say(f"logs in {root}")
    report: dict[str, Any] = {
        "command": shlex.join(["-m", "scripts.bench_report", *argv]),
        "quick": args.quick,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "logs": str(root),
    }
    if args.scaling_only:
        skipped = {"skipped": "--scaling-only"}
        return _finish(
            report | {"codecs": skipped, "averaging": skipped, **testbed_phases(args, root, say)}, say
        )
    quick = ["--quick"] if args.quick else []
    if args.codecs_json:
        report["codecs"] = {**load_json(args.codecs_json), "reused": str(args.codecs_json)}
    else:
        say("codecs: " + " ".join(["scripts.bench_codecs", *quick, "--json"]))
        report["codecs"] = run_json_script("bench_codecs", quick, root / "codecs.log", 600)
    if args.averaging_json:
        report["averaging"] = {**load_json(args.averaging_json), "reused": str(args.averaging_json)}
    else:
        say("averaging: " + " ".join(["scripts.bench_averaging", *quick, "--json"]))
        report["averaging"] = run_json_script("bench_averaging", quick, root / "averaging.log", 900)
    if args.skip_training:
        report |= {key: {"skipped": "--skip-training"} for key in ("training", "scaling", "sweep")}
    else:
        report |= testbed_phases(args, root, say)
    return _finish(report, say)


def _finish(report: dict[str, Any], say: Progress) -> dict[str, Any]:
    report["machine"]["load_average_at_end"] = machine()["load_average_at_start"]
    report["wall_seconds"] = round(time.monotonic() - say.started, 1)
    return report


def use_step_time(args: argparse.Namespace) -> None:
    """With ``--step-time``, every plan built from now on (and the regime's link rate) uses it."""
    if args.step_time is not None:
        _runner.REGIME["step_time_s"] = args.step_time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    use_step_time(args)
    say = Progress()
    try:
        report = load_json(args.from_json) if args.from_json else collect(args, argv, say)
        if args.sweep_json:
            report["sweep"] = saved_section(args.sweep_json, "sweep")
        if args.scaling_json:
            report["scaling"] = saved_section(args.scaling_json, "scaling")
        if args.baselines_json:
            report["baselines"] = {**load_json(args.baselines_json), "reused": str(args.baselines_json)}
        if args.note:
            report["note"] = args.note
    except KeyboardInterrupt:
        say("interrupted: labs torn down; leftovers (if any): python -m testbed cleanup")
        return 130
    if args.scaling_only:
        scaling = report["scaling"]
        table = scaling.get("skipped") or "\n".join(_plans.render_scaling(scaling, None))
        print(table, file=sys.stderr)
    else:
        report["outputs"] = [str(p) for p in write_outputs(report, args.doc, args.img_dir)]
        say(f"wrote {', '.join(report['outputs'])}")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    _runner.interrupt_on_sigterm()
    sys.exit(main())
