"""A chaos driver for tests: a local swarm of trainers, one of which is killed and restarted at a time.

The swarm is a bootstrap and N ``swarm join`` trainers, each started through the tests' ``spawn``
fixture (its own session, cleaned up and leak-checked at the end). Every trainer checkpoints into its
own directory and always starts with ``--resume``, so a restarted one continues from its newest
checkpoint. :meth:`ChaosSwarm.run` kills a random live trainer every ``period_s`` (or at given
steps) until ``max_kills`` or the trainers finish, alternating how: the whole session (trainer,
DHT worker and ``p2pd`` at once) or the trainer's main process alone (its DHT worker must notice
and take ``p2pd`` down itself).
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

# Six processes on two cores: torch's default of one thread per core makes every step several times
# slower through oversubscription.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@dataclass
class Incarnation:
    """One run of one trainer, from start to exit or kill."""

    process: PeerProcess
    started_at: float
    resumed_step: int | None = None  # the newest checkpoint's step when this incarnation started
    killed: str | None = None  # "session" or "lone" when the driver killed it

    def sync_lines(self) -> list[tuple[int, str]]:
        """``(step, outcome)`` of each printed sync line."""
        found = []
        for line in self.process.output().splitlines():
            words = line.split()
            if len(words) > 16 and words[0] == "round" and words[2] == "step" and words[12] == "sync":
                found.append((int(words[3]), words[13]))
        return found


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

    def start(self, timeout: float = 120.0) -> ChaosSwarm:
        boot = self.spawn(swarm_cli("bootstrap", *self._sets()), env=ONE_THREAD)
        line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=timeout)
        self.maddr = line[len(JOIN_LINE_PREFIX) :].strip()
        for index in range(self.size):
            directory = self.workdir / f"trainer-{index}"
            trainer = Trainer(index, directory / "checkpoints", directory / "summary.json")
            self.trainers.append(trainer)
            self._launch(trainer)
        return self

    def _sets(self, *extra: str) -> list[str]:
        return [item for override in (*self.overrides, *extra) for item in ("--set", override)]

    def _launch(self, trainer: Trainer) -> None:
        args = ["join", "--initial-peers", self.maddr, "--public-name", f"chaos-{trainer.index}"]
        args += ["--summary", str(trainer.summary), "--resume"]
        args += self._sets(f"train.checkpoint_dir={trainer.checkpoints}")
        found = list_checkpoints(trainer.checkpoints)
        resumed_step = found[0][0] if found else None
        process = self.spawn(swarm_cli(*args), env=ONE_THREAD)
        trainer.incarnations.append(Incarnation(process, time.monotonic(), resumed_step))

    def running(self, synced: bool = False) -> list[Trainer]:
        """Trainers whose current incarnation runs (and, with ``synced``, has finished a sync)."""
        alive = [t for t in self.trainers if t.current.process.proc.poll() is None]
        return [t for t in alive if t.current.sync_lines()] if synced else alive

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
        max_kills: int,
        deadline_s: float,
        seed: int,
        period_s: float | None = None,
        at_steps: Sequence[int] = (),
    ) -> None:
        """Kill and restart random trainers until ``max_kills`` kills, then wait for all to finish.

        A kill is due every ``period_s`` seconds, or when the running trainers' mean step passes the
        next of ``at_steps`` (a schedule that scales with the machine's speed, for tests). Only a
        trainer that has synced since its (re)start is picked. Fails after ``deadline_s`` in all, or
        as soon as a trainer exits with an error.
        """
        rng = random.Random(seed)
        started = last_kill = time.monotonic()
        while self.running():
            assert time.monotonic() - started < deadline_s, f"trainers still running after {deadline_s}s"
            self._check_no_failure()
            candidates = self.running(synced=True)
            if len(self.kills) < max_kills and candidates and self._kill_due(last_kill, period_s, at_steps):
                victim = rng.choice(candidates)
                how = "session" if len(self.kills) % 2 == 0 else "lone"
                self.kill(victim, how)
                self.kills.append((round(time.monotonic() - started, 1), victim.index, how))
                self._launch(victim)
                last_kill = time.monotonic()
            time.sleep(0.2)  # polling child processes; there is nothing to wait on

    def _kill_due(self, last_kill: float, period_s: float | None, at_steps: Sequence[int]) -> bool:
        if period_s is not None and time.monotonic() - last_kill >= period_s:
            return True
        if len(self.kills) >= len(at_steps):
            return False
        steps = [t.current.sync_lines()[-1][0] for t in self.running(synced=True)]
        return bool(steps) and sum(steps) / len(steps) >= at_steps[len(self.kills)]

    def _check_no_failure(self) -> None:
        failed = [t for t in self.trainers if t.current.process.proc.poll() not in (None, 0)]
        if failed:
            output = failed[0].current.process.output()
            raise AssertionError(f"trainer {failed[0].index} failed:\n{output}")

    def summaries(self) -> list[dict]:
        return [json.loads(t.summary.read_text()) for t in self.trainers]
