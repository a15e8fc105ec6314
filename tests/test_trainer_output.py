"""peers/_trainer_output.py: the per-sync line, plain output off a terminal, the trainer's own history."""

from __future__ import annotations

from peers._trainer_output import TrainerOutput, format_sync_line
from swarm import PROTOCOL_VERSION, PeerRecord
from swarm.config import load_config
from swarm.metrics import read_history
from swarm.trainer import SyncReport

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def _report(step: int, eval_loss: float | None = 3.5) -> SyncReport:
    return SyncReport(
        round=step // 10, step=step, loss=3.25, eval_loss=eval_loss, samples_per_s=120.0, outcome="ok",
        partner=PEER, bytes_sent=2048, bytes_received=1024, drift=0.012, lr=1e-3, weight=160.0,
    )  # fmt: skip


def _record(step: int) -> PeerRecord:
    return PeerRecord(
        peer_id=PEER, protocol_version=PROTOCOL_VERSION, package_version="0.1.0", config_hash="ab12",
        role="trainer", state="training", step=step, samples_total=16 * step, loss=3.25,
    )  # fmt: skip


def test_sync_line_names_every_number() -> None:
    line = format_sync_line(_report(120))
    for part in ("round   12", "step    120", "loss 3.250", "eval 3.500", "120.0 samples/s", "lr 1.00e-03"):
        assert part in line
    assert f"with {PEER[-8:]}" in line and "sent 2.0 KiB recv 1.0 KiB" in line and "drift 0.0120" in line
    assert "eval -" in format_sync_line(_report(10, eval_loss=None))


def test_plain_lines_and_history_when_not_a_terminal(tmp_path, capsys) -> None:
    config = load_config(None, overrides=["train.max_steps=100"], env={})
    history = tmp_path / "own.jsonl"
    with TrainerOutput(config, history) as output:
        for step in (10, 20):
            output.on_sync(_report(step), _record(step))
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in printed] == ["10", "20"]  # one plain line per sync, no bar
    snapshots = read_history(history)
    assert [s["peers"][0]["step"] for s in snapshots] == [10, 20]
    assert [s["totals"]["samples_total"] for s in snapshots] == [160, 320]
