"""Training benchmark on loopback: swarm gossip (int8) vs hivemind.Optimizer vs one solo peer.

Each backend runs as ``swarm local --peers N --config configs/local-tiny.yaml --duration S`` (a
bootstrap and N trainer processes), with the same model, data, learning rate, wall-time budget and
emulated device (``_runner.REGIME``: ``emulation.step_time_s``, every inner step padded to the same device
time, so that peers sharing this machine's cores do not measure CPU contention). ``train.max_steps``
is raised so that the budget, not a step count, ends every run.

* gossip: ``averaging.backend=gossip``: every H local steps a pair of peers exchanges its models,
  each relative to a base the two share (the change in ``compression.delta_codec``, int4), or whole
  in ``compression.codec`` (int8) where they share none.
* hivemind: ``averaging.backend=hivemind``, ``sync_every_steps = N * H``, so that each peer averages
  about every H of its own steps (an epoch is N * H * batch samples of the whole swarm).
* solo: ``averaging.backend=none``, one peer.

Reported per backend: ``seconds_to_target`` (from the first trainer's join until the mean of the
peers' latest held-out eval losses, read live from their histories (``--history``), is at or below
``--target`` bits/byte; null if never), ``final_eval_loss`` (mean over peers at shutdown), the
trainers' own summary numbers (:func:`summary_numbers`). scripts/bench_report.py runs the same
comparison over the emulated internet.

    .venv/bin/python -m scripts.bench_training                 # 4 peers, 150 s each
    .venv/bin/python -m scripts.bench_training --quick --json  # 2 peers, 45 s each; last line JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts import _rows, _runner

REGIME = _runner.REGIME
REPO = _runner.REPO


def backends(peers: int, sync_every: int) -> list[tuple[str, int, list[str]]]:
    """(name, peers, --set overrides) per backend."""
    every = f"averaging.sync_every_steps={sync_every}"
    hivemind_every = f"averaging.sync_every_steps={peers * sync_every}"
    return [
        ("gossip", peers, ["averaging.backend=gossip", "compression.codec=int8", every]),
        ("hivemind", peers, ["averaging.backend=hivemind", "compression.codec=int8", hivemind_every]),
        ("solo", 1, ["averaging.backend=none", "averaging.outer_lr=1", "averaging.outer_momentum=0"]),
    ]


def run_backend(name: str, peers: int, overrides: list[str], args: argparse.Namespace, root: Path) -> dict:
    log_dir, summary_path = root / name, root / f"{name}.summary.json"
    sets = [*_runner.regime_sets(), *overrides]
    command = [sys.executable, "-m", "peers.cli", "local", "--peers", str(peers), "--config", _runner.CONFIG]
    command += [a for s in sets for a in ("--set", s)]
    command += ["--duration", str(args.duration), "--log-dir", str(log_dir), "--summary", str(summary_path)]
    print(f"[bench] {name}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
    watcher = _runner.HistoryWatcher(log_dir, peers, int(REGIME["batch_size"]))
    with (root / f"{name}.local.log").open("wb") as out:
        env = _runner.child_env()
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            watcher.poll(time.monotonic(), args.target)
            time.sleep(0.5)  # the logs are files other processes append to: poll them
    watcher.poll(time.monotonic(), args.target)
    row: dict[str, Any] = {"backend": name, "peers": peers, "seconds_to_target": watcher.reached}
    if not summary_path.exists():
        return {**row, "error": f"no summary (swarm local exited {proc.returncode}); see {log_dir}"}
    return {**row, **_rows.summary_numbers(json.loads(summary_path.read_text())["per_peer"])}


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
