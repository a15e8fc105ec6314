"""The hivemind baseline (``averaging.backend: hivemind``) and the peer factory."""

from __future__ import annotations

import threading

import pytest

from swarm.config import load_config
from swarm.network import NetworkOptions
from swarm.trainer import SyncReport, TrainingPeer
from swarm.trainer._factory import make_training_peer
from swarm.trainer._hivemind import HivemindTrainingPeer, hivemind_codec, hivemind_run_id
from tests.test_trainer import TINY

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


def test_factory_picks_the_class_of_the_backend() -> None:
    solo = make_training_peer(_config("averaging.backend=none"), NetworkOptions())
    try:
        assert type(solo) is TrainingPeer
    finally:
        solo.close()
    peer = make_training_peer(_config("averaging.backend=hivemind"), NetworkOptions())
    try:
        assert type(peer) is HivemindTrainingPeer
        assert peer.deltas is None and peer.params is None and peer.resumed_from is None
        assert peer.n_params > 0 and peer.gossip_metrics().bytes_sent == 0
    finally:
        peer.close()


@pytest.mark.multipeer
def test_two_hivemind_peers_average_and_learn() -> None:
    # two peers, each averaging every ~10 of its own steps: 2 * 10 steps of the swarm per epoch
    config = _config("averaging.backend=hivemind", "averaging.sync_every_steps=20")
    reports: dict[str, list[SyncReport]] = {"a": [], "b": []}
    first = HivemindTrainingPeer(config, NetworkOptions(), on_sync=reports["a"].append)
    peers = [first]
    try:
        joined = NetworkOptions(initial_peers=first.node.visible_maddrs())
        peers.append(HivemindTrainingPeer(config, joined, on_sync=reports["b"].append))
        stop = threading.Event()
        threads = [threading.Thread(target=p.run, args=(stop,), kwargs={"max_steps": 100}) for p in peers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert not any(t.is_alive() for t in threads), "training did not finish in time"
    finally:
        stop.set()
        for peer in peers:
            peer.close()
    for name, peer in zip(reports, peers, strict=True):
        assert reports[name], f"peer {name} reported no epoch"
        assert peer.progress.eval_loss < UNTRAINED_BITS - 3, peer.progress.eval_loss
        averaged = [r for r in reports[name] if r.outcome == "ok"]
        assert averaged, f"peer {name} never averaged: {[r.outcome for r in reports[name]]}"
        metrics = peer.gossip_metrics()
        assert metrics.exchanges_ok >= 1
        assert metrics.bytes_sent > 0.5 * peer.n_params  # 8-bit parts of at least half the model went out
        assert 0.0 < peer.progress.utilization() < 1.0
