"""swarm.trainer: training peers in one process (fast) and through the CLI (multi-process)."""

from __future__ import annotations

import json
import logging
import signal
import threading

import pytest

from swarm.config import load_config
from swarm.network import NetworkOptions
from swarm.state import list_checkpoints
from swarm.trainer import SyncReport, TrainingPeer
from swarm.training import evaluate
from tests._processes import swarm_cli, wait_until

TINY = [
    "model.n_layer=1",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=32",
    "train.batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.eval_batches=2",
    "network.record_interval_s=1",
    "network.record_ttl_s=4",
]


def _config(tmp_path, *overrides: str):
    return load_config(None, overrides=[*TINY, *overrides], env={})


class _Runner:
    """A TrainingPeer training in a background thread, with its sync reports collected."""

    def __init__(self, config, network: NetworkOptions, **kwargs):
        self.reports: list[SyncReport] = []
        self.peer = TrainingPeer(config, network, on_sync=self.reports.append, **kwargs)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.peer.run, args=(self.stop,), daemon=True)

    def start(self) -> _Runner:
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=60)
        self.peer.close()


def test_resume_skips_a_corrupt_checkpoint(tmp_path, caplog) -> None:
    checkpoints = tmp_path / "ckpt"
    config = _config(
        tmp_path,
        "averaging.backend=none",
        "averaging.sync_every_steps=5",
        f"train.checkpoint_dir={checkpoints}",
        "train.checkpoint_every_s=1e-6",
    )
    first = TrainingPeer(config, NetworkOptions())
    try:
        first.run(threading.Event(), max_steps=15)
    finally:
        first.close()
    saved = list_checkpoints(checkpoints)
    assert [step for step, _ in saved] == [15, 10, 5]
    newest = saved[0][1]
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING):
        second = TrainingPeer(config, NetworkOptions(), resume=True)
    try:
        assert second.resumed_from == saved[1][1]
        assert second.progress.step == 10
        assert any(newest.name in r.getMessage() and "checksum" in r.getMessage() for r in caplog.records)
        second.run(threading.Event(), max_steps=12)
        assert second.progress.step == 12
    finally:
        second.close()


@pytest.mark.multipeer
def test_joiner_adopts_live_parameters_and_slow_fast_peers_both_contribute(tmp_path) -> None:
    """A fresh peer starts from a live peer's parameters; a 3x slower peer syncs with less weight."""
    base = _config(tmp_path, "averaging.sync_every_steps=1000", "averaging.sync_every_seconds=1.0")
    fast = _Runner(base, NetworkOptions()).start()
    runners = [fast]
    try:
        maddrs = fast.peer.node.visible_maddrs()
        wait_until(
            lambda: fast.peer.progress.step >= 40, timeout=120, what="the first peer to train 40 steps"
        )
        slow_config = base.model_copy(update={"train": base.train.model_copy(update={"slowdown": 3.0})})
        slow = _Runner(slow_config, NetworkOptions(initial_peers=maddrs))
        runners.append(slow)
        fresh_loss = 8.0  # an untrained byte model is near log2(256) bits per byte
        slow.peer.join_swarm()
        assert slow.peer.joined_from == [fast.peer.node.peer_id]  # verified download, not the fallback
        adopted = evaluate(slow.peer.model, slow.peer.eval_set, 2)
        assert adopted < fresh_loss - 1.0, "the joiner did not take the live peer's parameters"
        assert abs(adopted - evaluate(fast.peer.model, fast.peer.eval_set, 2)) < 0.5
        slow.start()

        def both_synced_with_each_other() -> bool:
            return all(any(r.outcome == "ok" for r in runner.reports[1:]) for runner in runners)

        wait_until(both_synced_with_each_other, timeout=120, what="both peers to complete exchanges")
        wait_until(lambda: len(slow.reports) >= 4, timeout=120, what="four syncs of the slow peer")
    finally:
        for runner in runners:
            runner.close()
    fast_weight = sum(r.weight for r in fast.reports[1:]) / len(fast.reports[1:])
    slow_weight = sum(r.weight for r in slow.reports[1:]) / len(slow.reports[1:])
    assert fast_weight > 1.5 * slow_weight, (fast_weight, slow_weight)
    assert fast.peer.gossip_metrics().exchanges_ok > 0 and slow.peer.gossip_metrics().exchanges_ok > 0


@pytest.mark.multipeer
def test_three_gossip_peers_learn_and_stay_together(spawn, tmp_path) -> None:
    summary = tmp_path / "summary.json"
    args = [
        "local",
        "--peers",
        "3",
        "--config",
        "configs/local-tiny.yaml",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    args += ["--set", "train.max_steps=120", "--summary", str(summary)]
    local = spawn(swarm_cli(*args))
    assert local.wait(timeout=400) == 0, local.output()
    result = json.loads(summary.read_text())
    assert result["peers"] == 3
    assert result["eval_loss"] < result["baseline_unigram_loss"] - 0.2
    assert all(peer["exchanges_ok"] > 0 for peer in result["per_peer"])
    config = load_config("configs/local-tiny.yaml", env={})
    drifts = [peer["drift"] for peer in result["per_peer"] if peer["drift"] is not None]
    assert drifts and max(drifts) < config.averaging.max_drift
    assert 0 < result["wire_bytes_per_param_per_sync"] < 1.2  # int8 with per-block scales


@pytest.mark.multipeer
def test_killed_trainer_resumes_from_its_checkpoint(spawn, tmp_path) -> None:
    tiny = [item for override in TINY for item in ("--set", override)]
    boot = spawn(swarm_cli("bootstrap", *tiny))  # the same run config, or the joiner is refused
    line = boot.wait_for_line(lambda text: text.startswith("swarm join --initial-peers"), timeout=90)
    checkpoints = tmp_path / "ckpt"
    args = [
        *line.split()[1:],
        "--set",
        f"train.checkpoint_dir={checkpoints}",
        "--set",
        "train.checkpoint_every_s=0.5",
    ]
    args += tiny
    trainer = spawn(swarm_cli(*args))
    wait_until(lambda: len(list_checkpoints(checkpoints)) >= 2, timeout=120, what="two checkpoints")
    trainer.signal(signal.SIGKILL)
    trainer.wait(timeout=30)
    step, _ = list_checkpoints(checkpoints)[0]

    again = spawn(swarm_cli(*args, "--resume"))
    joined = again.wait_for_line(lambda text: "joined run" in text, timeout=120)
    assert f"resumed from {checkpoints}" in joined
    first_sync = again.wait_for_line(lambda text: text.startswith("round"), timeout=120)
    assert int(first_sync.split()[3]) > step
