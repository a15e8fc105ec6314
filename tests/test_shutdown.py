"""Shutdown under fire: SIGTERM/SIGKILL during checkpoint writes and during a gossip exchange.

Checkpoints: a worker writes ~8 MB checkpoints in a loop (tests/workers/checkpoint_writer.py) and is
killed at random moments, many times, with SIGKILL, SIGTERM (finish the save, exit 0) or two SIGTERMs
(interrupt at once, possibly mid-write). After every kill each file ``list_checkpoints`` returns must
load and hold exactly what was saved under its step, the newest must be at least the last save that
returned, and the next writer must remove the temporary file a killed one left behind.

Exchange: a real trainer whose exchanges stall once it has sent one frame
(tests/workers/stall_join.py) is SIGTERMed while it waits inside one; see the test's docstring.

Work after a stop: a trainer stopped mid-step, at the end of a step that makes a round due, or during
a round's evaluation starts nothing after the stop (no round, evaluation or periodic checkpoint; the
step in progress is abandoned) and its one checkpoint of the way out resumes.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import swarm.trainer._checkpoints as checkpoints_module
from peers.bootstrap import JOIN_LINE_PREFIX
from swarm.config import load_config
from swarm.network import NetworkOptions
from swarm.state import list_checkpoints, read_checkpoint
from swarm.state.checkpoint import checkpoint_path
from swarm.trainer import TrainingPeer
from tests._processes import session_processes, swarm_cli, wait_until
from tests.workers.checkpoint_writer import CONTEXT, state_of, write_forever
from tests.workers.tiny import ONE_THREAD, UNLIMITED, cli_sets, tiny

KILLS = 24
HANG_S = 120.0
NUMEL = 2_000_000  # 8 MB of float32 per checkpoint: a write takes long enough to be hit mid-way


def _temporaries(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.endswith(".tmp")) if directory.is_dir() else []


def _pid_of(temporary: Path) -> int:
    return int(temporary.name.split(".")[-2])


def _assert_all_intact(directory: Path, last_saved: int) -> int:
    """Every listed checkpoint loads and equals what was saved; return the newest step."""
    found = list_checkpoints(directory)
    assert found, "no checkpoint left"
    for step, path in found:
        state = read_checkpoint(path)
        assert state["step"] == step, (path, state["step"])
        assert torch.equal(state["model"]["w"], state_of(step, NUMEL)["model"]["w"]), path
    newest = found[0][0]
    assert newest >= last_saved, f"the save of step {last_saved} returned, but the newest file is {newest}"
    return newest


def _kill(proc, how: str, rng: random.Random) -> str:
    """Kill the writer ``how``; return what happened: ``how``, or ``sigterm`` when the writer had already
    finished its save and exited after the first of two SIGTERMs (the second then finds no process)."""
    if how == "sigkill":
        os.kill(proc.pid, signal.SIGKILL)
    elif how == "sigterm":
        os.kill(proc.pid, signal.SIGTERM)
    else:  # a second SIGTERM interrupts the save in progress (KeyboardInterrupt)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(rng.uniform(0.0, 0.02))  # a random moment to strike again, not synchronisation
        try:
            os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:  # gone (and reaped by its forkserver): the first SIGTERM ended it
            return "sigterm"
    return how


def _write_and_kill(directory: Path, first_step: int, rng: random.Random) -> tuple[str, int, int, bool]:
    """Start a writer at ``first_step``, kill it at a random moment after its first save.

    Returns how it was killed, its exit code, the last step whose save returned, and whether it left
    a temporary file (the kill landed mid-write).
    """
    # No lock: a writer SIGKILLed while holding a Value's lock would leave it held, and the next read
    # here would hang. One aligned 8-byte store needs none.
    saved, started = CONTEXT.Value("q", -1, lock=False), CONTEXT.Event()
    proc = CONTEXT.Process(target=write_forever, args=(str(directory), first_step, NUMEL, saved, started))
    proc.start()
    try:
        assert started.wait(30), "writer did not start"
        wait_until(lambda: saved.value >= first_step, timeout=30, what="the writer's first save")
        stale = [t for t in _temporaries(directory) if _pid_of(t) != proc.pid]
        assert not stale, f"the next save did not clean up after a killed writer: {stale}"
        time.sleep(rng.uniform(0.0, 0.3))  # a random moment to strike, not synchronisation
        how = _kill(proc, rng.choice(["sigkill", "sigterm", "sigterm-twice"]), rng)
        proc.join(HANG_S)  # a deadline for a hang: the save in progress finishes, then the loop ends
        assert proc.exitcode is not None, f"writer still running {HANG_S}s after {how}"
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join(10)
    if how == "sigterm":
        assert proc.exitcode == 0, f"a single SIGTERM must end the writer cleanly, got {proc.exitcode}"
    leftover = [t for t in _temporaries(directory) if _pid_of(t) == proc.pid]
    assert not (leftover and how == "sigterm"), leftover
    return how, proc.exitcode, saved.value, bool(leftover)


def test_killed_checkpoint_writer_never_leaves_a_corrupt_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    seed = time.time_ns()
    rng = random.Random(seed)
    next_step, last_saved, mid_write, outcomes = 0, -1, 0, []
    for _ in range(KILLS):
        how, code, saved, interrupted = _write_and_kill(directory, next_step, rng)
        outcomes.append((how, code))
        mid_write += interrupted
        last_saved = max(last_saved, saved)
        next_step = _assert_all_intact(directory, last_saved) + 1
    print(f"seed {seed}: {KILLS} kills, {mid_write} landed mid-write, outcomes {outcomes}")
    assert checkpoint_path(directory, next_step - 1).is_file()


# The exchange can only end by the trainer's abort: its timeouts are far beyond any deadline here.
EXCHANGE_OVERRIDES = tiny(
    UNLIMITED,
    "averaging.sync_every_steps=5",
    "averaging.exchange_timeout_s=3600",
    "averaging.chunk_timeout_s=3600",
)


@pytest.mark.multipeer
def test_sigterm_during_an_exchange_aborts_it_and_exits_cleanly(spawn, tmp_path: Path) -> None:
    """A trainer SIGTERMed while it waits inside an exchange it initiated (its partner is left with a
    half-received update) abandons the exchange instead of waiting it out (with hour-long exchange
    timeouts, only the abort can end it), exits 0 with a valid checkpoint, leaves no process behind,
    and the partner keeps training. (That neither side commits the aborted exchange is asserted on the
    averagers themselves in test_gossip_unit.py: the partner's log cannot tell it apart from an
    exchange it served a moment before the stall.)"""
    sets = cli_sets(EXCHANGE_OVERRIDES)
    boot = spawn(swarm_cli("bootstrap", *sets), env=ONE_THREAD)
    line = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=90)
    join = ["join", "--initial-peers", line[len(JOIN_LINE_PREFIX) :].strip(), *sets]
    partner = spawn(swarm_cli(*join), env=ONE_THREAD)
    partner_id = partner.wait_for_line(lambda text: "joined run" in text, timeout=90).split()[1]
    checkpoints = tmp_path / "ckpt"
    victim_args = [*join, "--set", f"train.checkpoint_dir={checkpoints}"]
    victim = spawn([sys.executable, "-m", "tests.workers.stall_join", *victim_args], env=ONE_THREAD)
    victim.wait_for_line(lambda text: "joined run" in text, timeout=90)
    victim.wait_for_line(lambda text: text == "STALLED", timeout=90)
    partner_mark = partner.mark()

    victim.signal(signal.SIGTERM)
    sent = time.monotonic()
    code = victim.wait(timeout=HANG_S)  # a deadline for a hang, far below the exchange's timeouts
    print(f"SIGTERM mid-exchange: exit {code} after {time.monotonic() - sent:.1f}s")
    assert code == 0, victim.output()
    stopped = re.search(r"join: shutting down: stopped at step (\d+)", victim.output())
    assert stopped, victim.output()
    wait_until(lambda: not session_processes({victim.sid}), 10, "the victim's DHT worker and p2pd to end")
    # one checkpoint, of the step it stopped at (no periodic one is due: checkpoint_every_s is 300)
    assert [step for step, _ in list_checkpoints(checkpoints)] == [int(stopped.group(1))]
    read_checkpoint(list_checkpoints(checkpoints)[0][1])

    def partner_synced_again() -> bool:
        lines = partner.output().splitlines()[partner_mark:]
        return sum(text.startswith("round") for text in lines) >= 2

    wait_until(partner_synced_again, timeout=60, what="the partner to keep training")
    assert partner.proc.poll() is None and partner_id


# A round every 3 steps, evaluated and checkpointed each time; steps of two micro-batches.
STOP_OVERRIDES = tiny(
    "averaging.backend=none",
    "averaging.sync_every_steps=3",
    "train.micro_batch_size=4",
    "train.eval_every_rounds=1",
    "train.checkpoint_every_s=1e-6",
    UNLIMITED,
)
STRIKE_STEP = 6
"""The step during (or after) which the stop arrives: it completes round 2."""


class _StopWatch:
    """Records what a peer starts (rounds, evaluations, checkpoint writes) and whether the stop was set."""

    def __init__(self, peer: TrainingPeer, stop: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
        self.peer, self.stop = peer, stop
        self.after_stop: list[tuple[str, int]] = []
        self._wrap(peer.backend, "sync_round", "round", monkeypatch)
        self._wrap(peer.trainee, "evaluate", "evaluation", monkeypatch)
        self._wrap(checkpoints_module, "save_checkpoint", "checkpoint", monkeypatch)

    def _wrap(self, owner: object, name: str, what: str, monkeypatch: pytest.MonkeyPatch) -> None:
        real = getattr(owner, name)

        def recording(*args, **kwargs):
            if self.stop.is_set():
                self.after_stop.append((what, self.peer.progress.step))
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recording)


def _strike(peer: TrainingPeer, stop: threading.Event, moment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Set ``stop`` at ``moment`` of step :data:`STRIKE_STEP` (or of the evaluation of its round)."""
    if moment == "end of step":
        real_step = peer.inner.step

        def step_then_stop(*args, **kwargs):
            stats = real_step(*args, **kwargs)
            if peer.inner.steps == STRIKE_STEP:
                stop.set()
            return stats

        monkeypatch.setattr(peer.inner, "step", step_then_stop)
        return
    evaluating = moment == "evaluation"

    def on_forward(module, inputs) -> None:  # the first micro-batch's, or the first held-out batch's
        if peer.inner.steps == STRIKE_STEP - (0 if evaluating else 1) and module.training != evaluating:
            stop.set()

    peer.model.register_forward_pre_hook(on_forward)


