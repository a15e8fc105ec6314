"""swarm.trainer: training peers in one process (fast) and through the CLI (multi-process)."""

from __future__ import annotations

import json
import logging
import re
import signal
import threading
from pathlib import Path

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


TRAINED_STEPS = 40  # a state this far trained is well below an untrained model's loss (fresh_loss)


@pytest.mark.multipeer
def test_joiner_adopts_live_parameters_and_slow_fast_peers_both_contribute(tmp_path) -> None:
    """A fresh peer starts from a live peer's published state; a 3x slower peer syncs with less weight."""
    base = _config(tmp_path, "averaging.sync_every_steps=1000", "averaging.sync_every_seconds=1.0")
    fast = _Runner(base, NetworkOptions()).start()
    runners = [fast]
    try:
        maddrs = fast.peer.node.visible_maddrs()
        # A trainer publishes its state at each sync round (here every second), not at each step: wait
        # for a round whose published state has trained TRAINED_STEPS steps, whatever the machine's speed.
        wait_until(
            lambda: any(r.step >= TRAINED_STEPS for r in fast.reports),
            timeout=120,
            what=f"the first peer to publish a state trained for {TRAINED_STEPS} steps",
        )
        slow_config = base.model_copy(update={"train": base.train.model_copy(update={"slowdown": 3.0})})
        slow = _Runner(slow_config, NetworkOptions(initial_peers=maddrs))
        runners.append(slow)
        fresh_loss = 8.0  # an untrained byte model is near log2(256) bits per byte
        slow.peer.join_swarm()
        assert slow.peer.joined.donors == (fast.peer.node.peer_id,)  # verified download, not the fallback
        joined = slow.peer.joined.meta
        assert joined["step"] >= TRAINED_STEPS, joined
        adopted = evaluate(slow.peer.model, slow.peer.eval_set, 2)
        assert adopted < fresh_loss - 1.0, "the joiner did not take the live peer's parameters"
        # the live peer's parameters as they were when it published that state: compared with the held-out
        # loss the live peer reported for that round (its own model, evaluated just before publishing),
        # not with its model now, which has trained on for as long as the join took
        wait_until(
            lambda: any(r.round == joined["round"] for r in fast.reports), 30, "the published round's report"
        )
        [published] = [r for r in fast.reports if r.round == joined["round"]]
        assert published.step <= joined["step"], (published, joined)
        print(f"joined {joined}: {adopted:.4f} bits/byte, the donor reported {published.eval_loss:.4f}")
        assert abs(adopted - published.eval_loss) < 0.5, (adopted, published)
        slow.start()
        fast_mark = len(fast.reports)  # compare weights over the time both peers train side by side

        def both_synced_with_each_other() -> bool:
            return all(any(r.outcome == "ok" for r in runner.reports[1:]) for runner in runners)

        wait_until(both_synced_with_each_other, timeout=120, what="both peers to complete exchanges")
        wait_until(
            lambda: len(slow.reports) >= 4 and len(fast.reports) >= fast_mark + 2,
            timeout=120,
            what="four syncs of the slow peer and two of the fast one meanwhile",
        )
    finally:
        for runner in runners:
            runner.close()
    # each side's first report (the fast one's straddles the join, the slow one's starts before its
    # first step) is left out; the rest were made while both trained under the same load
    side_by_side = fast.reports[fast_mark + 1 :]
    fast_weight = sum(r.weight for r in side_by_side) / len(side_by_side)
    slow_weight = sum(r.weight for r in slow.reports[1:]) / len(slow.reports[1:])
    assert fast_weight > 1.5 * slow_weight, (fast_weight, slow_weight)
    assert fast.peer.gossip_metrics().exchanges_ok > 0 and slow.peer.gossip_metrics().exchanges_ok > 0


SYNC_LINE = re.compile(r"^round +\d+ step +(\d+) .* sync (\S+) with \S+ .* drift (\S+)$")
LEARN_STEPS = 120


def _sync_lines(log: Path) -> list[tuple[int, str, str]]:
    """(step, outcome, drift) of each per-sync line a trainer of `swarm local` wrote to its log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [(int(m[1]), m[2], m[3]) for m in map(SYNC_LINE.match, text.splitlines()) if m]


@pytest.mark.multipeer
@pytest.mark.timeout(520)
def test_three_gossip_peers_learn_and_stay_together(spawn, tmp_path) -> None:
    summary, logs = tmp_path / "summary.json", tmp_path / "logs"
    max_drift = load_config("configs/local-tiny.yaml", env={}).averaging.max_drift
    args = ["local", "--peers", "3", "--config", "configs/local-tiny.yaml", "--log-dir", str(logs)]
    # The trainers come up at different moments: with a step limit, a fast machine can finish the first
    # ones before the last has joined, which then has nobody to exchange with. So they train without one
    # until each has done LEARN_STEPS steps and an exchange of its own, and its latest drift measurement
    # is under max_drift (drift control pulls a larger one back); then Ctrl+C ends the run.
    args += ["--set", "train.max_steps=100000", "--summary", str(summary)]
    local = spawn(swarm_cli(*args))
    peer_logs = [logs / f"peer-{index}.log" for index in (1, 2, 3)]

    def learned_and_together() -> bool:
        for log in peer_logs:
            found = _sync_lines(log)
            drifts = [float(drift) for *_, drift in found if drift != "-"]
            if not (
                found and found[-1][0] >= LEARN_STEPS and any(outcome == "ok" for _, outcome, _ in found)
            ):
                return False
            if not (drifts and drifts[-1] < max_drift):
                return False
        return True

    took = wait_until(learned_and_together, 400, what=f"3 trainers to train {LEARN_STEPS} steps and sync")
    local.signal(signal.SIGINT)
    print(f"trained and synced after {took:.0f}s")
    assert local.wait(timeout=60) == 0, local.output()
    result = json.loads(summary.read_text())
    print({key: result[key] for key in ("eval_loss", "baseline_unigram_loss")}, result["per_peer"])
    assert result["peers"] == 3
    assert all(peer["steps"] >= LEARN_STEPS for peer in result["per_peer"])
    assert result["eval_loss"] < result["baseline_unigram_loss"] - 0.2
    assert all(peer["exchanges_ok"] > 0 for peer in result["per_peer"])
    drifts = [peer["drift"] for peer in result["per_peer"]]
    assert None not in drifts and max(drifts) < max_drift, drifts
    assert 0 < result["exchange_bytes_per_param"] < 1.2  # int8 with per-block scales
    # all averaging traffic per round: the pseudo-gradient plus the occasional fp16 anchor exchange
    assert result["exchange_bytes_per_param"] < result["wire_bytes_per_param_per_sync"] < 3.0


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
