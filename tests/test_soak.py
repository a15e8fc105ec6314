"""scripts/soak.py's report and arguments, from given inputs (the soak itself is not part of the suite).

The figures must follow from the inputs: each life read from the history and summary the library
writes (steps, committed and failed exchanges, failures by role and cause), samples trained per
incarnation (from the step it resumed at), the work lost to kills, and a leftover process (or
samples counted that nobody trained) failing the report with a nonzero exit.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import cast

import pytest

from scripts import soak, soak_report
from scripts.soak_report import FinalState, Life, RunResult
from swarm import PROTOCOL_VERSION, PeerRecord
from swarm.gossip import SyncOutcome
from swarm.gossip._metrics import FailureCounts, failure_cause
from swarm.metrics import HistoryWriter, SnapshotPolicy

BATCH = 8
POLICY = SnapshotPolicy(PROTOCOL_VERSION, record_ttl_s=60.0, stale_after_s=60.0)
PEER = "12D3KooW" + "x" * 44


def _record(step: int, ok: int = 0, failed: int = 0, rejected: int = 0) -> PeerRecord:
    """A trainer's record at ``step``, with its exchange counters, as its history holds it."""
    return PeerRecord(
        peer_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx51",
        protocol_version=PROTOCOL_VERSION,
        package_version="0.1.0",
        config_hash="ab12",
        role="trainer",
        state="training",
        round=step // 10,
        step=step,
        samples_total=step * BATCH,
        exchanges_ok=ok,
        exchanges_failed=failed,
        exchanges_rejected=rejected,
    )


def _life(folder: Path, resumed_step: int) -> soak.Life:
    """A life's files as scripts/soak.py names them."""
    log = folder / "life-0.log"
    history, summary = log.with_suffix(".history.jsonl"), log.with_suffix(".summary.json")
    return soak.Life(cast(subprocess.Popen, None), log, history, summary, resumed_step)


def _life_files(tmp_path: Path, records: list[PeerRecord], summary: dict | None = None) -> soak.Life:
    """A life's files as a trainer writes them: its history (the join record, then one per sync) and,
    after a graceful stop, its summary."""
    life = _life(tmp_path, 40)
    history = HistoryWriter(life.history, POLICY)
    for now, record in enumerate(records):
        history.append_record(record, float(now))
    if summary is not None:
        life.summary.write_text(json.dumps(summary))
    return life


def _read(life: soak.Life, killed: str | None = None) -> Life:
    return Life.read(1, life.resumed_step, killed, life.history, life.summary)


def test_a_killed_life_is_read_from_its_history(tmp_path: Path) -> None:
    records = [_record(40), _record(50, failed=1), _record(60, ok=1, failed=2, rejected=1)]
    life = _life_files(tmp_path, records)
    with life.history.open("a") as torn:
        torn.write('{"schema_version": 1, "peers": [{"step": 99')  # killed while writing a line
    assert life.exchanged()
    assert _read(life, "session") == Life(1, 40, last_step=60, killed="session", failed=3)


def test_a_life_counts_as_exchanged_once_its_history_says_so(tmp_path: Path) -> None:
    life = _life(tmp_path, 0)
    assert not life.exchanged() and _read(life).last_step is None  # killed before it joined
    history = HistoryWriter(life.history, POLICY)
    history.append_record(_record(0), 0.0)
    history.append_record(_record(10, failed=1), 1.0)
    assert not life.exchanged() and _read(life).last_step == 10
    history.append_record(_record(20, ok=1, failed=1), 2.0)
    assert life.exchanged()


def _failures() -> dict[str, dict[str, int]]:
    """A summary's ``exchanges_failed_by_cause``, counted by the library's own classification."""
    counts = FailureCounts()
    for chunk in range(3):
        counts.add(
            "initiator", failure_cause("data", SyncOutcome.TIMEOUT, f"exchange timed out: chunk {chunk}")
        )
    for reason in ("IncompleteReadError: 0 bytes", "IncompleteReadError: 2 bytes"):
        counts.add("responder", failure_cause("data", SyncOutcome.FAILED, reason))
    dial = f"{PEER}: P2PDaemonError: failed to dial"
    counts.add("initiator", failure_cause("handshake", SyncOutcome.FAILED, dial))
    return counts.snapshot()


def test_a_stopped_life_is_read_from_its_summary(tmp_path: Path) -> None:
    summary = {"steps": 120, "eval_loss": 3.7, "exchanges_failed_by_cause": _failures()}
    life = _read(_life_files(tmp_path, [_record(40), _record(110, ok=5, failed=4)], summary))
    assert (life.last_step, life.final_step, life.trained_steps, life.eval_loss) == (110, 120, 80, 3.7)
    assert life.failures == {
        ("initiator", "data timeout: exchange timed out"): 3,
        ("responder", "data failed: IncompleteReadError"): 2,
        ("initiator", "handshake failed: P2PDaemonError"): 1,
    }


def test_failed_exchanges_by_cause_and_those_of_lives_without_a_summary(tmp_path: Path) -> None:
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    summary = {"steps": 120, "eval_loss": 3.7, "exchanges_failed_by_cause": _failures()}
    lives = [
        _read(_life_files(tmp_path, [_record(40), _record(60, ok=1, failed=2, rejected=1)]), "lone"),
        _read(_life_files(stopped, [_record(40), _record(110, ok=5, failed=4)], summary)),
    ]
    finals = [FinalState(1, 120, 120 * BATCH, 120 * BATCH)]
    codes = {"trainer-1": 0, "bootstrap": 0}
    report = soak_report.summarize(RunResult("churn", 60.0, lives, finals, exit_codes=codes), BATCH, 1)
    assert report["failures"] == [
        {"cause": "data timeout: exchange timed out", "initiator": 3, "responder": 0},
        {"cause": "data failed: IncompleteReadError", "initiator": 0, "responder": 2},
        {"cause": "handshake failed: P2PDaemonError", "initiator": 1, "responder": 0},
    ]
    assert report["failures_without_cause"] == {"lives": 1, "exchanges": 3}
    assert report["final_eval_loss"] == pytest.approx(3.7)
    rendered = soak_report.render(report, None)
    assert "| data failed: IncompleteReadError | 0 | 2 |" in rendered
    assert "| failed exchanges (both roles) | 9 |" in rendered
    assert "not in the table: 1, with 3 failed exchanges (both roles, cause unknown)" in rendered


def _churned() -> tuple[list[Life], list[FinalState]]:
    stopped = Counter[tuple[str, str]]()
    lives = [
        Life(1, resumed_step=0, last_step=50, killed="session"),  # checkpointed at 40, trained to 50
        Life(1, resumed_step=40, last_step=90, final_step=100, failures=stopped, eval_loss=3.6),
        Life(2, resumed_step=0, last_step=None, killed="lone"),  # killed before its first history line
        Life(2, resumed_step=0, last_step=110, final_step=120, failures=stopped, eval_loss=3.8),
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
    return RunResult("churn", 120.0, lives, finals, exit_codes=codes, **changes)


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
