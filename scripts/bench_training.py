#!/usr/bin/env python
"""Training benchmark on loopback: swarm gossip (int8) vs hivemind.Optimizer vs one solo peer.

Each backend runs as ``swarm local --peers N --config configs/local-tiny.yaml --duration S`` (a
bootstrap and N trainer processes), with the same model, data, learning rate, wall-time budget and
emulated device (:data:`REGIME`: ``emulation.step_time_s``, every inner step padded to the same device
time, so that peers sharing this machine's cores do not measure CPU contention). ``train.max_steps``
is raised so that the budget, not a step count, ends every run.

* gossip: ``averaging.backend=gossip``, int8 pseudo-gradients every H local steps.
* hivemind: ``averaging.backend=hivemind``, ``sync_every_steps = N * H``, so that each peer averages
  about every H of its own steps (an epoch is N * H * batch samples of the whole swarm).
* solo: ``averaging.backend=none``, one peer.

Reported per backend: ``seconds_to_target`` (from the first trainer's join until the mean of the
peers' latest held-out eval losses, read live from their histories (``--history``), is at or below
``--target`` bits/byte; null if never), ``final_eval_loss`` (mean over peers at shutdown), the
trainers' own summary numbers (:func:`summary_numbers`). scripts/bench_report.py runs the same
comparison over the emulated internet.

    .venv/bin/python scripts/bench_training.py                 # 4 peers, 150 s each
    .venv/bin/python scripts/bench_training.py --quick --json  # 2 peers, 45 s each; last line JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/local-tiny.yaml"

REGIME: dict[str, float] = {"batch_size": 1, "lr": 1e-3, "step_time_s": 0.1, "target": 3.6}
"""The bench regime (docs/benchmarks.md says why): per-peer batch, its learning rate, the emulated
device's seconds per inner step, and the target held-out loss in bits/byte."""


def regime_sets(batch_size: int | None = None, eval_every_rounds: int = 1) -> list[str]:
    """``--set`` overrides every benchmark run shares: the regime, a cheap evaluation, no step limit."""
    batch = int(batch_size or REGIME["batch_size"])
    return [
        f"train.batch_size={batch}",
        f"train.lr={REGIME['lr']}",
        f"emulation.step_time_s={REGIME['step_time_s']}",
        "train.eval_batches=1",
        f"train.eval_every_rounds={eval_every_rounds}",
        "train.max_steps=1000000",
    ]


def backends(peers: int, sync_every: int) -> list[tuple[str, int, list[str]]]:
    """(name, peers, --set overrides) per backend."""
    every = f"averaging.sync_every_steps={sync_every}"
    hivemind_every = f"averaging.sync_every_steps={peers * sync_every}"
    return [
        ("gossip", peers, ["averaging.backend=gossip", "compression.codec=int8", every]),
        ("hivemind", peers, ["averaging.backend=hivemind", "compression.codec=int8", hivemind_every]),
        ("solo", 1, ["averaging.backend=none", "averaging.outer_lr=1", "averaging.outer_momentum=0"]),
    ]


