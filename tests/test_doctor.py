"""`swarm doctor`, offline: versions, each device's estimate and micro-batch, free disk, the dial-back
said to be unchecked without initial peers, problems numbered with their advice, and bad input."""

from __future__ import annotations

import re
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from peers import doctor as doctor_module
from peers.cli import app

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "local-tiny.yaml")
HUGE = ["--set", "model.n_layer=64", "--set", "model.n_embd=8192", "--set", "model.n_head=64"]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SWARM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _doctor(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["doctor", *args])
    return result.exit_code, result.output


def test_offline_it_reports_versions_devices_disk_and_no_dial_back(_home) -> None:
    code, output = _doctor("--config", TINY)
    assert code == 0, output
    versions = next(line for line in output.splitlines() if line.startswith("versions:"))
    for package in ("python 3.", "torch ", "hivemind ", "bitsandbytes ", "swarm "):
        assert package in versions
    cpu = next(line for line in output.splitlines() if line.startswith("device cpu"))
    assert re.search(r": fits; micro-batch 16 \(the whole batch.*needs [\d.]+ [KMG]iB", cpu), cpu
    assert f"disk: checkpoints in {_home}/runs/local-tiny/peer/checkpoints:" in output
    assert "disk: state spool in" in output
    assert "reachability: not checked (no --initial-peers)" in output
    assert output.rstrip().splitlines()[-1].startswith("OK: no problems found")


def test_a_peer_that_does_not_fit_is_a_numbered_problem_with_numbered_advice() -> None:
    code, output = _doctor("--config", TINY, *HUGE)
    assert code == 1, output
    assert re.search(r"^device cpu .*: does NOT fit; micro-batch 16", output, re.M)
    problems = output[output.index("problem(s):") :]
    assert re.search(r"^1\. one peer of this run does not fit cpu\n   1\) ", problems, re.M), problems
    assert "pipeline stages" in problems


def test_too_little_free_disk_is_a_problem(monkeypatch) -> None:
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 1 << 20))
    code, output = _doctor("--config", TINY)
    assert code == 1
    assert re.search(r"^\d\. not enough free disk for the checkpoints in .*\n   1\) ", output, re.M), output
    assert "SWARM_HOME" in output


def test_checkpoints_turned_off_is_a_problem() -> None:
    code, output = _doctor("--config", TINY, "--set", "train.checkpoint_dir=null")
    assert code == 1
    assert "train.checkpoint_dir is null" in output and "disk: no checkpoints kept" in output


def test_an_unmet_pin_is_a_problem(monkeypatch) -> None:
    real = doctor_module._version
    monkeypatch.setattr(doctor_module, "_version", lambda name: "1.0.0" if name == "hivemind" else real(name))
    code, output = _doctor("--config", TINY)
    assert code == 1
    assert "hivemind 1.0.0: this swarm needs hivemind==1.1.12" in output


def test_a_bad_config_exits_2_naming_the_key(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  learning_rate: 1\n")
    code, output = _doctor("--config", str(config))
    assert code == 2
    assert "train.learning_rate: unknown key (did you mean 'lr'?)" in output


def test_a_host_port_initial_peer_exits_2_with_the_multiaddr_form() -> None:
    code, output = _doctor("--config", TINY, "--initial-peers", "203.0.113.7:31337")
    assert code == 2 and "/ip4/203.0.113.7/tcp/31337/p2p/<peer id>" in output


@pytest.mark.multipeer
def test_with_an_initial_peer_it_asks_to_be_dialled_back() -> None:
    from swarm import NetworkOptions, NodeInfo, SwarmNode

    info = NodeInfo(run_id="local-tiny", config_hash="0" * 16, role="bootstrap")
    with SwarmNode(NetworkOptions(), info) as bootstrap:
        (address, *_) = bootstrap.visible_maddrs()
        code, output = _doctor("--config", TINY, "--initial-peers", address)
    assert code == 0, output
    assert "doctor: reachability direct (dialled back by 1 peer(s)" in output


def test_a_cuda_device_takes_the_largest_micro_batch_that_fits() -> None:
    """The CUDA branch without a GPU: the device's free memory is given, as torch would report it."""
    from swarm.config import load_config

    config = load_config(REPO / "configs" / "gpt-125m.yaml", env={})
    report = doctor_module.Report()
    gib = 1 << 30
    for free in (80 * gib, 6 * gib, 1 * gib):
        doctor_module._check_device(report, config, "cuda:0", (free, 80 * gib, "Fake GPU"), 64 * gib)
    roomy, tight, tiny = report.lines
    batch = config.train.batch_size
    assert f": fits; micro-batch {batch} (the largest that fits" in roomy
    micro = int(re.search(r"micro-batch (\d+)", tight).group(1))
    assert 1 <= micro < batch and ": fits;" in tight
    assert ": does NOT fit; micro-batch 1" in tiny
    assert [problem.what for problem in report.problems] == ["one peer of this run does not fit cuda:0"]
