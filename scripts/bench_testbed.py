"""Training runs over the emulated internet (scripts/netlab.py), for scripts/bench_report.py.

One run = one lab: a bootstrap in host 0 and one trainer per further host, each started with
``swarm bootstrap`` / ``swarm join`` inside its namespace and listening on the host's 10.77.0.x address,
every link shaped to the same rate. The wall-time budget starts at the first trainer's join line (as
in scripts/bench_training.py, whose log parsing and summary numbers are reused) and ends with SIGTERM
to every trainer, which then writes its summary. The lab tears itself down even on Ctrl+C.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

try:  # imported as scripts.bench_testbed (tests) or run from scripts/ (python scripts/x.py)
    from scripts import bench_training, netlab
except ImportError:  # pragma: no cover - depends on how the caller was started
    import bench_training
    import netlab

START_TIMEOUT_S = 180.0  # on a busy 2-core machine four trainers importing torch take a while
STOP_GRACE_S = 30.0


@dataclass(frozen=True)
class Plan:
    """One training run: backend name, number of trainers, ``--set`` overrides, the slowed-down trainer."""

    name: str
    peers: int
    sets: list[str]
    slow_peer: int | None = None  # 1-based trainer index that gets train.slowdown
    label: str = ""


@dataclass
class Run:
    """The processes and logs of one run."""

    log_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)


def comparison_plans(peers: int, sync_every: int, slow_peer: int | None, fp32: bool) -> list[Plan]:
    """gossip int8 and int4 (and fp32), hivemind.Optimizer and solo, as in bench_training.backends."""
    by_name = {name: (n, sets) for name, n, sets in bench_training.backends(peers, sync_every)}
    gossip_n, gossip_sets = by_name["gossip"]
    plans = [
        Plan("gossip-int8", gossip_n, gossip_sets, slow_peer, "swarm gossip, int8"),
        Plan("gossip-int4", gossip_n, _codec(gossip_sets, "int4"), slow_peer, "swarm gossip, int4"),
    ]
    if fp32:
        fp32_sets = _codec(gossip_sets, "fp32")
        plans.append(Plan("gossip-fp32", gossip_n, fp32_sets, slow_peer, "swarm gossip, fp32"))
    plans.append(Plan("hivemind", *by_name["hivemind"], slow_peer, "hivemind.Optimizer, int8 blockwise"))
    plans.append(Plan("solo", *by_name["solo"], None, "solo (one peer, no averaging)"))
    return plans


def _codec(sets: list[str], codec: str) -> list[str]:
    return [s for s in sets if not s.startswith("compression.codec=")] + [f"compression.codec={codec}"]


def run_plan(
    plan: Plan,
    *,
    root: Path,
    rate: str,
    budget_s: float,
    target: float,
    slowdown: float,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Run ``plan`` in a fresh lab; return its row (with ``curve``), or a row with ``error``."""
    run = Run(root / plan.name)
    run.log_dir.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"backend": plan.name, "label": plan.label, "peers": plan.peers}
    with netlab.NetLab(hosts=plan.peers + 1, rate=rate) as lab:
        try:
            watcher, seconds = _train(lab, run, plan, budget_s, target, slowdown, say)
        except RuntimeError as exc:
            _stop(run)
            return {**row, "error": str(exc)}
    return {**row, **_numbers(run, plan, watcher, seconds, slowdown)}


def _train(lab, run: Run, plan: Plan, budget_s: float, target: float, slowdown: float, say) -> tuple:
    common = _common_args(plan.sets)
    maddr = _start_bootstrap(lab, run, common)
    for index in range(1, plan.peers + 1):
        extra = ["--set", f"train.slowdown={slowdown}"] if index == plan.slow_peer else []
        _start_trainer(lab, run, index, maddr, [*common, *extra])
    watcher = bench_training.LogWatcher(run.log_dir, plan.peers)
    deadline = time.monotonic() + START_TIMEOUT_S
    while watcher.started is None:
        _check(run, deadline, "no trainer joined")
        watcher.poll(time.monotonic(), target)
        time.sleep(0.5)  # polling log files that other processes append to
    say(f"{plan.name}: first trainer joined; training for {budget_s:.0f} s over {lab.rate} links")
    end = watcher.started + budget_s
    while time.monotonic() < end:
        _check(run, end + 1.0, "")
        watcher.poll(time.monotonic(), target)
        time.sleep(0.5)
    seconds = time.monotonic() - watcher.started
    _stop(run)
    watcher.poll(time.monotonic(), target)
    return watcher, seconds


