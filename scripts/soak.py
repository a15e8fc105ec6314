"""Chaos soak: 8 trainers on the emulated internet, a random one SIGKILLed every ~15 s and restarted.

Two runs of the same length, each in its own lab (testbed/netlab.py, needs root): a bootstrap in host
0 and one ``swarm join --resume`` trainer per further host, with the tiny model of the churn test and
an emulated device (``emulation.step_time_s``), so that eight trainers fit on two cores. The clock starts
once every trainer has completed an exchange; then

* the **churn run** kills a random trainer every ``--period`` seconds (only one that has exchanged
  since its own start), alternately its whole session (trainer, DHT worker and ``p2pd`` at once) and
  its main process alone (its DHT worker must take ``p2pd`` down itself), and restarts it at once
  with ``--resume`` (the same checkpoint folder and peer identity);
* the **baseline** runs as long without kills.

Both end with SIGTERM to every trainer, then the bootstrap; whatever still runs in their sessions or
the lab's namespaces is reported as left over, then killed. The report (scripts/soak_report.py, from
what the trainers write: each life's ``--history`` and ``--summary``, the final checkpoints): samples
trained against samples in the final checkpoints and the ledger's view, the final held-out loss
against the baseline's, the exchanges that failed by cause, leftover processes. It exits 1 when a
check fails. docs/security.md has a measured report and how to read it.

    sudo .venv/bin/python -m scripts.soak --quick   # 2 minutes per run (about 7 minutes in all)
    sudo .venv/bin/python -m scripts.soak           # 10 minutes per run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from scripts import _runner, soak_report
from testbed import netlab

TRAINERS = 8
FULL_S, QUICK_S = 600.0, 120.0
PERIOD_S = 15.0
READY_TIMEOUT_S = 300.0  # eight trainers importing torch on two busy cores
KILL_WAIT_S = 15.0  # a lone kill: the DHT worker polls its parent every second, then stops p2pd
STOP_GRACE_S = 60.0
SETTLE_S = 10.0  # after the graceful stop, how long the sessions may take to empty before it is a leak
POLL_S = 0.5
BATCH = 8
SETS = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    f"train.batch_size={BATCH}",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.eval_batches=8",
    "train.max_steps=1000000",
    "emulation.step_time_s=0.1",
    "train.checkpoint_every_s=2",
    "averaging.sync_every_steps=10",
    "network.record_interval_s=1",
    "network.record_ttl_s=4",
    "network.startup_timeout_s=120",
]
"""The churn test's tiny trainer (tests/workers/tiny.py) on configs/local-tiny.yaml, with an emulated
device of 0.1 s per step, a checkpoint every 2 s and a held-out loss over 8 batches."""


def log(message: str) -> None:
    print(f"[soak] {message}", file=sys.stderr, flush=True)


@dataclass
class Life:
    """One incarnation of a trainer: its process (the leader of its own session) and its files:
    ``life-N.log`` (its output), its ``--history`` and its ``--summary`` beside it."""

    proc: subprocess.Popen
    log: Path
    history: Path
    summary: Path
    resumed_step: int
    killed: str | None = None

    def exchanged(self) -> bool:
        """Whether its history's last line counts a committed exchange (either role)."""
        record = soak_report.last_record(self.history)
        return record is not None and int(record["exchanges_ok"]) > 0


@dataclass
class Trainer:
    index: int
    host: netlab.Host
    directory: Path
    lives: list[Life] = field(default_factory=list)

    @property
    def current(self) -> Life:
        return self.lives[-1]

    @property
    def checkpoints(self) -> Path:
        return self.directory / "checkpoints"


def newest_checkpoint(directory: Path) -> dict | None:
    """The progress of the newest checkpoint that loads (what ``--resume`` resumes from), or None."""
    from swarm.state import CheckpointError, list_checkpoints, read_checkpoint

    for _, path in list_checkpoints(directory):
        with contextlib.suppress(CheckpointError, OSError):
            return read_checkpoint(path)["progress"]
    return None