def child_env() -> dict[str, str]:
    """One torch thread per trainer: N trainers on a few shared cores must not oversubscribe them."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


class HistoryWatcher:
    """Reads the trainers' histories (``peer-<i>.history.jsonl``, ``swarm join --history``) as they
    grow; timestamps joins, steps and each sync's eval loss.

    A trainer's history holds its own record once when it joins, then once per sync (the monitor's
    snapshot schema, docs/monitor.md). ``curve`` holds ``(seconds since the first join, swarm samples,
    mean of the peers' latest eval losses)`` each time a poll sees that mean change once every peer
    has reported one; swarm samples are the peers' latest steps times ``batch``.
    """

    def __init__(self, log_dir: Path, peers: int, batch: int = 1):
        self.paths = [log_dir / f"peer-{i}.history.jsonl" for i in range(1, peers + 1)]
        self.batch = batch
        self.offsets = [0] * peers
        self.latest: list[float | None] = [None] * peers
        self.steps = [0] * peers
        self.joined: list[float | None] = [None] * peers
        self.first_round: list[tuple[float, int] | None] = [None] * peers
        self.started: float | None = None
        self.reached: float | None = None
        self.curve: list[tuple[float, int, float]] = []

    def poll(self, now: float, target: float) -> None:
        for index, path in enumerate(self.paths):
            if not path.exists():
                continue
            with path.open("rb") as history:
                history.seek(self.offsets[index])
                data = history.read()
            complete = data[: data.rfind(b"\n") + 1]  # a line being written is read next time
            self.offsets[index] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                self._snapshot(index, line, now)
        if self.started is None or None in self.latest:
            return
        mean = statistics.fmean(self.latest)
        if not self.curve or self.curve[-1][2] != mean:
            self.curve.append((now - self.started, self.samples(), mean))
        if self.reached is None and mean <= target:
            self.reached = now - self.started

    def samples(self) -> int:
        return sum(self.steps) * self.batch

    def _snapshot(self, index: int, line: str, now: float) -> None:
        try:
            [own] = json.loads(line)["peers"]
        except (ValueError, KeyError, TypeError):
            return  # not a trainer's own snapshot
        if self.joined[index] is None:
            self.joined[index] = now
            self.started = now if self.started is None else self.started
        self.steps[index] = int(own.get("step") or 0)
        if self.first_round[index] is None and own.get("round"):
            self.first_round[index] = (now, self.steps[index])
        if own.get("eval_loss") is not None:
            self.latest[index] = float(own["eval_loss"])


def run_backend(name: str, peers: int, overrides: list[str], args: argparse.Namespace, root: Path) -> dict:
    log_dir, summary_path = root / name, root / f"{name}.summary.json"
    sets = [*regime_sets(), *overrides]
    command = [sys.executable, "-m", "peers.cli", "local", "--peers", str(peers), "--config", CONFIG]
    command += [a for s in sets for a in ("--set", s)]
    command += ["--duration", str(args.duration), "--log-dir", str(log_dir), "--summary", str(summary_path)]
    print(f"[bench] {name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    watcher = HistoryWatcher(log_dir, peers, int(REGIME["batch_size"]))
    with (root / f"{name}.local.log").open("wb") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            watcher.poll(time.monotonic(), args.target)
            time.sleep(0.5)  # the logs are files other processes append to: poll them
    watcher.poll(time.monotonic(), args.target)
    row: dict[str, Any] = {"backend": name, "peers": peers, "seconds_to_target": watcher.reached}
    if not summary_path.exists():
        return {**row, "error": f"no summary (swarm local exited {proc.returncode}); see {log_dir}"}
    return {**row, **summary_numbers(json.loads(summary_path.read_text())["per_peer"])}


@functools.cache
def n_params() -> int:
    from swarm.config import load_config
    from swarm.training import build_model, count_parameters

    config = load_config(REPO / CONFIG, overrides=[], env={})
    return count_parameters(build_model(config.model, config.run.seed))


def summary_numbers(per_peer: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's numbers from the trainers' ``--summary`` files (``peers/join.py``).

    ``wire_bytes_per_param_per_sync``: everything a peer sent for averaging (both roles, every
    exchange kind) per round and parameter, mean over peers; ``exchange_bytes_per_param``: one
    pseudo-gradient exchange (gossip) or all-reduce round, one direction; ``utilization_since_start``:
    device seconds over each trainer's whole life (start-up and joining included), mean over peers;
    ``compute_per_step_s``: the real forward, backward and optimizer time per step, mean over steps.
    """

    def mean(key: str) -> float | None:
        values = [p[key] for p in per_peer if p.get(key) is not None]
        return statistics.fmean(values) if values else None

    steps = sum(p.get("steps", 0) for p in per_peer)
    roles: Counter[str] = Counter()
    for peer in per_peer:
        roles.update(peer.get("rounds_by_role") or {})
    return {
        "final_eval_loss": mean("eval_loss"),
        "wire_bytes_per_param_per_sync": mean("wire_bytes_per_param_per_sync"),
        "exchange_bytes_per_param": mean("exchange_bytes_per_param"),
        "utilization_since_start": mean("utilization"),
        "steps_per_peer": steps / max(len(per_peer), 1),
        "syncs_per_peer": sum(p.get("rounds", 0) for p in per_peer) / max(len(per_peer), 1),
        "samples_total": sum(p.get("samples", 0) for p in per_peer),
        "compute_per_step_s": sum(p.get("compute_seconds", 0.0) for p in per_peer) / steps if steps else None,
        "rounds_by_role": dict(roles),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 peers, 45 s per backend (under 5 minutes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    parser.add_argument("--peers", type=int, default=None, help="trainers for gossip and hivemind (4)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per backend (150)")
    parser.add_argument("--target", type=float, default=REGIME["target"], help="target eval loss, bits/byte")
    parser.add_argument("--sync-every", type=int, default=10, help="H: local steps between syncs (10)")
    args = parser.parse_args()
    peers = args.peers or (2 if args.quick else 4)
    args.duration = args.duration or (45.0 if args.quick else 150.0)
    mode = f"{peers} peers, {args.duration:.0f} s"
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
