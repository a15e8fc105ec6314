"""peers/_trainer_output.py: the per-sync line, plain output off a terminal, the trainer's own history."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from rich.console import Console

from peers._trainer_output import TrainerOutput, format_sync_line
from peers.local_summary import print_summary, swarm_summary
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
    for part in ("round   12", "step    120", "120.0 samples/s", "lr=1.00e-03"):
        assert part in line
    assert f"with {PEER[-8:]}" in line and "sent 2.0 KiB recv 1.0 KiB" in line and "drift 0.0120" in line
    assert "eval - bits/byte" in format_sync_line(_report(10, eval_loss=None))


def test_sync_line_labels_both_losses_with_one_unit() -> None:
    byte_level = format_sync_line(_report(120))
    assert " loss 3.250 eval 3.500 bits/byte " in byte_level and "nats" not in byte_level
    tokenized = dataclasses.replace(_report(120), loss_unit="bits/token", eval_bits_per_byte=1.2345)
    line = format_sync_line(tokenized)
    assert " loss 3.250 eval 3.500 bits/token " in line and " eval 1.234 bits/byte drift 0.0120" in line


def test_sync_line_words_keep_the_positions_parsers_rely_on() -> None:
    """tests/workers/chaos.py and tests/test_partition.py split the line (the benchmarks read the
    trainers' histories and summaries instead)."""
    for report in (_report(120), dataclasses.replace(_report(120), loss_unit="bits/token")):
        words = format_sync_line(report).split()
        assert (words[0], words[2], words[4], words[6], words[12], words[14]) == (
            "round", "step", "loss", "eval", "sync", "with",
        )  # fmt: skip
        assert (words[3], float(words[7]), words[13], words[15]) == ("120", 3.5, "ok", PEER[-8:])
        assert words[-2:] == ["drift", "0.0120"]


def test_summary_names_the_unit_and_bits_per_byte_of_a_tokenized_run() -> None:
    rows = [
        {"name": f"peer-{i}", "steps": 10, "eval_loss": loss, "eval_loss_unit": "bits/token",
         "eval_bits_per_byte": loss / 4}
        for i, loss in ((1, 4.0), (2, 6.0))
    ]  # fmt: skip
    summary = swarm_summary(rows, baseline_unigram_loss=8.0)
    assert (summary["eval_loss"], summary["eval_bits_per_byte"]) == (5.0, 1.25)
    assert summary["eval_loss_unit"] == "bits/token"
    console = Console(width=200, record=True)
    print_summary(summary, console)
    text = console.export_text()
    assert "eval (bits/token)" in text
    assert "eval loss 5.000 bits/token (1.250 bits/byte) vs unigram baseline 8.000 bits/token" in text


def test_plain_lines_and_history_when_not_a_terminal(tmp_path, capsys) -> None:
    config = load_config(None, overrides=["train.max_steps=100"], env={})
    history = tmp_path / "own.jsonl"
    with TrainerOutput(config, history) as output:
        output.joined(_record(0))  # the history's first line: when the peer joined
        for step in (10, 20):
            output.on_sync(_report(step), _record(step))
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[3] for line in printed] == ["10", "20"]  # one plain line per sync, no bar
    snapshots = read_history(history)
    assert [s["peers"][0]["step"] for s in snapshots] == [0, 10, 20]
    assert [s["totals"]["samples_total"] for s in snapshots] == [0, 160, 320]


class _Stub:
    """The parts of a trainer the exit summary reads."""

    def __init__(self, checkpoint_dir: str | None, num_stages: int = 1) -> None:
        from swarm.gossip import ExchangeMetrics
        from swarm.trainer import Progress

        self.config = load_config(
            None, overrides=[f"train.checkpoint_dir={checkpoint_dir or 'null'}"], env={}
        )
        self.progress = Progress()
        self.progress.samples_total, self.progress.swarm_samples = 1_500, 6_000
        self.num_stages = num_stages
        self._metrics = ExchangeMetrics(
            exchanges_ok=12,
            exchanges_failed=2,
            exchanges_rejected=1,
            bytes_sent=3 * 2**20,
            bytes_received=512,
        )

    def exchange_metrics(self):
        return self._metrics


def test_the_exit_summary_says_what_the_peer_did_and_how_to_export_it(tmp_path) -> None:
    import shlex

    from peers._trainer_output import ExitSummary

    directory = str(tmp_path / "my ckpts")
    saved = tmp_path / "my ckpts" / "ckpt-000000000042.pt"
    lines = ExitSummary.of(_Stub(directory), time.monotonic() - 75, saved).lines()
    assert lines[0].startswith("summary: trained 1,500 samples of the swarm's 6,000 (25.0%) in 1m1")
    assert "exchanges 12 ok, 3 failed; sent 3.0 MiB, received 512 B" in lines[0]
    assert lines[1] == f"summary: checkpoint {saved}"
    command = lines[2].removeprefix("summary: export the model with: ")
    assert shlex.split(command) == ["swarm", "export", "--checkpoint", directory, "--out", "model"]
    none = ExitSummary.of(_Stub(None), time.monotonic(), None).lines()
    assert none[1] == "summary: no checkpoint kept (train.checkpoint_dir is null)" and len(none) == 2
    stage = ExitSummary.of(_Stub(directory, num_stages=2), time.monotonic(), saved).lines()
    assert "export the model" not in "\n".join(stage) and "pipeline stage" in stage[-1]


def test_every_peer_says_where_its_checkpoints_go() -> None:
    from peers._trainer_output import checkpoint_line

    given = load_config(None, overrides=["train.checkpoint_dir=/data/ckpt"], env={})
    assert checkpoint_line(given).startswith("join: checkpoints go to /data/ckpt (every 300 s")
    none = load_config(None, overrides=["train.checkpoint_dir=null"], env={})
    assert "keeping no checkpoints (train.checkpoint_dir is null)" in checkpoint_line(none)


def test_the_local_demo_names_each_trainer_once(tmp_path) -> None:
    """The live table shows public names, the summary table the summary files' names: the same."""
    from peers.local import _trainer_args
    from peers.local_summary import collect

    args = _trainer_args([], "/ip4/127.0.0.1/tcp/1/p2p/x", 2, tmp_path)
    name = args[args.index("--public-name") + 1]
    summary = Path(args[args.index("--summary") + 1])
    summary.write_text("{}")
    assert [row["name"] for row in collect([summary])] == [name] == ["peer-2"]
