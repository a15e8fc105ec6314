"""Churn: a local swarm of 3 trainers keeps training while trainers are SIGKILLed and restarted.

One test runs two swarms of the same length side by side, each a bootstrap (its own DHT) and 3 trainers
on loopback with a tiny model (tests/workers/chaos.py), so that both train under the same load and the
test waits for the longer of the two rather than for one after the other:

* the churn-free baseline: every trainer trains past ``STEPS`` inner steps;
* the churn run: the same, while a random trainer is SIGKILLed ``KILLS`` times (alternately the
  whole session, and the main process alone so that the DHT worker's watchdog has to stop
  ``p2pd``) and restarted at once with ``--resume``. The kills are spread over the first 40% of
  the run by progress (``KILL_AT_STEPS``) rather than by the clock, so the test holds on machines
  of any speed; ``ChaosSwarm.run(period_s=15)`` kills by the clock instead. The driver keeps every
  trainer running until each restarted one has completed an exchange, then stops them all.

Asserted: nothing of a killed trainer survives it; every restarted trainer resumes from its newest
checkpoint, continues past that step and completes an exchange; every trainer passes ``STEPS`` and
exits 0 when stopped; every checkpoint file loads; and the churn run's mean held-out loss at
``STEPS`` is at most ``MARGIN_BITS`` (bits/byte) above the baseline's. A killed trainer loses at most
the steps since its last checkpoint (``train.checkpoint_every_s``) and redoes them, so at equal steps
the two runs should end close; the margin covers run-to-run noise (measured spread in docs/training.md).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from peers.local import cpu_threads_env
from swarm.state import list_checkpoints, read_checkpoint
from tests._processes import PeerProcess, heavy_scenario
from tests.workers.chaos import ChaosSwarm, Trainer
from tests.workers.tiny import UNLIMITED, tiny

STEPS = 120
SIZE = 3
KILLS = 3  # alternately the whole session and the main process alone: both ways, one of them twice
# kill when the running trainers' mean step passes these: the first 40% of the run
KILL_AT_STEPS = [int(STEPS * f) for f in (0.1, 0.25, 0.4)]
DEADLINE_S = 400
MARGIN_BITS = 0.3
OVERRIDES = tiny(
    "train.eval_batches=8",
    UNLIMITED,
    "train.checkpoint_every_s=1",
    "averaging.sync_every_steps=10",
)


def _mean_eval_loss(swarm: ChaosSwarm) -> float:
    """The trainers' mean held-out loss at STEPS (each trainer's first evaluation from there on)."""
    return statistics.fmean(swarm.eval_at(trainer, STEPS) for trainer in swarm.trainers)


def _stop_and_check(swarm: ChaosSwarm) -> None:
    codes = swarm.stop()
    assert codes == [0] * (swarm.size + 1), [t.current.process.output()[-2000:] for t in swarm.trainers]
    assert all(summary["steps"] >= STEPS for summary in swarm.summaries())


def _baseline(spawn: Callable[..., PeerProcess], workdir: Path) -> tuple[ChaosSwarm, float]:
    """The churn-free run, stopped and checked once every trainer passed STEPS; with its seconds."""
    started = time.monotonic()
    baseline = ChaosSwarm(spawn, workdir, OVERRIDES, size=SIZE).start()
    baseline.run(target_steps=STEPS, max_kills=0, deadline_s=DEADLINE_S, seed=0)
    _stop_and_check(baseline)
    return baseline, time.monotonic() - started


def _assert_restarts_resumed_and_synced(trainer: Trainer) -> None:
    for incarnation in trainer.incarnations[1:]:
        output = incarnation.process.output()
        syncs = incarnation.sync_lines()
        assert syncs, f"restarted trainer {trainer.index} never synced:\n{output}"
        if incarnation.resumed_step is not None:
            assert "resumed from" in output, output
            assert syncs[0].step > incarnation.resumed_step, (
                trainer.index,
                syncs[0],
                incarnation.resumed_step,
            )
        assert incarnation.exchanged(), f"no exchange after the restart:\n{output}"


def _assert_checkpoints_intact(directory: Path) -> None:
    for step, path in list_checkpoints(directory):
        assert read_checkpoint(path)["progress"]["step"] == step, path
    leftovers = [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert not leftovers, f"temporary files of killed writers were not cleaned up: {leftovers}"


def test_local_swarm_gives_each_peer_its_share_of_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert cpu_threads_env(4, environ={}) == {"OMP_NUM_THREADS": "2"}
    assert cpu_threads_env(16, environ={}) == {"OMP_NUM_THREADS": "1"}
    assert cpu_threads_env(4, environ={"OMP_NUM_THREADS": "3"}) == {}


@heavy_scenario
@pytest.mark.multipeer
@pytest.mark.timeout(DEADLINE_S + 180)
def test_learning_survives_random_kills_and_restarts(spawn, tmp_path) -> None:
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:  # the baseline runs beside the churn run
        baseline_run = pool.submit(_baseline, spawn, tmp_path / "baseline")
        churn = ChaosSwarm(spawn, tmp_path / "churn", OVERRIDES, size=SIZE).start()
        churn.run(
            target_steps=STEPS,
            max_kills=KILLS,
            deadline_s=DEADLINE_S,
            seed=time.time_ns(),
            at_steps=KILL_AT_STEPS,
        )
        assert len(churn.kills) == KILLS
        _stop_and_check(churn)
        baseline, baseline_s = baseline_run.result()
    print(f"baseline took {baseline_s:.0f}s")

    for trainer in churn.trainers:
        _assert_restarts_resumed_and_synced(trainer)
        _assert_checkpoints_intact(trainer.checkpoints)

    clean, churned = _mean_eval_loss(baseline), _mean_eval_loss(churn)
    print(
        f"at {STEPS} steps: baseline {clean:.3f} bits/byte in {baseline_s:.0f}s; churn {churned:.3f} "
        f"bits/byte with kills {churn.kills}; total {time.monotonic() - started:.0f}s"
    )
    assert churned <= clean + MARGIN_BITS, (churned, clean)