@pytest.mark.parametrize(
    ("moment", "saved_step"),
    [("mid-step", STRIKE_STEP - 1), ("end of step", STRIKE_STEP), ("evaluation", STRIKE_STEP)],
)
def test_a_stop_starts_no_round_evaluation_or_checkpoint_and_one_checkpoint_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moment: str, saved_step: int
) -> None:
    """Stopped mid-step, the step is abandoned (nothing of it applied); stopped after a step that makes
    a round due, the round does not start; stopped during a round's evaluation, it is abandoned and
    its periodic checkpoint not written. Either way the only work after the stop is the caller's one
    checkpoint (what ``swarm join`` saves on the way out), at the last completed step, which resumes."""
    checkpoints = tmp_path / "ckpt"
    config = load_config(None, overrides=[*STOP_OVERRIDES, f"train.checkpoint_dir={checkpoints}"], env={})
    stop, reports = threading.Event(), []
    peer = TrainingPeer(config, NetworkOptions(), on_sync=reports.append)
    try:
        watch = _StopWatch(peer, stop, monkeypatch)
        _strike(peer, stop, moment, monkeypatch)
        peer.run(stop)
        peer.save_checkpoint()
        assert watch.after_stop == [("checkpoint", saved_step)], watch.after_stop
        assert (peer.progress.step, peer.progress.round) == (saved_step, 1 + (moment == "evaluation"))
        if moment == "mid-step":
            assert all(p.grad is None for p in peer.model.parameters()), "the abandoned step left gradients"
        if moment == "evaluation":  # round 2 is booked with round 1's evaluation: its own was abandoned
            assert [r.eval_loss for r in reports] == [reports[0].eval_loss] * 2
        assert [step for step, _ in list_checkpoints(checkpoints)] == [saved_step, 3]
        state = read_checkpoint(list_checkpoints(checkpoints)[0][1])
        for name, tensor in peer.model.state_dict().items():
            assert torch.equal(state["model"][name], tensor), name
    finally:
        peer.close()
    resumed = TrainingPeer(config, NetworkOptions(), resume=True)
    try:
        assert resumed.progress.step == saved_step
        resumed.run(threading.Event(), max_steps=saved_step + 1)
        assert resumed.progress.step == saved_step + 1
    finally:
        resumed.close()
