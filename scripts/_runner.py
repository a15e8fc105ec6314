"""The shared runner of the training benchmarks: the bench regime, the trainers' histories, and runs
over the emulated internet (testbed/).

One run = one lab: a bootstrap in host 0 and one trainer per further host, each started with
``swarm bootstrap`` / ``swarm join`` inside its namespace and listening on the host's 10.77.0.x address,
every link shaped to the same rate. Time starts when the first trainer joins (its history's first
line); a run ends after its budget, or as soon as the mean held-out loss reaches the target when the
plan says so, with SIGTERM to every trainer, which then writes its summary. Several runs may go at
once (:func:`run_plans`), each in its own lab: the trainers' devices are emulated
(``emulation.step_time_s``), so they mostly sleep, and each row says how much real compute a step
took and how loaded the machine was. The labs tear themselves down even on Ctrl+C. A row's numbers
come from the trainers' own files (scripts/_rows.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts import _rows
from testbed import netlab

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


@functools.cache
def n_params() -> int:
    from swarm.config import load_config
    from swarm.learning import build_model, count_parameters

    config = load_config(REPO / CONFIG, overrides=[], env={})
    return count_parameters(build_model(config.model, config.run.seed))


START_TIMEOUT_S = 240.0  # on a busy 2-core machine eight trainers importing torch take a while
STOP_GRACE_S = 30.0
POLL_S = 0.25

Say = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """One training run: what it is called, how many trainers, their ``--set`` overrides, when it ends."""

    name: str  # unique within a report (the log folder)
    backend: str  # what the report calls it: gossip-int8, dataparallel, ...
    peers: int  # trainer processes
    sets: list[str]
    label: str = ""
    slow_peer: int | None = None  # 1-based trainer index that also gets emulation.slowdown
    slowdown: float = 3.0
    budget_s: float = 60.0
    until_target: bool = False  # stop as soon as the target is reached
    batch: int = 1  # samples per inner step of one trainer, for the swarm's sample count
    devices: int = 0  # emulated devices it stands for (0: one per trainer)
    rate: str | None = ""  # its links: "" the report's rate, None unshaped


def logs_root(program: str) -> Path:
    """A fresh folder under runs/ for the logs of ``program``'s runs. Where the testbed is unavailable
    (not root, no iproute2), say why and exit with status 2."""
    reason = netlab.unavailable_reason()
    if reason is not None:
        print(f"{program}: the testbed is unavailable: {reason}", file=sys.stderr)
        raise SystemExit(2)
    runs = REPO / "runs"
    runs.mkdir(exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{program}-", dir=runs))


def interrupt_on_sigterm() -> None:
    """Make SIGTERM raise KeyboardInterrupt in the main thread, so that a benchmark killed with it tears
    its labs down the way Ctrl+C does (netlab's atexit), instead of leaving netns and p2pd behind."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


@dataclass
class Run:
    """The processes and logs of one run."""

    log_dir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    loads: list[float] = field(default_factory=list)


def run_plans(plans: list[Plan], *, root: Path, rate: str, target: float, say: Say) -> list[dict[str, Any]]:
    """Run ``plans`` at the same time, each in its own lab; their rows in the same order."""
    rows: list[dict[str, Any]] = [{} for _ in plans]

    def one(index: int) -> None:
        rows[index] = run_plan(plans[index], root=root, rate=rate, target=target, say=say)

    threads = [threading.Thread(target=one, args=(i,), name=p.name, daemon=True) for i, p in enumerate(plans)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return rows


def run_plan(plan: Plan, *, root: Path, rate: str, target: float, say: Say) -> dict[str, Any]:
    """Run ``plan`` in a fresh lab; return its row (with ``curve``), or a row with ``error``."""
    run = Run(root / plan.name)
    run.log_dir.mkdir(parents=True, exist_ok=True)
    row: dict[str, Any] = {"name": plan.name, "backend": plan.backend, "label": plan.label or plan.backend}
    row |= {"peers": plan.peers, "devices": plan.devices or plan.peers, "slow_peer": plan.slow_peer}
    row |= {
        "slowdown": plan.slowdown if plan.slow_peer else 1.0,
        "sets": plan.sets,
        "budget_s": plan.budget_s,
    }
    row["rate"] = rate = rate if plan.rate == "" else plan.rate
    with netlab.NetLab(hosts=plan.peers + 1, rate=rate) as lab:
        try:
            watcher, seconds = _train(lab, run, plan, target, say)
        except RuntimeError as exc:
            _stop(run)
            return {**row, "error": str(exc)}
    numbers = measured_numbers(run, plan, watcher, seconds, target)
    say(f"{plan.name}: {_rows.brief(numbers)}")
    return {**row, **numbers}


def _train(lab, run: Run, plan: Plan, target: float, say: Say) -> tuple:
    common = config_args(plan.sets)
    maddr = _start_bootstrap(lab, run, common)
    for index in range(1, plan.peers + 1):
        extra = ["--set", f"emulation.slowdown={plan.slowdown}"] if index == plan.slow_peer else []
        _start_trainer(lab, run, index, maddr, [*common, *extra])
    watcher = HistoryWatcher(run.log_dir, plan.peers, plan.batch)
    deadline = time.monotonic() + START_TIMEOUT_S
    while watcher.started is None:
        _check(run, deadline, "no trainer joined")
        watcher.poll(time.monotonic(), target)
        time.sleep(POLL_S)  # polling log files that other processes append to
    say(f"{plan.name}: first trainer joined; up to {plan.budget_s:.0f} s over {lab.rate or 'unshaped'} links")
    end = watcher.started + plan.budget_s
    while time.monotonic() < end and not (plan.until_target and watcher.reached is not None):
        _check(run, end + START_TIMEOUT_S, "")
        watcher.poll(time.monotonic(), target)
        run.loads.append(os.getloadavg()[0])
        time.sleep(POLL_S)
    seconds = time.monotonic() - watcher.started
    _stop(run)
    watcher.poll(time.monotonic(), target)
    return watcher, seconds


def config_args(sets: list[str]) -> list[str]:
    """The benchmarks' config file, then ``sets`` as ``--set`` overrides (later ones win)."""
    return ["--config", CONFIG, *[a for s in sets for a in ("--set", s)]]


def _start_bootstrap(lab, run: Run, common: list[str]) -> str:
    """Start the bootstrap in host 0; return the multiaddr joiners dial."""
    from peers.local import wait_for_join_line

    host = lab.hosts[0]
    boot = _start(run, host, "bootstrap", ["bootstrap", *common, "--host-maddrs", host.maddr()])
    return wait_for_join_line(run.log_dir / "bootstrap.log", boot, timeout_s=START_TIMEOUT_S)


def _start_trainer(lab, run: Run, index: int, maddr: str, common: list[str]) -> None:
    host = lab.hosts[index]
    args = ["join", *common, "--initial-peers", maddr, "--host-maddrs", host.maddr()]
    _start(run, host, f"peer-{index}", [*args, *_peer_files(run, index)])


def _peer_files(run: Run, index: int) -> list[str]:
    summary = run.log_dir / f"peer-{index}.summary.json"
    checkpoints = run.log_dir / f"peer-{index}" / "checkpoints"
    history = run.log_dir / f"peer-{index}.history.jsonl"
    names = ["--public-name", f"bench-{index}", "--summary", str(summary), "--history", str(history)]
    return [*names, "--set", f"train.checkpoint_dir={checkpoints}"]


def start_swarm(
    host: netlab.Host, args: list[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``swarm ARGS`` in ``host`` (in its own session, killed with this process), its output in ``log``;
    ``env``: its environment, :func:`child_env` by default."""
    from peers.local import die_with_parent

    with log.open("wb") as out:
        return host.popen(
            [sys.executable, "-m", "peers.cli", *args],
            cwd=REPO,
            env=child_env() if env is None else env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )


def _start(run: Run, host, name: str, args: list[str]) -> subprocess.Popen:
    """``swarm ARGS`` in ``host``."""
    proc = start_swarm(host, args, run.log_dir / f"{name}.log")
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


def measured_numbers(
    run: Run, plan: Plan, watcher: HistoryWatcher, seconds: float, target: float
) -> dict[str, Any]:
    """A run's row from the trainers' summaries (their phase split included), the watcher's
    timestamps, the load samples."""
    from peers.local_summary import collect

    paths = [run.log_dir / f"peer-{i}.summary.json" for i in range(1, plan.peers + 1)]
    per_peer = collect(paths)
    if len(per_peer) < plan.peers:
        return {"error": f"{plan.peers - len(per_peer)} trainer(s) wrote no summary; see {run.log_dir}"}
    for peer in per_peer:
        peer["time_split"] = peer.get("phase_seconds")
    step_time = _rows.set_value(plan.sets, "emulation.step_time_s", 0.0)
    joins = [t for t in watcher.joined if t is not None]
    curve = _curve(watcher, seconds)
    return {
        "seconds_to_target": _rows.crossing(curve, target, 0),
        "samples_to_target": _rows.crossing(curve, target, 1),
        **_rows.summary_numbers(per_peer),
        **_rows.training_thread(per_peer),
        "step_time_s": step_time,
        "emulation_overrun": _rows.emulation_overrun(per_peer, step_time, plan.slow_peer, plan.slowdown),
        "load_average": {"mean": _rows.mean(run.loads), "max": max(run.loads, default=None)},
        "join_spread_s": max(joins) - min(joins) if joins else None,
        "samples_per_second": sum(p.get("samples", 0) for p in per_peer) / seconds,
        "seconds": seconds,
        "curve": curve,
        "per_peer": [{k: p.get(k) for k in PER_PEER_KEYS} for p in per_peer],
        "logs": str(run.log_dir),
    }


def _curve(watcher: HistoryWatcher, seconds: float) -> list[list[float]]:
    """The watcher's curve, ending with the swarm's samples at the stop (its eval then is the latest)."""
    points = [[round(t, 2), n, round(loss, 4)] for t, n, loss in watcher.curve if t <= seconds]
    if points and watcher.samples() > points[-1][1]:
        points.append([round(seconds, 2), watcher.samples(), points[-1][2]])
    return points


PER_PEER_KEYS = (
    "name",
    "steps",
    "rounds",
    "samples",
    "eval_loss",
    "utilization",
    "compute_seconds",
    "device_seconds",
    "rounds_by_role",
    "time_split",
)
