"""How long a trainer takes to shut down after SIGINT, mid-step or mid-sync, and where the time goes.

Starts ``swarm bootstrap`` and ``--trainers`` ``swarm join`` processes of ``--config`` (with the
``--set`` overrides; each trainer checkpoints into a temporary directory and writes ``--history`` and
``--summary`` files), waits until the last one (the victim) has booked a round, and sends it SIGINT

* ``--when step``: half-way through the inner step that makes its next round due, ``H``
  (``averaging.sync_every_steps``) steps after the round, timed from the round's line in its history
  and its own rate there (``samples_per_s``);
* ``--when sync``: ``--delay`` seconds after that step ends and the round starts (its exchange runs in
  the background, or holds the training thread with ``averaging.max_lag_rounds=0``).

The moment is aimed, not seen: the summary says which phase the stop found.

It prints the phases of the victim's way out from its summary's ``stop`` (swarm/trainer/_phases.py
``StopTimes``): the phase the stop found (``step_other``: an inner step, ``sync``: a round holding the
loop), the loop ending, the checkpoint write and its size, leaving the swarm (averagers, DHT,
``p2pd``), the summary's final evaluation, the steps and rounds booked after the stop, and the total
from the signal to the process's exit, measured here. The checkpoint write is what a stop cannot
avoid: the last line gives the total, less the summary's evaluation, in units of it. A trainer that
wrote no summary shows only the total. At the end every process gets SIGINT; what is still running
30 s later (after a graceful stop nothing should be) is named and killed, and the temporary directory
is removed.

    .venv/bin/python -m scripts.bench_shutdown --config configs/gpt-125m.yaml --when step \\
        --set data.source=stdlib --set train.batch_size=2 --set model.block_size=128 ...
    .venv/bin/python -m scripts.bench_shutdown --config configs/local-tiny.yaml --when sync  # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GRACE_S = 30.0
POLL_S = 0.05  # the history and summary are files other processes write: poll them


class Proc:
    """A ``swarm`` command in its own session, its output in ``<root>/<name>.log``."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], root: Path) -> None:
        self.name, self.log = name, root / f"{name}.log"
        self.history, self.summary = root / f"{name}.history.jsonl", root / f"{name}.summary.json"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "peers.cli", *args],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def own_records(self) -> list[dict[str, Any]]:
        """The trainer's own record in each line of its history so far, with the line's ``time``."""
        if not self.history.exists():
            return []
        from swarm.metrics import read_history

        return [{**snap["peers"][0], "time": snap["time"]} for snap in read_history(self.history)]

    def wait_for_record(self, accept: Any, timeout: float) -> dict[str, Any]:
        """The first record of its history that ``accept`` takes; raises on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((r for r in self.own_records() if accept(r)), None)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            time.sleep(POLL_S)
        raise RuntimeError(f"{self.name}: no such line in its history within {timeout:.0f} s")

    def wait_exit(self, timeout: float) -> float | None:
        """When it exited (``time.monotonic()``), or None if it still runs after ``timeout``."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return time.monotonic()


def _sets(overrides: list[str]) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def _stop_all(procs: list[Proc]) -> None:
    """SIGINT each process, wait, then name and kill whatever of their sessions is left."""
    from peers.local import session_processes

    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGINT)
    for p in procs:
        p.wait_exit(GRACE_S)
    leftovers = session_processes({p.proc.pid for p in procs})
    for proc in leftovers:
        print(f"leftover after a graceful stop: pid {proc.pid} {proc.name()}; killing it", file=sys.stderr)
        proc.kill()


