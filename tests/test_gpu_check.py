"""scripts/gpu_check.sh: its CPU dry run passes end to end, and its verdict fails on each condition.

The real check needs a CUDA GPU (docs/hosting.md, "Checking the GPU path"); the dry run runs the same
steps at tiny sizes on the CPU, so that the script cannot rot between the rare runs on a GPU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from scripts import gpu_check_report
from tests._processes import PeerProcess, describe, heavy_scenario, kill_all, outliving

STEPS = ("the CUDA tests", "llama-1b host layout", "llama-1b device layout", "gpt-bf16", "gpt-fp16")
"""What the report names a line after, one per step of the check."""


@pytest.mark.multipeer
@heavy_scenario
def test_the_dry_run_runs_every_step_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    argv = ["bash", "scripts/gpu_check.sh", "--dry-run", str(out)]
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}  # this worker's own
    check = PeerProcess(argv, env={"PYTHON": sys.executable})
    try:
        status = check.wait(timeout=300)
    finally:
        # the peers of `swarm local` lead sessions of their own; orphans re-parent to pytest (a subreaper)
        left = outliving(lambda: _ours_beside(check.proc.pid, before), 30)
        described = [describe(p) for p in left]
        kill_all(left)
    assert not described, f"the dry run left processes behind: {described}"
    output = check.output()
    assert status == 0, output
    for step in STEPS:
        assert f"] {step}" in output, (step, output)
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"]
    statuses = {c["condition"]: c["status"] for c in report["conditions"]}
    assert statuses["gpt-bf16: every peer committed an exchange"] == "pass", statuses
    assert statuses["every step exited 0"] == "pass", statuses
    # what only CUDA can show is not claimed on the CPU
    assert statuses["llama-1b host layout: 8-bit AdamW"] == "n/a", statuses
    assert statuses["llama-1b device layout: peak within 0.8-1.15 of the estimate"] == "n/a", statuses


def _ours_beside(pid: int, before: set[int]) -> list[psutil.Process]:
    """Live processes below this one that the check started: not ``pid`` itself (reaped by now), nor
    what this worker ran before it (torch's shared-memory manager among them: killing it would break
    every shared tensor the worker still holds)."""
    children = psutil.Process(os.getpid()).children(recursive=True)
    return [p for p in children if p.pid != pid and p.pid not in before and _alive(p)]


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ------------------------------------------------------------------ the verdict, on crafted results
GIB = 1 << 30


def _step(name: str, **changes: Any) -> dict[str, Any]:
    """What scripts/_gpu_steps.py writes for a llama step that held every condition on a GPU."""
    step = {
        "step": f"llama-1b {name} layout",
        "cuda": True,
        "cap_bytes": 12 * GIB if name == "host" else None,
        "optimizer": "adamw8bit",
        "exchange": {"committed": True},
        "tokens_per_second": 1000.0,
        "mfu": 0.4,
        "peak_allocated_bytes": 9 * GIB,
        "peak_reserved_bytes": 10 * GIB,
        "estimated_device_bytes": 10 * GIB,
        "peak_over_estimate": 0.9,
        "footprint_bytes": 11 * GIB,
        "host_rss_bytes": 8 * GIB,
        "pinned_bytes": 0,
    }
    return {**step, **changes}


def _swarm(exchanges: tuple[int, int] = (2, 3), optimizer: str = "adamw8bit") -> dict[str, Any]:
    return {"per_peer": [{"exchanges_ok": n, "optimizer": optimizer} for n in exchanges]}


PASSING_TESTS_LOG = "16 passed, 180 deselected in 40.00s\n"


def _verdict(tmp_path: Path, *, files: dict[str, Any], tests_log: str = PASSING_TESTS_LOG, **rcs: int) -> int:
    work = tmp_path / "work"
    work.mkdir(parents=True)
    (work / "tests.log").write_text(tests_log)
    for name, content in files.items():
        if content is not None:
            (work / f"{name}.json").write_text(json.dumps(content))
    argv = ["--work", str(work), "--out", str(tmp_path / "out.json")]
    for key in ("tests", "memory", "swarm"):
        argv += [f"--{key}-rc", str(rcs.get(key, 0))]
    return gpu_check_report.main(argv)


GOOD = {
    "llama-host": _step("host"),
    "llama-device": _step("device"),
    "gpt-bf16": _swarm(),
    "gpt-fp16": _swarm(),
}


def test_the_verdict_passes_when_every_condition_holds(tmp_path: Path, capsys) -> None:
    assert _verdict(tmp_path, files=GOOD) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "n/a" not in out, out  # on a GPU every condition applies


@pytest.mark.parametrize(
    ("what", "changes", "failing"),
    [
        ("no exchange", {"gpt-fp16": _swarm((0, 4))}, "gpt-fp16: every peer committed an exchange"),
        ("a lone peer", {"gpt-bf16": {"per_peer": _swarm()["per_peer"][:1]}}, "gpt-bf16: every peer"),
        ("no swarm run", {"gpt-fp16": None}, "gpt-fp16: every peer committed an exchange"),
        ("torch's AdamW", {"gpt-bf16": _swarm(optimizer="adamw")}, "gpt-bf16: 8-bit AdamW"),
        ("torch's AdamW", {"llama-device": _step("device", optimizer="adamw")}, "device layout: 8-bit AdamW"),
        ("peak high", {"llama-host": _step("host", peak_over_estimate=1.2)}, "host layout: peak within"),
        ("peak low", {"llama-device": _step("device", peak_over_estimate=0.7)}, "device layout: peak within"),
        ("over the card", {"llama-host": _step("host", footprint_bytes=13 * GIB)}, "the 12 GiB cap"),
        ("no round", {"llama-host": _step("host", exchange={"committed": False})}, "the round committed"),
        ("step missing", {"llama-device": None}, "llama-device: ran"),
    ],
)
def test_the_verdict_fails_when_a_condition_does_not_hold(
    tmp_path: Path, capsys, what: str, changes: dict[str, Any], failing: str
) -> None:
    assert _verdict(tmp_path, files={**GOOD, **changes}) == 1, what
    failed = [line for line in capsys.readouterr().out.splitlines() if "[FAIL]" in line]
    assert len(failed) == 1 and failing in failed[0], failed


def test_the_verdict_fails_on_a_skipped_cuda_test_or_a_failed_step(tmp_path: Path, capsys) -> None:
    skipped = "15 passed, 1 skipped, 180 deselected in 40.00s\n"
    assert _verdict(tmp_path / "a", files=GOOD, tests_log=skipped) == 1
    assert "[FAIL] every CUDA test passed, none skipped" in capsys.readouterr().out
    assert _verdict(tmp_path / "b", files=GOOD, memory=124) == 1
    assert "[FAIL] every step exited 0" in capsys.readouterr().out
