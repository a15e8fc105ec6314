#!/usr/bin/env python
"""How long a trainer takes to shut down after SIGINT, mid-step or mid-sync, and where the time goes.

Starts ``swarm bootstrap`` and ``--trainers`` ``swarm join`` processes of ``--config`` (with the
``--set`` overrides; each trainer checkpoints into a temporary directory), waits until the last one
(the victim) is training, and sends it SIGINT

* ``--when step``: half-way through the inner step that makes a round due (step ``H``,
  ``averaging.sync_every_steps``; half the step before's duration after it began);
* ``--when sync``: ``--delay`` seconds after it started a round (its exchange runs in the background,
  or holds the training thread with ``averaging.max_lag_rounds=0``).

It prints the phases of the victim's way out, from its own lines (``peers/join.py``): the loop ending
(the step or evaluation in progress), the checkpoint write and its size, leaving the swarm (averagers,
DHT, ``p2pd``), and the total from the signal to the process's exit, measured here. The checkpoint
write is what a stop cannot avoid: the last line gives the total in units of it. A trainer of an
older version prints no phase lines; only the total is then shown. At the end every process gets
SIGINT; what is still running 30 s later (after a graceful stop nothing should be) is named and
killed, and the temporary directory is removed.

    .venv/bin/python scripts/bench_shutdown.py --config configs/gpt-125m.yaml --when step \\
        --set data.source=stdlib --set train.batch_size=2 --set model.block_size=128 ...
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
JOIN_PREFIX = "swarm join --initial-peers "
ROUND_START = re.compile(r"step (\d+): starting round (\d+)")
PHASES = {
    "loop": re.compile(r"join: shutting down: stopped at step (\d+), round (\d+), the loop ended ([\d.]+) s"),
    "checkpoint": re.compile(r"join: checkpoint saved in \S+ \(step (\d+), ([\d.]+) s\)"),
    "leave": re.compile(r"join: left the swarm in ([\d.]+) s"),
}
AFTER_STOP = re.compile(r"^round\s+\d+ |starting round|took [\d.]+ s")
GRACE_S = 30.0


class Proc:
    """A ``swarm`` command in its own session, its output lines collected (with arrival times)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "peers.cli", *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._new = threading.Condition()
        self.exited_at: float | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._new.notify_all()
        self.proc.wait()
        with self._new:
            self.exited_at = time.monotonic()
            self._new.notify_all()

    def wait_for(
        self, pattern: re.Pattern[str], timeout: float, since: int = 0
    ) -> tuple[int, float, re.Match[str]]:
        """The first line from ``since`` on matching ``pattern``: (its index, arrival time, match)."""
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for index in range(since, len(self.lines)):
                    at, text = self.lines[index]
                    if found := pattern.search(text):
                        return index, at, found
                since = len(self.lines)
                remaining = deadline - time.monotonic()
                if self.exited_at is not None or remaining <= 0:
                    tail = "\n".join(text for _, text in self.lines[-30:])
                    raise RuntimeError(f"{self.name}: no line matching {pattern.pattern!r}:\n{tail}")
                self._new.wait(min(remaining, 1.0))

    def wait_exit(self, timeout: float) -> float | None:
        with self._new:
            self._new.wait_for(lambda: self.exited_at is not None, timeout)
            return self.exited_at


def _sets(overrides: list[str]) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


def _session_leftovers(sids: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) in sids:
                found.append(proc)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return found


def _stop_all(procs: list[Proc]) -> None:
    """SIGINT each process, wait, then name and kill whatever of their sessions is left."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.send_signal(signal.SIGINT)
    for p in procs:
        p.wait_exit(GRACE_S)
    leftovers = _session_leftovers({p.proc.pid for p in procs})
    for proc in leftovers:
        print(f"leftover after a graceful stop: pid {proc.pid} {proc.name()}; killing it", file=sys.stderr)
        proc.kill()


def _signal_moment(victim: Proc, args: argparse.Namespace) -> Callable[[], None]:
    """Wait until the victim is near the moment ``args.when``; return how to wait the last bit to it."""
    if args.when == "sync":
        victim.wait_for(ROUND_START, args.timeout)
        return lambda: time.sleep(args.delay)
    from swarm.config import load_config

    every = load_config(args.config, overrides=args.overrides, env={}).averaging.sync_every_steps
    before = re.compile(rf"step {max(every - 1, 1)} took ([\d.]+) s")
    _, _, step = victim.wait_for(before, args.timeout)
    return lambda: time.sleep(float(step.group(1)) / 2)


def bench(args: argparse.Namespace, root: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SWARM_LOG_LEVEL": "DEBUG", "OMP_NUM_THREADS": args.threads}
    common = ["--config", str(args.config), *_sets(args.overrides)]
    procs: list[Proc] = []
    try:
        boot = Proc("bootstrap", ["bootstrap", *common], env)
        procs.append(boot)
        _, _, line = boot.wait_for(re.compile(re.escape(JOIN_PREFIX) + r"(\S+)"), args.timeout)
        for i in range(1, args.trainers + 1):
            checkpoints = root / f"ckpt-{i}"
            join = ["join", "--initial-peers", line.group(1), *common]
            join += ["--set", f"train.checkpoint_dir={checkpoints}"]
            procs.append(Proc(f"trainer-{i}", join, env))
            procs[-1].wait_for(re.compile(r"joined run"), args.timeout)
        victim = procs[-1]
        last_bit = _signal_moment(victim, args)
        last_bit()
        mark = len(victim.lines)
        sent = time.monotonic()
        victim.proc.send_signal(signal.SIGINT)
        exited = victim.wait_exit(args.timeout)
        if exited is None:
            raise RuntimeError(f"the victim did not exit within {args.timeout} s of SIGINT")
        return _report(victim, mark, exited - sent, root / f"ckpt-{args.trainers}")
    finally:
        _stop_all(procs)


def _report(victim: Proc, mark: int, total: float, checkpoints: Path) -> dict[str, float]:
    text = [line for _, line in victim.lines[mark:]]
    numbers: dict[str, float] = {"total_s": total, "exit_code": float(victim.proc.returncode)}
    for name, pattern in PHASES.items():
        found = next((m for line in text if (m := pattern.search(line))), None)
        if found is not None:
            numbers[f"{name}_s"] = float(found.groups()[-1])
        if found is not None and name == "loop":
            numbers["stopped_at_step"] = float(found.group(1))
    files = sorted(checkpoints.glob("ckpt-*.pt"))
    numbers["checkpoint_bytes"] = float(files[-1].stat().st_size) if files else 0.0
    numbers["checkpoints_written"] = float(len(files))
    started = [line for line in text if AFTER_STOP.search(line) and "join:" not in line]
    print(f"victim's lines after the signal ({len(text)}):")
    for line in text:
        print(f"  | {line}")
    print(f"steps or rounds started or booked after the signal: {len(started)}")
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
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-shutdown-"))
    try:
        numbers = bench(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for key, value in numbers.items():
        print(f"{key:>20}: {value:.2f}" if key.endswith("_s") else f"{key:>20}: {value:.0f}")
    if numbers.get("checkpoint_s"):
        print(f"shutdown total / checkpoint write: {numbers['total_s'] / numbers['checkpoint_s']:.2f}x")


if __name__ == "__main__":
    main()