def _common_args(sets: list[str]) -> list[str]:
    common = ["--config", bench_training.CONFIG, "--set", "train.max_steps=1000000"]
    return common + [a for s in sets for a in ("--set", s)]


def _start_bootstrap(lab, run: Run, common: list[str]) -> str:
    """Start the bootstrap in host 0; return the multiaddr joiners dial."""
    from peers.local import wait_for_join_line

    host = lab.hosts[0]
    boot = _start(run, host, "bootstrap", ["bootstrap", *common, "--host-maddrs", host.maddr()])
    return wait_for_join_line(run.log_dir / "bootstrap.log", boot, timeout_s=90)


def _start_trainer(lab, run: Run, index: int, maddr: str, common: list[str]) -> None:
    host = lab.hosts[index]
    args = ["join", *common, "--initial-peers", maddr, "--host-maddrs", host.maddr()]
    _start(run, host, f"peer-{index}", [*args, *_peer_files(run, index)])


def _peer_files(run: Run, index: int) -> list[str]:
    summary = run.log_dir / f"peer-{index}.summary.json"
    checkpoints = run.log_dir / f"peer-{index}" / "checkpoints"
    names = ["--public-name", f"bench-{index}", "--summary", str(summary)]
    return [*names, "--set", f"train.checkpoint_dir={checkpoints}"]


def _start(run: Run, host, name: str, args: list[str]) -> subprocess.Popen:
    from peers.local import _die_with_parent

    with (run.log_dir / f"{name}.log").open("wb") as log:
        proc = host.popen(
            [sys.executable, "-m", "peers.cli", *args],
            cwd=bench_training.REPO,
            env=bench_training.child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
    run.processes[name] = proc
    return proc


def _check(run: Run, deadline: float, timeout_message: str) -> None:
    failed = {name: p.returncode for name, p in run.processes.items() if p.poll() is not None}
    if failed:
        raise RuntimeError(f"exited early: {failed}; see the logs in {run.log_dir}")
    if time.monotonic() > deadline:
        raise RuntimeError(f"{timeout_message} within {START_TIMEOUT_S:.0f} s; see {run.log_dir}")


def _stop(run: Run) -> None:
    """SIGTERM the trainers (they write their summaries), then the bootstrap; the lab kills leftovers."""
    trainers = [p for name, p in run.processes.items() if name != "bootstrap"]
    for group in (trainers, [run.processes.get("bootstrap")]):
        alive = [p for p in group if p is not None and p.poll() is None]
        for proc in alive:
            proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))


class StepWatcher(bench_training.LogWatcher):
    """Also keeps, per peer, ``(when seen, step)`` of its latest sync line."""

    def __init__(self, log_dir: Path, peers: int):
        super().__init__(log_dir, peers)
        self.steps: list[tuple[float, int] | None] = [None] * peers

    def _line(self, index: int, line: str, now: float) -> None:
        super()._line(index, line, now)
        match = bench_training.SYNC_LINE.match(line)
        if match:
            self.steps[index] = (now, int(match.group(2)))


SCALING_SETS = ["averaging.backend=gossip", "compression.codec=int8"]


