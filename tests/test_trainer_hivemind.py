"""The hivemind baseline (``averaging.backend: hivemind``) and the peer factory."""

from __future__ import annotations

import threading

import pytest

from swarm.config import load_config
from swarm.network import NetworkOptions
from swarm.trainer import SyncReport, TrainingPeer
from swarm.trainer._solo import SoloBackend
from swarm.trainer.baselines import HivemindBackend, hivemind_codec, hivemind_run_id
from tests._processes import stop_training, wait_until
from tests.workers.tiny import TINY

UNTRAINED_BITS = 8.0


def _config(*overrides: str):
    return load_config(None, overrides=[*TINY, *overrides], env={})


def test_codecs_map_to_hivemind_and_int4_is_refused() -> None:
    assert type(hivemind_codec("int8")).__name__ == "BlockwiseQuantization"
    assert type(hivemind_codec("fp16")).__name__ == "Float16Compression"
    assert type(hivemind_codec("fp32")).__name__ == "NoCompression"
    with pytest.raises(ValueError, match="int4"):
        hivemind_codec("int4")
    assert hivemind_run_id("run.a") == "run_a_hivemind"


def test_the_config_picks_the_backend() -> None:
    solo = TrainingPeer(_config("averaging.backend=none"), NetworkOptions())
    try:
        assert type(solo.backend) is SoloBackend
    finally:
        solo.close()
    peer = TrainingPeer(_config("averaging.backend=hivemind"), NetworkOptions())
    try:
        assert type(peer.backend) is HivemindBackend and peer.resumed_from is None
        assert peer.inner.optimizer is peer.backend.optimizer  # hivemind.Optimizer wraps the inner AdamW
        assert peer.n_params > 0 and peer.exchange_metrics().bytes_sent == 0
    finally:
        peer.close()


MIN_STEPS = 100  # enough training for the loss assert below
STEP_CAP = 100_000  # a bound that no run reaches before the deadline: the test stops the peers itself


@pytest.mark.multipeer
@pytest.mark.timeout(480)
def test_two_hivemind_peers_average_and_learn() -> None:
    # two peers, each averaging every ~10 of its own steps: 2 * 10 steps of the swarm per epoch
    config = _config("averaging.backend=hivemind", "averaging.sync_every_steps=20")
    reports: dict[str, list[SyncReport]] = {"a": [], "b": []}
    first = TrainingPeer(config, NetworkOptions(), on_sync=reports["a"].append)
    peers = [first]
    stop = threading.Event()
    try:
        joined = NetworkOptions(initial_peers=first.node.visible_maddrs())
        peers.append(TrainingPeer(config, joined, on_sync=reports["b"].append))
        threads = [
            threading.Thread(target=p.run, args=(stop,), kwargs={"max_steps": STEP_CAP}) for p in peers
        ]
        for thread in threads:
            thread.start()

        # Matchmaking takes seconds whatever the machine's speed, and a fast machine trains 100 steps in
        # less: train until each peer has both trained MIN_STEPS and averaged in at least one epoch.
        def trained_and_averaged() -> bool:
            return all(
                peer.progress.step >= MIN_STEPS and any(r.outcome == "ok" for r in reports[name])
                for name, peer in zip(reports, peers, strict=True)
            )

        try:
            took = wait_until(trained_and_averaged, 300, what=f"both peers to train {MIN_STEPS} steps")
        except AssertionError as exc:
            outcomes = {name: [r.outcome for r in found] for name, found in reports.items()}
            steps = [peer.progress.step for peer in peers]
            raise AssertionError(f"{exc} and average: steps {steps}, epochs {outcomes}") from None
        print(f"trained and averaged after {took:.0f}s, steps {[peer.progress.step for peer in peers]}")
        stop_training(stop, threads, timeout=120)
    finally:
        stop.set()
        for peer in peers:
            peer.close()
    for name, peer in zip(reports, peers, strict=True):
        assert reports[name], f"peer {name} reported no epoch"
        assert peer.progress.eval_loss < UNTRAINED_BITS - 3, peer.progress.eval_loss
        averaged = [r for r in reports[name] if r.outcome == "ok"]
        assert averaged, f"peer {name} never averaged: {[r.outcome for r in reports[name]]}"
        metrics = peer.exchange_metrics()
        assert metrics.exchanges_ok >= 1
        assert metrics.bytes_sent > 0.5 * peer.n_params  # 8-bit parts of at least half the model went out
        assert 0.0 < peer.progress.utilization() < 1.0
