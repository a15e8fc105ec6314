"""A chaos driver for tests: a local swarm of trainers, one of which is killed and restarted at a time.

The swarm is a bootstrap and N ``swarm join`` trainers, each started through the tests' ``spawn``
fixture (its own session, stopped gracefully and leak-checked at the end). Every trainer checkpoints
into its own directory and always starts with ``--resume``, so a restarted one continues from its
newest checkpoint. The trainers have no step limit of their own: :meth:`ChaosSwarm.run` kills a
random trainer every ``period_s`` (or at given steps) until ``max_kills``, alternating how: the whole
session (trainer, DHT worker and ``p2pd`` at once) or the trainer's main process alone (its DHT
worker must notice and take ``p2pd`` down itself). It keeps every trainer running until each has
passed ``target_steps`` *and* every restarted trainer has completed an exchange since its restart
(so a fast machine cannot finish the others before a restarted one is back up); then
:meth:`ChaosSwarm.stop` ends them all with SIGTERM.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from peers.bootstrap import JOIN_LINE_PREFIX
from swarm.state import list_checkpoints
from tests._processes import PeerProcess, session_processes, swarm_cli, wait_until
from tests.workers.tiny import ONE_THREAD, cli_sets


@dataclass(frozen=True)
class SyncLine:
    """One printed per-sync line: the step it was printed at, the outcome, the held-out loss."""

    step: int
    outcome: str
    eval_loss: float | None


@dataclass
class Incarnation:
    """One run of one trainer, from start to exit or kill."""

    process: PeerProcess
    started_at: float
    resumed_step: int | None = None  # the newest checkpoint's step when this incarnation started
    killed: str | None = None  # "session" or "lone" when the driver killed it

    def sync_lines(self) -> list[SyncLine]:
        """Each printed sync line, parsed."""
        found = []
        for line in self.process.output().splitlines():
            words = line.split()
            if len(words) > 16 and words[0] == "round" and words[2] == "step" and words[12] == "sync":
                evaluation = None if words[7] == "-" else float(words[7])
                found.append(SyncLine(int(words[3]), words[13], evaluation))
        return found

    def exchanged(self) -> bool:
        """Whether this incarnation completed an exchange with a partner."""
        return any(line.outcome == "ok" for line in self.sync_lines())


@dataclass
class Trainer:
    index: int
    checkpoints: Path
    summary: Path
    incarnations: list[Incarnation] = field(default_factory=list)

    @property
    def current(self) -> Incarnation:
        return self.incarnations[-1]


@dataclass
class ChaosSwarm:
    """A bootstrap and ``size`` trainers; see the module docstring."""

    spawn: Callable[..., PeerProcess]
    workdir: Path
    overrides: list[str]
    size: int = 5
    trainers: list[Trainer] = field(default_factory=list)
    kills: list[tuple[float, int, str]] = field(default_factory=list)
    maddr: str = ""
    boot: PeerProcess | None = None

    def start(self, timeout: float = 120.0) -> ChaosSwarm:
        self.boot = boot = self.spawn(swarm_cli("bootstrap", *cli_sets(self.overrides)), env=ONE_THREAD)
        line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=timeout)
        self.maddr = line[len(JOIN_LINE_PREFIX) :].strip()
        for index in range(self.size):
            directory = self.workdir / f"trainer-{index}"
            trainer = Trainer(index, directory / "checkpoints", directory / "summary.json")
            self.trainers.append(trainer)
            self._launch(trainer)
        return self

    def _launch(self, trainer: Trainer) -> None:
        args = ["join", "--initial-peers", self.maddr, "--public-name", f"chaos-{trainer.index}"]
        args += ["--summary", str(trainer.summary), "--resume"]
        args += cli_sets([*self.overrides, f"train.checkpoint_dir={trainer.checkpoints}"])
        found = list_checkpoints(trainer.checkpoints)
        resumed_step = found[0][0] if found else None
        process = self.spawn(swarm_cli(*args), env=ONE_THREAD)
        trainer.incarnations.append(Incarnation(process, time.monotonic(), resumed_step))

    def running(self, exchanged: bool = False) -> list[Trainer]:
        """Trainers whose current incarnation runs (and, with ``exchanged``, has completed an exchange)."""
        alive = [t for t in self.trainers if t.current.process.proc.poll() is None]
        return [t for t in alive if t.current.exchanged()] if exchanged else alive

    def kill(self, trainer: Trainer, how: str, timeout: float = 15.0) -> None:
        """SIGKILL the trainer (``session``: with its DHT worker and p2pd; ``lone``: its main process
        only) and wait until nothing of its session is left: a lone kill relies on the DHT worker's
        watchdog (swarm/network/_dht.py) to stop ``p2pd``."""
        incarnation = trainer.current
        if how == "session":
            incarnation.process.kill_session()
        else:
            incarnation.process.signal(signal.SIGKILL)
            incarnation.process.proc.wait(timeout=timeout)
        incarnation.killed = how
        sid = incarnation.process.sid
        wait_until(lambda: not session_processes({sid}), timeout, f"trainer {trainer.index}'s session to end")

    def run(
        self,
        *,
        target_steps: int,
        max_kills: int,
        deadline_s: float,
        seed: int,
        period_s: float | None = None,
        at_steps: Sequence[int] = (),
    ) -> None:
        """Kill and restart random trainers until ``max_kills`` kills; return once every trainer has
        passed ``target_steps`` and every restarted one has exchanged since its restart.

        A kill is due every ``period_s`` seconds, or when the running trainers' mean step passes the
        next of ``at_steps`` (a schedule that scales with the machine's speed, for tests). Only a
        trainer that has completed an exchange since its (re)start is picked. Fails after
        ``deadline_s`` in all, or as soon as a trainer exits.
        """
        rng = random.Random(seed)
        started = last_kill = time.monotonic()
        while not (len(self.kills) >= max_kills and self._all_done(target_steps)):
            assert time.monotonic() - started < deadline_s, f"not done after {deadline_s}s: {self.progress()}"
            self._check_all_running()
            candidates = self.running(exchanged=True)
            if len(self.kills) < max_kills and candidates and self._kill_due(last_kill, period_s, at_steps):
                victim = rng.choice(candidates)
                how = "session" if len(self.kills) % 2 == 0 else "lone"
                self.kill(victim, how)
                self.kills.append((round(time.monotonic() - started, 1), victim.index, how))
                self._launch(victim)
                last_kill = time.monotonic()
            time.sleep(0.2)  # polling child processes; there is nothing to wait on

    def _all_done(self, target_steps: int) -> bool:
        for trainer in self.trainers:
            lines = trainer.current.sync_lines()
            if not lines or lines[-1].step < target_steps:
                return False
            if len(trainer.incarnations) > 1 and not trainer.current.exchanged():
                return False
        return True

    def progress(self) -> list[str]:
        """Per trainer: incarnations, last step printed, whether the current one exchanged."""
        described = []
        for t in self.trainers:
            lines = t.current.sync_lines()
            step = lines[-1].step if lines else None
            described.append(
                f"#{t.index}: {len(t.incarnations)} run(s), step {step}, ok {t.current.exchanged()}"
            )
        return described

    def _kill_due(self, last_kill: float, period_s: float | None, at_steps: Sequence[int]) -> bool:
        if period_s is not None and time.monotonic() - last_kill >= period_s:
            return True
        if len(self.kills) >= len(at_steps):
            return False
        steps = [t.current.sync_lines()[-1].step for t in self.running(exchanged=True)]
        return bool(steps) and sum(steps) / len(steps) >= at_steps[len(self.kills)]

    def _check_all_running(self) -> None:
        exited = [t for t in self.trainers if t.current.process.proc.poll() is not None]
        if exited:
            code, output = exited[0].current.process.proc.returncode, exited[0].current.process.output()
            raise AssertionError(
                f"trainer {exited[0].index} exited ({code}) before it was stopped:\n{output}"
            )

    def stop(self, timeout: float = 60.0) -> list[int]:
        """SIGTERM every trainer (each saves a checkpoint and writes its summary), then the bootstrap;
        the exit codes of the trainers, then the bootstrap's."""
        for trainer in self.trainers:
            trainer.current.process.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        codes = [t.current.process.wait(timeout=max(1.0, deadline - time.monotonic())) for t in self.trainers]
        assert self.boot is not None
        self.boot.signal(signal.SIGTERM)
        return [*codes, self.boot.wait(timeout=max(1.0, deadline - time.monotonic()))]

    def eval_at(self, trainer: Trainer, steps: int) -> float:
        """The held-out loss the trainer printed at its first sync line at or after ``steps``."""
        for line in trainer.current.sync_lines():
            if line.step >= steps and line.eval_loss is not None:
                return line.eval_loss
        raise AssertionError(f"trainer {trainer.index} printed no evaluation at step {steps} or later")

    def summaries(self) -> list[dict]:
        return [json.loads(t.summary.read_text()) for t in self.trainers]
