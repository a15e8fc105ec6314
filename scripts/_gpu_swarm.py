"""The swarm step of scripts/gpu_check.sh: `swarm local` with two peers until each committed an exchange.

    python -m scripts._gpu_swarm --timeout S --log-dir DIR --summary F.json [--set KEY=VALUE ...]

The trainers run without a step limit, so that a fast peer cannot finish before its partner joined;
the run ends (Ctrl+C, the graceful stop) once every trainer's log shows a sync that committed, or
after ``--timeout`` seconds, or on a SIGTERM (``timeout``). Exits with `swarm local`'s status (which is 1
when anything of a peer outlived it), or 1 when the exchanges did not come in time; the summary then
says what each peer did.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

PEERS = 2
SYNC_OK = re.compile(r"^round +\d+ step +\d+ .* sync ok with ", re.MULTILINE)
"""A trainer's per-sync line (peers/_trainer_output.py) for an exchange that committed."""
POLL_S = 0.5
STOP_S = 25.0
"""How long the graceful stop may take (each peer saves and takes its DHT worker down); then
`swarm local` is killed, and its peers go down with it."""


def committed(log: Path) -> bool:
    """Whether the trainer that writes ``log`` committed an exchange."""
    return log.exists() and SYNC_OK.search(log.read_text(errors="replace")) is not None


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # `timeout` ran out: stop `swarm local` on the way out (below)


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    sets = [a for s in args.sets for a in ("--set", s)]
    argv = [sys.executable, "-m", "peers.cli", "local", "--peers", str(PEERS), "--config", args.config]
    argv += ["--duration", str(args.timeout), "--log-dir", str(args.log_dir), "--summary", str(args.summary)]
    argv += [*sets, "--set", "train.max_steps=1000000"]
    logs = [args.log_dir / f"peer-{i}.log" for i in range(1, PEERS + 1)]
    local = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + args.timeout
    try:
        # polling the trainers' logs, which other processes write: there is nothing to wait on
        while local.poll() is None and not all(map(committed, logs)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        done = all(map(committed, logs))
        print(f"gpu_check: every trainer committed an exchange: {done}", flush=True)
    finally:
        if local.poll() is None:
            local.send_signal(signal.SIGINT)
        try:
            status = local.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            local.kill()  # its children die with it (PR_SET_PDEATHSIG)
            status = local.wait()
    return status if done else 1


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt-125m.yaml")
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--log-dir", type=Path, required=True)
    parser.add_argument("--summary", type=Path, required=True)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
