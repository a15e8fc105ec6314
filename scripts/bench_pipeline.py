"""Pipeline stages across peers (docs/pipeline.md, "Measured"): three measurements, one JSON report.

``wiring``: stochastic wiring against fixed pipelines on the same peers, over the emulated internet
(testbed/netlab.py, needs root): two data holders and three stage-1 peers, every link shaped to
``--rate``, every device emulated (``emulation.step_time_s``) and the stage-1 peer that the fixed wiring
pins to the first data holder three times slower. Fixed wiring is two static pipelines (data holder i
always uses the i-th stage-1 peer, the third one idles, as a pipeline of fixed width would); stochastic
wiring lets each micro-batch go to any stage-1 peer by measured throughput and queue. Throughput is the
data holders' trained samples per second over a window after a warm-up, read from their histories
(``--history``: the step of each round they book).

``bytes``: activation and gradient bytes on the wire per trained token, from the same runs' summaries,
next to the analytic frame size (``swarm.pipeline.activation_wire_bytes``).

``memory``: the largest model that trains with each peer's memory capped by a cgroup (v1 ``memory``
controller, root): a gossip trainer holding a whole model of about ``P`` parameters fits, the same
trainer with a model 4x larger is killed by the cap, and a 4-stage pipeline of that larger model trains
under the same cap per peer (its loss, in its history, goes down). The cap is the small model's
measured peak plus a margin, so it is "one peer's memory" by construction.

    sudo .venv/bin/python -m scripts.bench_pipeline --out runs/bench-pipeline.json [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from peers.local import terminate_and_wait
from testbed import netlab

REPO = Path(__file__).resolve().parent.parent
CONFIG = "configs/local-tiny.yaml"
START_TIMEOUT_S = 300.0
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")

COMMON = [
    "pipeline.num_stages=2",
    "pipeline.rebalance_every_s=null",
    "pipeline.max_inflight=8",
    "train.max_steps=1000000",
    "train.eval_every_rounds=1000000",
    "averaging.sync_every_steps=5",
    "network.record_interval_s=2",
    "network.record_ttl_s=8",
]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def sets(values: list[str]) -> list[str]:
    return [arg for value in values for arg in ("--set", value)]


class Swarm:
    """A bootstrap and peers, each a ``swarm`` process with its log; stopped with SIGTERM, then killed."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], wrap: list[str] | None = None) -> subprocess.Popen:
        with (self.log_dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                [*(wrap or []), sys.executable, "-m", "peers.cli", *args],
                cwd=REPO, env=env(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        self.processes[name] = proc
        return proc

    def files(self, name: str) -> list[str]:
        """``swarm join`` arguments: ``name``'s summary and history files in the log folder."""
        summary, history = self.log_dir / f"{name}.summary.json", self.history(name)
        return ["--summary", str(summary), "--history", str(history)]

    def history(self, name: str) -> Path:
        return self.log_dir / f"{name}.history.jsonl"

    def records(self, name: str) -> list[dict[str, Any]]:
        """``name``'s own record in each line of its history so far (the first: when it joined)."""
        from swarm.metrics import read_history

        path = self.history(name)
        return [snap["peers"][0] for snap in read_history(path)] if path.exists() else []

    def steps(self, name: str) -> int:
        """The latest step ``name``'s history reports."""
        records = self.records(name)
        return int(records[-1].get("step") or 0) if records else 0

    def start_bootstrap(self, args: list[str], wrap: list[str] | None = None) -> str:
        """Start the bootstrap; return the multiaddr joiners dial (its join line)."""
        from peers.local import wait_for_join_line

        proc = self.start("bootstrap", ["bootstrap", *args], wrap=wrap)
        return wait_for_join_line(self.log_dir / "bootstrap.log", proc, timeout_s=START_TIMEOUT_S)

    def wait_round(self, name: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until ``name`` has booked a round (a line of its history past the first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r.get("round") for r in self.records(name)):
                return
            if self.processes[name].poll() is not None:
                raise RuntimeError(f"{name} exited ({self.processes[name].returncode}); see {self.log_dir}")
            time.sleep(0.25)  # polling a history file another process writes
        raise RuntimeError(f"{name}: no round booked within {timeout_s:.0f} s; see {self.log_dir}")

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the data holders first (their summaries' final evaluation runs through the other
        stages), then everyone else; SIGKILL what is left after ``grace_s`` each."""
        holders = [name for name in self.processes if name.startswith(("holder", "peer-0"))]
        for group in (holders, [name for name in self.processes if name not in holders]):
            terminate_and_wait([self.processes[name] for name in group], grace_s)
        for proc in self.processes.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---------------------------------------------------------------- wiring and bytes


def wiring_run(routing: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One run over the lab: 2 data holders, 3 stage-1 peers (the first holder's fixed peer 3x slower)."""
    from swarm.network import ensure_identity, peer_id_of_identity

    run = Swarm(root / f"wiring-{routing}")
    keys = [ensure_identity(run.log_dir / f"server-{i}.key") for i in range(3)]
    ranked = sorted(range(3), key=lambda i: peer_id_of_identity(keys[i]))
    slow = ranked[0]  # fixed wiring pins data holder 0 (by rank) to the stage-1 peer ranked first
    base = ["--config", CONFIG, *sets([*COMMON, f"pipeline.routing={routing}"])]
    with netlab.NetLab(hosts=6, rate=args.rate) as lab:
        try:
            host = lab.hosts[0]
            maddr = run.start_bootstrap([*base, "--host-maddrs", host.maddr()], wrap=host.command([]))
            for i in range(3):
                host = lab.hosts[3 + i]
                extra = [f"emulation.step_time_s={args.step_time}"] + (
                    [f"emulation.slowdown={args.slowdown}"] if i == slow else []
                )
                run.start(f"server-{i}", [
                    "join", *base, *sets(extra), "--stage", "1", "--initial-peers", maddr,
                    "--host-maddrs", host.maddr(), "--identity-path", str(keys[i]), *run.files(f"server-{i}"),
                ], wrap=host.command([]))  # fmt: skip
            for i in range(2):
                host = lab.hosts[1 + i]
                run.start(f"holder-{i}", [
                    "join", *base, *sets([f"emulation.step_time_s={args.holder_step_time}"]), "--stage", "0",
                    "--initial-peers", maddr, "--host-maddrs", host.maddr(), *run.files(f"holder-{i}"),
                ], wrap=host.command([]))  # fmt: skip
            for i in range(2):
                run.wait_round(f"holder-{i}")
            time.sleep(args.warmup)
            start = time.monotonic()
            first = [run.steps(f"holder-{i}") for i in range(2)]
            time.sleep(args.window)
            last = [run.steps(f"holder-{i}") for i in range(2)]
            seconds = time.monotonic() - start
        finally:
            run.stop()
    batch = 16  # configs/local-tiny.yaml
    summaries = {
        name: _summary(run.log_dir / f"{name}.summary.json") for name in run.processes if name != "bootstrap"
    }
    return {
        "routing": routing,
        "samples_per_s": sum(b - a for a, b in zip(first, last, strict=True)) * batch / seconds,
        "window_s": seconds,
        "slow_server": f"server-{slow}",
        "microbatches_per_server": {
            n: s.get("pipeline", {}).get("committed_microbatches")
            for n, s in summaries.items()
            if n.startswith("server")
        },
        "activation_bytes_per_token": _bytes_per_token(summaries),
        "logs": str(run.log_dir),
    }


def _summary(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _bytes_per_token(summaries: dict[str, dict[str, Any]]) -> float | None:
    """Bytes the data holders sent and received on stage streams per token they trained."""
    holders = [s for name, s in summaries.items() if name.startswith("holder") and s]
    tokens = sum(s["samples"] for s in holders) * 64  # block_size of configs/local-tiny.yaml
    moved = sum(s["activation_bytes_sent"] + s["activation_bytes_received"] for s in holders)
    return moved / tokens if tokens else None


# ---------------------------------------------------------------- memory


def model_sets(width: int, layers: int) -> list[str]:
    """A model of ``layers`` blocks of ``width``, syncing every 2 steps (so its history shows losses soon)."""
    model = [f"model.n_embd={width}", f"model.n_layer={layers}", "model.n_head=4", "model.block_size=64"]
    return [*model, "averaging.sync_every_steps=2"]


class MemoryCap:
    """A cgroup (v1 memory controller) whose processes share ``limit`` bytes; reports their peak."""

    def __init__(self, name: str, limit: int | None) -> None:
        self.path = CGROUP_ROOT / f"swarm-bench-{os.getpid()}-{name}"
        self.path.mkdir()
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def wrap(self) -> list[str]:
        """argv prefix putting the command into this cgroup before it starts."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "capped"]

    def peak(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

    def oom_killed(self) -> bool:
        return int((self.path / "memory.failcnt").read_text()) > 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.path.rmdir()


def memory_run(
    name: str, model: list[str], stages: int, limit: int | None, args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    """A bootstrap (not capped) and ``stages`` peers (one per stage, 1: a gossip trainer), each capped."""
    run = Swarm(root / f"memory-{name}")
    base = [
        "--config",
        CONFIG,
        *sets([*COMMON, *model, f"pipeline.num_stages={stages}", "pipeline.microbatch_size=4"]),
    ]
    caps = [MemoryCap(f"{name}-{i}", limit) for i in range(stages)]
    row: dict[str, Any] = {"name": name, "stages": stages, "limit": limit, "model": model}
    try:
        maddr = run.start_bootstrap(base)
        for i in range(stages):
            stage = ["--stage", str(i)] if stages > 1 else []
            join = ["join", *base, *stage, "--initial-peers", maddr, *run.files(f"peer-{i}")]
            run.start(f"peer-{i}", join, wrap=caps[i].wrap())
        deadline = time.monotonic() + args.memory_budget_s
        while time.monotonic() < deadline and run.steps("peer-0") < args.memory_steps:
            if any(p.poll() is not None for n, p in run.processes.items() if n != "bootstrap"):
                break
            time.sleep(1.0)  # polling a history file another process writes
        row["steps"] = run.steps("peer-0")
        row["losses"] = [
            r["loss"] for r in run.records("peer-0") if r.get("round") and r.get("loss") is not None
        ]
        row["exited"] = {
            n: p.poll() for n, p in run.processes.items() if n != "bootstrap" and p.poll() is not None
        }
    finally:
        run.stop()
        row["peaks"] = [cap.peak() for cap in caps]
        row["oom"] = [cap.oom_killed() for cap in caps]
        for cap in caps:
            cap.close()
    row["trained"] = (
        row["steps"] >= args.memory_steps and len(row["losses"]) >= 2 and row["losses"][-1] < row["losses"][0]
    )
    row["logs"] = str(run.log_dir)
    return row


def memory_phase(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from swarm.config import load_config
    from swarm.pipeline import build_full, stage_parameters

    small, large = model_sets(args.width, args.layers), model_sets(args.width, 4 * args.layers)
    count = {
        label: stage_parameters(build_full(load_config(CONFIG, overrides=[*COMMON, *m], env={}).model, 0))
        for label, m in (("small", small), ("large", large))
    }
    fits = memory_run("whole-small", small, 1, None, args, root)
    limit = int(max(fits["peaks"]) * (1 + args.margin))
    return {
        "parameters": count,
        "cap_bytes": limit,
        "runs": [
            fits,
            memory_run("whole-small-capped", small, 1, limit, args, root),
            memory_run("whole-large-capped", large, 1, limit, args, root),
            memory_run("pipeline-large-capped", large, 4, limit, args, root),
        ],
    }


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-pipeline.json"))
    parser.add_argument("--only", choices=("wiring", "memory"), default=None)
    parser.add_argument("--quick", action="store_true", help="shorter windows (noisier numbers)")
    parser.add_argument("--rate", default="50mbit")
    parser.add_argument(
        "--step-time", type=float, default=1.6, help="emulated device seconds per batch, stage 1"
    )
    parser.add_argument("--holder-step-time", type=float, default=0.8, help="the same for the data holders")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--window", type=float, default=120.0)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--margin", type=float, default=0.15, help="the cap: the small model's peak plus this share"
    )
    parser.add_argument("--memory-steps", type=int, default=4)
    parser.add_argument("--memory-budget-s", type=float, default=420.0)
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.window, args.memory_budget_s = 20.0, 60.0, 300.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(
        tempfile.mkdtemp(prefix="bench-pipeline-", dir=REPO / "runs" if (REPO / "runs").exists() else None)
    )
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "logs": str(root)}
    if args.only in (None, "wiring"):
        if netlab.unavailable_reason():
            report["wiring"] = {"skipped": netlab.unavailable_reason()}
        else:
            runs = [wiring_run(routing, args, root) for routing in ("fixed", "stochastic")]
            fixed, stochastic = (r["samples_per_s"] for r in runs)
            report["wiring"] = {"runs": runs, "speedup": stochastic / fixed if fixed else None}
            print(f"wiring: fixed {fixed:.1f} samples/s, stochastic {stochastic:.1f} samples/s "
                  f"({report['wiring']['speedup']:.2f}x); activation bytes per token "
                  f"{[r['activation_bytes_per_token'] for r in runs]}", flush=True)  # fmt: skip
    if args.only in (None, "memory"):
        report["memory"] = memory_phase(args, root)
        for row in report["memory"]["runs"]:
            print(f"memory {row['name']}: trained {row['trained']} steps {row['steps']} peaks "
                  f"{[p >> 20 for p in row['peaks']]} MiB oom {row['oom']}", flush=True)  # fmt: skip
    from swarm.config import load_config
    from swarm.pipeline import activation_wire_bytes

    frame = activation_wire_bytes(load_config(CONFIG, overrides=COMMON, env={}))
    report["activation_frame_bytes_per_sample"] = frame
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"report written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