def _signal_time(victim: Proc, args: argparse.Namespace) -> float:
    """When (``time.time()``) to send the signal, aimed from the first round the victim books (its
    history's line then, and its rate there): a round is due ``H`` of its steps after the last one
    (``averaging.sync_every_steps``); ``step`` aims at the middle of the step that makes it due,
    ``sync`` at ``--delay`` after that step ends. Aimed, not seen: the summary's ``in_phase`` says
    what the stop found."""
    from swarm.config import load_config

    config = load_config(args.config, overrides=args.overrides, env={})
    every, batch = config.averaging.sync_every_steps, config.train.batch_size
    record = victim.wait_for_record(lambda r: r.get("round") and r.get("samples_per_s"), args.timeout)
    step_s = batch / record["samples_per_s"]
    if args.when == "sync":
        return record["time"] + every * step_s + args.delay
    return record["time"] + (every - 0.5) * step_s


def bench(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from peers.local import wait_for_join_line

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": args.threads}
    common = ["--config", str(args.config), *_sets(args.overrides)]
    procs: list[Proc] = []
    try:
        boot = Proc("bootstrap", ["bootstrap", *common], env, root)
        procs.append(boot)
        maddr = wait_for_join_line(boot.log, boot.proc, timeout_s=args.timeout)
        for i in range(1, args.trainers + 1):
            name = f"trainer-{i}"
            join = ["join", "--initial-peers", maddr, *common]
            join += ["--set", f"train.checkpoint_dir={root / f'ckpt-{i}'}"]
            join += ["--history", str(root / f"{name}.history.jsonl")]
            join += ["--summary", str(root / f"{name}.summary.json")]
            procs.append(Proc(name, join, env, root))
            procs[-1].wait_for_record(lambda r: True, args.timeout)  # its first line: it joined
        victim = procs[-1]
        at = _signal_time(victim, args)
        time.sleep(max(0.0, at - time.time()))  # the moment is computed, not signalled by the victim
        sent = time.monotonic()
        victim.proc.send_signal(signal.SIGINT)
        exited = victim.wait_exit(args.timeout)
        if exited is None:
            raise RuntimeError(f"the victim did not exit within {args.timeout} s of SIGINT")
        return _report(victim, exited - sent, root / f"ckpt-{args.trainers}")
    finally:
        _stop_all(procs)


def _report(victim: Proc, total: float, checkpoints: Path) -> dict[str, Any]:
    numbers: dict[str, Any] = {"total_s": total, "exit_code": victim.proc.returncode}
    summary = json.loads(victim.summary.read_text()) if victim.summary.exists() else {}
    stop = summary.get("stop") or {}
    for part in ("loop", "checkpoint", "leave", "final_eval"):
        if stop.get(f"{part}_s") is not None:
            numbers[f"{part}_s"] = stop[f"{part}_s"]
    if stop:
        numbers["stop_in_phase"] = stop.get("in_phase")
        numbers["stopped_at_step"] = summary["steps"]
        numbers["steps_after_stop"] = summary["steps"] - stop["at_step"]
        numbers["rounds_after_stop"] = summary["rounds"] - stop["at_round"]
    files = sorted(checkpoints.glob("ckpt-*.pt"))
    numbers["checkpoint_bytes"] = files[-1].stat().st_size if files else 0
    numbers["checkpoints_written"] = len(files)
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "gpt-125m.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--when", choices=("step", "sync"), default="step")
    parser.add_argument("--delay", type=float, default=0.5, help="--when sync: seconds after a round starts")
    parser.add_argument("--threads", default="1", help="OMP_NUM_THREADS of every process")
    parser.add_argument("--timeout", type=float, default=900.0, help="deadline of each wait (a hang)")
    parser.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-shutdown-"))
    try:
        numbers = bench(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key, value in numbers.items():
        print(f"{key:>20}: {value:.2f}" if key.endswith("_s") else f"{key:>20}: {value}")
    if numbers.get("checkpoint_s"):
        total = numbers["total_s"] - numbers.get("final_eval_s", 0.0)
        print(f"shutdown total (less the summary's evaluation) / checkpoint write: "
              f"{total / numbers['checkpoint_s']:.2f}x")  # fmt: skip
    if args.json:
        print(json.dumps(numbers))


if __name__ == "__main__":
    main()
