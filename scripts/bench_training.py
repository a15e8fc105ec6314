#!/usr/bin/env python
"""Training benchmark on loopback: swarm gossip (int8) vs hivemind.Optimizer vs one solo peer.

Each backend runs as ``swarm local --peers N --config configs/local-tiny.yaml --duration S`` (a
bootstrap and N trainer processes), with the same model, data, learning rate and wall-time budget.
``train.max_steps`` is raised so that the budget, not a step count, ends every run (the learning
rate is then flat after the warm-up, the same for all).

* gossip: ``averaging.backend=gossip``, int8 pseudo-gradients every H local steps (local-tiny: 10).
* hivemind: ``averaging.backend=hivemind``, ``sync_every_steps = N * H``, so that each peer averages
  about every H of its own steps (an epoch is N * H * batch samples of the whole swarm).
* solo: ``averaging.backend=none``, one peer.

Reported per backend: ``seconds_to_target`` (from the first trainer's join line until the mean of
the peers' latest held-out eval losses, read live from their per-sync log lines, is at or below
``--target`` bits/byte; null if never), ``final_eval_loss`` (mean over peers at shutdown),
``wire_bytes_per_param_per_sync`` (bytes the peers sent, all averaging traffic, per parameter and
per sync round of a peer), ``utilization`` (share of wall time in forward/backward/optimizer).

    .venv/bin/python scripts/bench_training.py                 # 4 peers, 150 s each
    .venv/bin/python scripts/bench_training.py --quick --json  # 2 peers, 45 s each; last line JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/local-tiny.yaml"
SYNC_LINE = re.compile(r"^round\s+(\d+) step\s+(\d+) loss \S+ eval (\S+)")
JOINED = re.compile(r"^peer \S+ joined run")


def backends(peers: int, sync_every: int) -> list[tuple[str, int, list[str]]]:
    """(name, peers, --set overrides) per backend."""
    hivemind_every = f"averaging.sync_every_steps={peers * sync_every}"
    return [
        ("gossip", peers, ["averaging.backend=gossip", "compression.codec=int8"]),
        ("hivemind", peers, ["averaging.backend=hivemind", "compression.codec=int8", hivemind_every]),
        ("solo", 1, ["averaging.backend=none"]),
    ]


def child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


class LogWatcher:
    """Reads the peers' logs as they grow and timestamps each sync line's eval loss.

    ``curve`` holds ``(seconds since the first join line, mean of the peers' latest eval losses)``
    each time a poll sees a new eval value once every peer has reported one.
    """

    def __init__(self, log_dir: Path, peers: int):
        self.paths = [log_dir / f"peer-{i}.log" for i in range(1, peers + 1)]
        self.offsets = [0] * peers
        self.latest: list[float | None] = [None] * peers
        self.started: float | None = None
        self.reached: float | None = None
        self.curve: list[tuple[float, float]] = []

    def poll(self, now: float, target: float) -> None:
        for index, path in enumerate(self.paths):
            if not path.exists():
                continue
            with path.open(errors="replace") as log:
                log.seek(self.offsets[index])
                text = log.read()
            complete = text[: text.rfind("\n") + 1]
            self.offsets[index] += len(complete.encode(errors="replace"))
            for line in complete.splitlines():
                self._line(index, line, now)
        if self.started is None or None in self.latest:
            return
        mean = statistics.fmean(self.latest)
        if not self.curve or self.curve[-1][1] != mean:
            self.curve.append((now - self.started, mean))
        if self.reached is None and mean <= target:
            self.reached = now - self.started

    def _line(self, index: int, line: str, now: float) -> None:
        if JOINED.match(line) and self.started is None:
            self.started = now
        match = SYNC_LINE.match(line)
        if match and match.group(3) != "-":
            self.latest[index] = float(match.group(3))


def run_backend(name: str, peers: int, overrides: list[str], args: argparse.Namespace, root: Path) -> dict:
    log_dir, summary_path = root / name, root / f"{name}.summary.json"
    sets = [*overrides, "train.max_steps=1000000"]
    command = [sys.executable, "-m", "peers.cli", "local", "--peers", str(peers), "--config", CONFIG]
    command += [a for s in sets for a in ("--set", s)]
    command += ["--duration", str(args.duration), "--log-dir", str(log_dir), "--summary", str(summary_path)]
    print(f"[bench] {name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    watcher = LogWatcher(log_dir, peers)
    with (root / f"{name}.local.log").open("wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            watcher.poll(time.monotonic(), args.target)
            time.sleep(0.5)  # the logs are files other processes append to: poll them
    watcher.poll(time.monotonic(), args.target)
    return summarize(name, peers, summary_path, watcher, proc.returncode)


@functools.cache
def n_params() -> int:
    from swarm.config import load_config
    from swarm.training import build_model, count_parameters

    config = load_config(REPO / CONFIG, overrides=[], env={})
    return count_parameters(build_model(config.model, config.run.seed))


def summarize(name: str, peers: int, path: Path, watcher: LogWatcher, status: int) -> dict[str, Any]:
    row: dict[str, Any] = {"backend": name, "peers": peers, "seconds_to_target": watcher.reached}
    if not path.exists():
        return {**row, "error": f"no summary (swarm local exited {status}); see {path.parent / name}"}
    return {**row, **summary_numbers(json.loads(path.read_text()))}


def summary_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    """The benchmark's numbers from a ``swarm local`` summary (``peers._local_summary.swarm_summary``).

    ``exchange_bytes_per_param`` is what one pseudo-gradient exchange (gossip) or all-reduce round
    (hivemind) sent, per parameter: the codec's cost, without parameter exchanges or state downloads.
    """
    per_peer = summary["per_peer"]
    rounds = sum(p.get("rounds", 0) for p in per_peer)
    sent = sum(p.get("wire_bytes_total", 0) for p in per_peer) / 2  # sent ~ received over the swarm
    return {
        "final_eval_loss": summary["eval_loss"],
        "wire_bytes_per_param_per_sync": sent / rounds / n_params() if rounds else None,
        "exchange_bytes_per_param": summary["wire_bytes_per_param_per_sync"],
        "utilization": summary["utilization"],
        "steps_per_peer": statistics.fmean(p.get("steps", 0) for p in per_peer),
        "syncs_per_peer": rounds / max(len(per_peer), 1),
        "tokens_per_second": summary["tokens_per_second"],
        "baseline_unigram_loss": summary["baseline_unigram_loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 peers, 45 s per backend (under 5 minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--peers", type=int, default=None, help="trainers for gossip and hivemind (4)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per backend (150)")
    parser.add_argument("--target", type=float, default=4.5, help="target eval loss, bits/byte (4.5)")
    parser.add_argument("--sync-every", type=int, default=10, help="H: local steps between syncs (10)")
    args = parser.parse_args()
    peers = args.peers or (2 if args.quick else 4)
    args.duration = args.duration or (45.0 if args.quick else 150.0)
    mode = "quick: 2 peers, 45 s" if args.quick else f"{peers} peers, {args.duration:.0f} s"
    print(f"[bench] {mode} per backend, target {args.target} bits/byte", file=sys.stderr, flush=True)
    (REPO / "runs").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-training-", dir=REPO / "runs"))
    rows = [run_backend(name, n, sets, args, root) for name, n, sets in backends(peers, args.sync_every)]
    for row in rows:
        print(json.dumps(row) if args.json else row, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"rows": rows, "mode": mode, "target": args.target, "logs": str(root)}))


if __name__ == "__main__":
    main()
