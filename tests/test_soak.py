"""scripts/soak.py's report and arguments, from given inputs (the soak itself is not part of the suite).

The figures must follow from the inputs: samples trained per incarnation (from the step it resumed at),
the work lost to kills, exchanges that failed counted by cause from the line the gossip averager
logs, and a leftover process (or samples counted that nobody trained) failing the report with a
nonzero exit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from peers._trainer_output import format_sync_line
from scripts import soak, soak_report
from scripts.soak_report import FinalState, Life, RunResult

BATCH = 8


def _sync_line(step: int, outcome: str, eval_loss: float | None) -> str:
    report = SimpleNamespace(
        round=step // 10,
        step=step,
        loss=4.1,
        eval_loss=eval_loss,
        loss_unit="bits/byte",
        samples_per_s=80.0,
        lr=3e-3,
        outcome=outcome,
        partner="12D3KooWabcdefgh",
        bytes_sent=2048,
        bytes_received=2048,
        drift=None,
        eval_bits_per_byte=eval_loss,
        tokens_per_s=800.0,
        mfu=None,
        peak_memory_bytes=None,
    )
    return format_sync_line(report)


def test_sync_lines_are_read_from_the_trainers_own_format() -> None:
    text = "\n".join(
        ["peer 12D3 joined run", _sync_line(10, "solo", None), "noise", _sync_line(20, "ok", 3.75)]
    )
    assert soak_report.sync_lines(text) == [
        soak_report.SyncLine(10, "solo", None),
        soak_report.SyncLine(20, "ok", 3.75),
    ]


def test_failed_exchanges_are_counted_by_role_and_cause_from_the_averagers_line(caplog) -> None:
    from swarm.gossip import _metrics
    from swarm.gossip._metrics import SyncOutcome, log_failure

    peer = "12D3KooW" + "x" * 44
    with caplog.at_level(logging.INFO, logger=_metrics.logger.name):
        log_failure("initiator", peer, "data", SyncOutcome.TIMEOUT, "exchange timed out: chunk 3")
        log_failure("responder", peer, "data", SyncOutcome.FAILED, "IncompleteReadError: 0 bytes")
        log_failure("responder", peer, "data", SyncOutcome.FAILED, "IncompleteReadError: 2 bytes")
        log_failure(
            "initiator", peer, "handshake", SyncOutcome.FAILED, f"{peer}: P2PDaemonError: failed to dial"
        )
    text = "\n".join(f"2026-12-01 INFO {r.name}: {r.getMessage()}" for r in caplog.records)
    assert soak_report.failures(text + "\nexchange ok with someone") == {
        ("initiator", "data timeout: exchange timed out"): 1,
        ("responder", "data failed: IncompleteReadError"): 2,
        ("initiator", "handshake failed: P2PDaemonError"): 1,
    }


def _churned() -> tuple[list[Life], list[FinalState]]:
    lives = [
        Life(1, resumed_step=0, last_step=50, killed="session"),  # checkpointed at 40, trained to 50
        Life(1, resumed_step=40, last_step=90, final_step=100),
        Life(2, resumed_step=0, last_step=None, killed="lone"),  # killed before its first sync line
        Life(2, resumed_step=0, last_step=110, final_step=120),
    ]
    finals = [FinalState(1, 100, 100 * BATCH, 230 * BATCH), FinalState(2, 120, 120 * BATCH, 225 * BATCH)]
    return lives, finals


def test_samples_trained_count_each_life_from_its_resumed_step() -> None:
    lives, finals = _churned()
    samples = soak_report.account(lives, finals, BATCH)
    assert samples["trained"] == (50 + 60 + 0 + 120) * BATCH
    assert samples["accounted"] == 220 * BATCH
    assert samples["lost"] == 10 * BATCH  # trainer 1's steps 40-50, redone after its restart
    assert samples["lost_per_kill"] == 5 * BATCH
    assert (samples["ledger_min"], samples["ledger_max"]) == (225 * BATCH, 230 * BATCH)


def _run(**changes) -> RunResult:
    lives, finals = _churned()
    codes = {"trainer-1": 0, "trainer-2": 0, "bootstrap": 0}
    return RunResult("churn", 120.0, lives, finals, [3.6, 3.8], exit_codes=codes, **changes)


def test_a_clean_run_passes_and_a_leftover_process_fails_it() -> None:
    clean = soak_report.summarize(_run(), BATCH, trainers=2)
    assert clean["ok"] and soak_report.exit_code([clean]) == 0
    assert clean["final_eval_loss"] == pytest.approx(3.7)
    leaked = soak_report.summarize(_run(leftovers=["4242 p2pd /usr/bin/p2pd"]), BATCH, trainers=2)
    assert not leaked["checks"]["no_leftover_processes"]
    assert soak_report.exit_code([clean, leaked]) == 1
    rendered = soak_report.render(leaked, clean)
    assert "FAILED: no_leftover_processes" in rendered and "4242 p2pd" in rendered


def test_samples_counted_that_nobody_trained_fail_the_report() -> None:
    run = _run()
    run.finals[0] = FinalState(1, 130, 130 * BATCH, 230 * BATCH)  # more steps than any life trained
    summary = soak_report.summarize(run, BATCH, trainers=2)
    assert not summary["checks"]["no_samples_counted_that_nobody_trained"]
    assert soak_report.exit_code([summary]) == 1


def test_a_trainer_without_a_final_checkpoint_or_a_clean_exit_fails_the_report() -> None:
    run = _run()
    run.exit_codes["trainer-2"] = None  # did not exit within the grace period
    assert not soak_report.summarize(run, BATCH, trainers=2)["checks"]["every_trainer_exited_0"]
    checks = soak_report.summarize(_run(), BATCH, trainers=3)["checks"]
    assert not checks["every_trainer_has_a_final_checkpoint"]


def test_arguments() -> None:
    assert soak.parse_args([]).duration == soak.FULL_S
    assert soak.parse_args(["--quick"]).duration == soak.QUICK_S
    assert soak.parse_args(["--quick", "--duration", "30"]).duration == 30


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--period", "0"], "must be positive"),
        (["--trainers", "1"], "--trainers must be 2..63"),
        (["--rate", "fast"], "bad rate"),
    ],
)
def test_bad_arguments_are_named(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        soak.parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_an_out_folder_with_files_is_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(SystemExit):
        soak.parse_args(["--out", str(tmp_path)])
    assert "not an empty folder" in capsys.readouterr().err


def test_main_exits_nonzero_when_a_run_leaves_a_process_behind(tmp_path: Path, monkeypatch) -> None:
    def fake_run(name, args, root, seconds, period_s):
        leftovers = ["4242 p2pd /usr/bin/p2pd"] if name == "baseline" else []
        return soak_report.summarize(_run(leftovers=leftovers), BATCH, trainers=2)

    monkeypatch.setattr(soak.netlab, "unavailable_reason", lambda: None)
    monkeypatch.setattr(soak, "run_one", fake_run)
    assert soak.main(["--quick", "--out", str(tmp_path / "a"), "--no-baseline"]) == 0
    assert soak.main(["--quick", "--out", str(tmp_path / "b")]) == 1
    report = json.loads((tmp_path / "b" / "report.json").read_text())
    assert [run["ok"] for run in report["runs"]] == [True, False]
