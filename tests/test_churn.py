"""Churn: a local swarm of 5 trainers keeps training while trainers are SIGKILLed and restarted.

One test runs two swarms of the same length one after the other, each a bootstrap and 5 trainers on
loopback with a tiny model (tests/chaos.py):

* the churn-free baseline: every trainer trains ``MAX_STEPS`` inner steps;
* the churn run: the same, while a random trainer is SIGKILLed ``KILLS`` times (alternately the
  whole session, and the main process alone so that the DHT worker's watchdog has to stop
  ``p2pd``) and restarted at once with ``--resume``. The kills are spread over the first half of
  the run by progress (``KILL_AT_STEPS``) rather than by the clock, so the test holds on machines
  of any speed; ``ChaosSwarm.run(period_s=15)`` kills by the clock instead.

Asserted: nothing of a killed trainer survives it; every restarted trainer resumes from its newest
checkpoint, continues past that step and completes at least one exchange; every trainer reaches
``MAX_STEPS`` and exits 0; every checkpoint file loads; and the churn run's mean final eval loss is
at most ``MARGIN_BITS`` (bits/byte) above the baseline's. A killed trainer loses at most the steps
since its last checkpoint (``train.checkpoint_every_s``) and redoes them, so at equal steps the two
runs should end close; the margin covers run-to-run noise (measured spread in docs/training.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from peers.local import cpu_threads_env
from swarm.state import list_checkpoints, read_checkpoint
from tests.chaos import ChaosSwarm, Trainer

MAX_STEPS = 200
KILLS = 4
# kill when the running trainers' mean step passes these: the first half of the run, so that a
# trainer restarted last still finds partners that have not finished yet
KILL_AT_STEPS = [int(MAX_STEPS * f) for f in (0.1, 0.2, 0.35, 0.5)]
DEADLINE_S = 400
MARGIN_BITS = 0.3
OVERRIDES = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.eval_batches=8",
    f"train.max_steps={MAX_STEPS}",
    "train.checkpoint_every_s=1",
    "averaging.sync_every_steps=10",
    "network.record_interval_s=1",
    "network.record_ttl_s=4",
]


def _mean_eval_loss(swarm: ChaosSwarm) -> float:
    summaries = swarm.summaries()
    assert [s["steps"] for s in summaries] == [MAX_STEPS] * swarm.size
    return sum(s["eval_loss"] for s in summaries) / len(summaries)


def _assert_restarts_resumed_and_synced(trainer: Trainer) -> None:
    for incarnation in trainer.incarnations[1:]:
        output = incarnation.process.output()
        syncs = incarnation.sync_lines()
        assert syncs, f"restarted trainer {trainer.index} never synced:\n{output}"
        if incarnation.resumed_step is not None:
            assert "resumed from" in output, output
            assert syncs[0][0] > incarnation.resumed_step, (trainer.index, syncs[0], incarnation.resumed_step)
        assert any(outcome == "ok" for _, outcome in syncs), f"no exchange after the restart:\n{output}"


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


@pytest.mark.multipeer
@pytest.mark.timeout(2 * DEADLINE_S + 120)
def test_training_survives_random_kills_and_restarts(spawn, tmp_path) -> None:
    started = time.monotonic()
    baseline = ChaosSwarm(spawn, tmp_path / "baseline", OVERRIDES).start()
    baseline.run(max_kills=0, deadline_s=DEADLINE_S, seed=0)
    baseline_s = time.monotonic() - started
    print(f"baseline took {baseline_s:.0f}s")

    churn = ChaosSwarm(spawn, tmp_path / "churn", OVERRIDES).start()
    churn.run(max_kills=KILLS, deadline_s=DEADLINE_S, seed=time.time_ns(), at_steps=KILL_AT_STEPS)
    assert len(churn.kills) == KILLS, f"the run ended after {len(churn.kills)} kills; make it longer"

    for trainer in churn.trainers:
        _assert_restarts_resumed_and_synced(trainer)
        _assert_checkpoints_intact(trainer.checkpoints)

    clean, churned = _mean_eval_loss(baseline), _mean_eval_loss(churn)
    print(
        f"baseline {clean:.3f} bits/byte in {baseline_s:.0f}s; churn {churned:.3f} bits/byte with kills "
        f"{churn.kills}; total {time.monotonic() - started:.0f}s"
    )
    assert churned <= clean + MARGIN_BITS, (churned, clean)