class Swarm:
    """A bootstrap and ``size`` trainers in ``lab``; every process is one of ``lab``'s, in its own session."""

    def __init__(self, lab: netlab.NetLab, root: Path, size: int) -> None:
        self.lab, self.root, self.size = lab, root, size
        self.trainers: list[Trainer] = []
        self.boot: subprocess.Popen | None = None
        self.maddr = ""
        self.kill_leftovers: list[str] = []

    def start(self) -> None:
        from peers.local import wait_for_join_line

        host = self.lab.hosts[0]
        boot_log = self.root / "bootstrap.log"
        self.boot = self._spawn(host, boot_log, ["bootstrap", "--host-maddrs", host.maddr()])
        self.maddr = wait_for_join_line(boot_log, self.boot, timeout_s=READY_TIMEOUT_S)
        for index in range(1, self.size + 1):
            trainer = Trainer(index, self.lab.hosts[index], self.root / f"trainer-{index}")
            self.trainers.append(trainer)
            self.launch(trainer)

    def launch(self, trainer: Trainer) -> None:
        """Start (or restart) ``trainer`` with ``--resume`` from its own checkpoints and identity."""
        progress = newest_checkpoint(trainer.checkpoints)
        args = ["join", "--initial-peers", self.maddr, "--host-maddrs", trainer.host.maddr(), "--resume"]
        log_path = trainer.directory / f"life-{len(trainer.lives)}.log"
        history, summary = log_path.with_suffix(".history.jsonl"), log_path.with_suffix(".summary.json")
        files = ["--summary", str(summary), "--history", str(history)]
        args += ["--public-name", f"soak-{trainer.index}", *files]
        args += ["--set", f"train.checkpoint_dir={trainer.checkpoints}"]
        args += ["--set", f"network.identity_path={trainer.directory / 'identity.key'}"]
        proc = self._spawn(trainer.host, log_path, args)
        trainer.lives.append(Life(proc, log_path, history, summary, int(progress["step"]) if progress else 0))

    def _spawn(self, host: netlab.Host, log_path: Path, args: list[str]) -> subprocess.Popen:
        command, *rest = args
        log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**_runner.child_env(), "SWARM_LOG_LEVEL": "INFO"}
        return _runner.start_swarm(host, [command, *_runner.config_args(SETS), *rest], log_path, env)

    def check_running(self) -> None:
        exited = [t for t in self.trainers if t.current.proc.poll() is not None]
        if self.boot is not None and self.boot.poll() is not None:
            raise RuntimeError(f"the bootstrap exited ({self.boot.returncode}); see {self.root}")
        if exited:
            t = exited[0]
            raise RuntimeError(f"trainer {t.index} exited ({t.current.proc.returncode}); see {t.current.log}")

    def wait_ready(self) -> None:
        """Until every trainer's current incarnation has completed an exchange."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not all(t.current.exchanged() for t in self.trainers):
            self.check_running()
            if time.monotonic() > deadline:
                waiting = [t.index for t in self.trainers if not t.current.exchanged()]
                raise RuntimeError(f"trainers {waiting} completed no exchange in {READY_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)  # polling log files other processes append to

    def kill(self, trainer: Trainer, how: str) -> None:
        """SIGKILL the session (``session``) or the main process alone (``lone``); wait until nothing
        of the session runs, else note and kill what is left."""
        from peers.local import session_processes

        life = trainer.current
        if how == "session":
            with contextlib.suppress(ProcessLookupError):
                os.killpg(life.proc.pid, signal.SIGKILL)
        else:
            life.proc.send_signal(signal.SIGKILL)
        life.proc.wait(timeout=KILL_WAIT_S)
        life.killed = how
        deadline = time.monotonic() + KILL_WAIT_S
        while (left := session_processes({life.proc.pid})) and time.monotonic() < deadline:
            time.sleep(0.2)  # the DHT worker's watchdog polls its parent; there is nothing to wait on
        for proc in left:
            self.kill_leftovers.append(f"trainer {trainer.index} ({how} kill): {describe(proc)}")
            with contextlib.suppress(Exception):
                proc.kill()

    def churn(
        self, seconds: float, period_s: float | None, rng: random.Random
    ) -> list[tuple[float, int, str]]:
        """Run ``seconds``; with ``period_s``, kill and restart a random exchanged trainer that often."""
        started = last = time.monotonic()
        kills: list[tuple[float, int, str]] = []
        while (now := time.monotonic()) - started < seconds:
            self.check_running()
            if period_s is not None and now - last >= period_s:
                candidates = [t for t in self.trainers if t.current.exchanged()]
                if candidates:
                    victim, how = rng.choice(candidates), ("session", "lone")[len(kills) % 2]
                    self.kill(victim, how)
                    kills.append((round(now - started, 1), victim.index, how))
                    log(f"{now - started:5.0f} s: killed trainer {victim.index} ({how}), restarting it")
                    self.launch(victim)
                    last = time.monotonic()
            time.sleep(POLL_S)  # polling child processes; there is nothing to wait on
        return kills

    def stop(self) -> dict[str, int | None]:
        """SIGTERM the trainers (they checkpoint and write their summaries), then the bootstrap."""
        codes: dict[str, int | None] = {}
        for trainer in self.trainers:
            trainer.current.proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        for trainer in self.trainers:
            codes[f"trainer-{trainer.index}"] = _wait(trainer.current.proc, deadline)
        if self.boot is not None:
            self.boot.terminate()
            codes["bootstrap"] = _wait(self.boot, time.monotonic() + STOP_GRACE_S)
        return codes

    def leftovers(self) -> list[str]:
        """Processes still alive in any session this swarm started, or anywhere in the lab's namespaces,
        once they had ``SETTLE_S`` to end after the graceful stop."""
        from peers.local import session_processes

        sessions = {life.proc.pid for t in self.trainers for life in t.lives}
        sessions |= {self.boot.pid} if self.boot is not None else set()
        deadline = time.monotonic() + SETTLE_S
        while True:
            found = {p.pid: describe(p) for p in session_processes(sessions)}
            for host in self.lab.hosts:
                for pid in netlab.sh(["ip", "netns", "pids", host.netns], check=False).split():
                    found.setdefault(int(pid), describe_pid(int(pid)))
            if not found or time.monotonic() > deadline:
                return sorted(found.values())
            time.sleep(0.5)  # exits take a moment after the parent's; bounded by SETTLE_S


def _wait(proc: subprocess.Popen, deadline: float) -> int | None:
    try:
        return proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def describe(proc) -> str:
    """``pid name cmdline...`` of a psutil process (or what is known of one that just ended)."""
    try:
        return f"{proc.pid} {proc.name()} {' '.join(proc.cmdline()[:4])}"
    except Exception:
        return f"{proc.pid} (gone)"


def describe_pid(pid: int) -> str:
    import psutil

    try:
        return describe(psutil.Process(pid))
    except psutil.Error:
        return f"{pid} (gone)"


def collect(swarm: Swarm, name: str, seconds: float) -> soak_report.RunResult:
    """The run's inputs for the report: every life's history and summary, the final checkpoints."""
    lives: list[soak_report.Life] = []
    finals: list[soak_report.FinalState] = []
    for trainer in swarm.trainers:
        lives += [
            soak_report.Life.read(trainer.index, life.resumed_step, life.killed, life.history, life.summary)
            for life in trainer.lives
        ]
        progress = newest_checkpoint(trainer.checkpoints)
        if progress is not None:
            finals.append(soak_report.FinalState.of(trainer.index, progress))
    return soak_report.RunResult(name, seconds, lives, finals)


def run_one(name: str, args: argparse.Namespace, root: Path, seconds: float, period_s: float | None) -> dict:
    """One run in a fresh lab; its summarized report (the lab is gone when this returns).

    After ``seconds`` the run waits until every trainer restarted last has exchanged (a trainer still
    starting would not stop gracefully), so a churn run lasts a little longer: its report's
    ``seconds`` is the length the baseline then runs.
    """
    root.mkdir(parents=True)
    with netlab.NetLab(hosts=args.trainers + 1, rate=args.rate) as lab:
        swarm = Swarm(lab, root, args.trainers)
        log(f"{name}: lab {lab.prefix}, {args.trainers} trainers over {args.rate or 'unshaped'} links")
        swarm.start()
        swarm.wait_ready()
        log(f"{name}: every trainer has exchanged; {seconds:.0f} s from now")
        started = time.monotonic()
        kills = swarm.churn(seconds, period_s, random.Random(args.seed))
        swarm.wait_ready()
        seconds = time.monotonic() - started
        log(f"{name}: stopping after {seconds:.0f} s, {len(kills)} kills")
        codes = swarm.stop()
        leftovers = swarm.leftovers()
        result = collect(swarm, name, seconds)
    result.exit_codes, result.leftovers, result.kill_leftovers = codes, leftovers, swarm.kill_leftovers
    result.namespaces_left = netlab.list_labs(f"{lab.prefix}-")
    summary = soak_report.summarize(result, BATCH, args.trainers)
    summary["kill_schedule"] = kills
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_S:.0f} s per run instead of {FULL_S:.0f}"
    )
    parser.add_argument("--duration", type=float, help="seconds per run (overrides --quick)")
    parser.add_argument("--period", type=float, default=PERIOD_S, help="seconds between kills")
    parser.add_argument("--trainers", type=int, default=TRAINERS)
    parser.add_argument("--rate", default="50mbit", help="every host's link, each way (tc units)")
    parser.add_argument("--seed", type=int, default=None, help="the victims' random order (default: random)")
    parser.add_argument("--no-baseline", action="store_true", help="only the churn run")
    parser.add_argument("--out", type=Path, help="an empty or new folder for logs, checkpoints, report.json")
    args = parser.parse_args(argv)
    args.duration = args.duration if args.duration is not None else (QUICK_S if args.quick else FULL_S)
    if args.duration <= 0 or args.period <= 0:
        parser.error(f"--duration and --period must be positive, got {args.duration} and {args.period}")
    if not 2 <= args.trainers <= 63:
        parser.error(f"--trainers must be 2..63 (one host each, beside the bootstrap's), got {args.trainers}")
    if args.rate:
        try:
            netlab.parse_rate(args.rate)
        except ValueError as exc:
            parser.error(f"--rate: {exc}")
    if args.out is not None and args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        parser.error(f"--out {args.out}: not an empty folder (trainers would resume its checkpoints)")
    args.seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if reason := netlab.unavailable_reason():
        log(reason)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="swarm-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    log(f"logs and report in {out}; seed {args.seed}")
    baseline = None
    try:
        churn = run_one("churn", args, out / "churn", args.duration, args.period)
        if not args.no_baseline:
            baseline = run_one("baseline", args, out / "baseline", churn["seconds"], None)
    except KeyboardInterrupt:
        left = netlab.list_labs(f"{netlab.PREFIX}{os.getpid()}-")
        log(f"interrupted; labs torn down (namespaces left: {left or 'none'})")
        return 130
    except RuntimeError as exc:
        log(f"failed: {exc}")
        return 1
    runs = [churn, *([baseline] if baseline else [])]
    report = {"command": sys.argv, "duration_s": args.duration, "period_s": args.period, "seed": args.seed}
    report |= {"trainers": args.trainers, "rate": args.rate, "sets": SETS, "runs": runs}
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(soak_report.render(churn, baseline))
    return soak_report.exit_code(runs)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # tear the labs down as on Ctrl+C
    sys.exit(main())