def run_scaling(
    counts: list[int], *, root: Path, rate: str, window_s: float, say: Callable[[str], None]
) -> dict[str, Any]:
    """Swarm throughput (samples/s) of gossip int8 with equal peers, growing in one lab.

    Trainers are added in stages (``counts``, e.g. 2, 4, 6); once every trainer of a stage has
    printed a sync line, the swarm's rate is measured over ``window_s``: per trainer, steps between
    its latest sync lines at the window's start and end, times the batch size, over the time between
    them; summed. One lab saves the start-up of separate runs, which dominates on 2 cores.
    """
    run = Run(root / "scaling")
    run.log_dir.mkdir(parents=True, exist_ok=True)
    watcher = StepWatcher(run.log_dir, max(counts))
    points: list[dict[str, Any]] = []
    result: dict[str, Any] = {"sets": SCALING_SETS, "window_s": window_s, "rate": rate, "points": points}
    with netlab.NetLab(hosts=max(counts) + 1, rate=rate) as lab:
        try:
            common = _common_args(SCALING_SETS)
            maddr = _start_bootstrap(lab, run, common)
            running = 0
            for count in sorted(counts):
                for index in range(running + 1, count + 1):
                    _start_trainer(lab, run, index, maddr, common)
                running = count
                samples_per_s = _measure_window(run, watcher, count, window_s)
                say(f"scaling: {count} peers, {samples_per_s:.0f} samples/s over {window_s:.0f} s")
                points.append({"peers": count, "samples_per_second": samples_per_s})
        except RuntimeError as exc:
            result["error"] = str(exc)
        finally:
            _stop(run)
    result["logs"] = str(run.log_dir)
    return result


def _measure_window(run: Run, watcher: StepWatcher, peers: int, window_s: float) -> float:
    deadline = time.monotonic() + START_TIMEOUT_S
    while any(step is None for step in watcher.steps[:peers]):
        _check(run, deadline, f"not all {peers} trainers synced")
        watcher.poll(time.monotonic(), 0.0)
        time.sleep(0.5)  # polling log files that other processes append to
    begin = list(watcher.steps[:peers])
    end_at = time.monotonic() + window_s
    while time.monotonic() < end_at:
        _check(run, end_at + 1.0, "")
        watcher.poll(time.monotonic(), 0.0)
        time.sleep(0.5)
    batch = _batch_size()
    total = 0.0
    for (t0, s0), (t1, s1) in zip(begin, watcher.steps[:peers], strict=True):
        if t1 > t0:
            total += (s1 - s0) * batch / (t1 - t0)
    return total


def _batch_size() -> int:
    from swarm.config import load_config

    return load_config(bench_training.REPO / bench_training.CONFIG, overrides=[], env={}).train.batch_size


def _numbers(run: Run, plan: Plan, watcher, seconds: float, slowdown: float) -> dict[str, Any]:
    from peers._local_summary import collect, swarm_summary

    paths = [run.log_dir / f"peer-{i}.summary.json" for i in range(1, plan.peers + 1)]
    per_peer = collect(paths)
    if len(per_peer) < plan.peers:
        return {"error": f"{plan.peers - len(per_peer)} trainer(s) wrote no summary; see {run.log_dir}"}
    for peer in per_peer:
        # the slowdown sleep stands for a slower device's compute: count it as compute
        factor = slowdown if peer["name"] == f"peer-{plan.slow_peer}" else 1.0
        peer["utilization_measured"] = peer["utilization"]
        peer["utilization"] = min(1.0, peer["utilization"] * factor)
    summary = swarm_summary(per_peer, baseline_unigram_loss())
    return {
        "seconds_to_target": watcher.reached,
        **bench_training.summary_numbers(summary),
        "samples_per_second": sum(p.get("samples", 0) for p in per_peer) / seconds,
        "seconds": seconds,
        "curve": [[round(t, 2), round(loss, 4)] for t, loss in watcher.curve if t <= seconds],
        "per_peer": [{k: p.get(k) for k in _PER_PEER_KEYS} for p in per_peer],
        "logs": str(run.log_dir),
    }


_PER_PEER_KEYS = ("name", "steps", "rounds", "samples", "eval_loss", "utilization", "utilization_measured")


def baseline_unigram_loss() -> float | None:
    """The unigram model's held-out bits/byte on the benchmark's data (what `swarm local` prints)."""
    global _BASELINE
    if _BASELINE is None:
        from swarm.config import load_config
        from swarm.training import open_source, unigram_bits

        config = load_config(bench_training.REPO / bench_training.CONFIG, overrides=[], env={})
        source = open_source(config.data)
        _BASELINE = unigram_bits(source.train, source.eval) if hasattr(source, "train") else None
    return _BASELINE


_BASELINE: float | None = None
