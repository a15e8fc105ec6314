"""Public runs: the published run config, `swarm config pull`, refusal at join, `scripts/join.sh`."""

from __future__ import annotations

import re
import time

import pytest
from typer.testing import CliRunner

from peers.cli import app
from swarm._protocol import PROTOCOL_VERSION
from swarm.config import load_config
from swarm.membership import Member, PeerRecord
from swarm.membership._compat import compatibility_problems
from swarm.membership._run_config import (
    PublishedConfig,
    choose_published,
    parse_config_text,
    shareable_config,
)
from swarm.network import peer_id_of_identity, write_new_key
from tests._processes import REPO, heavy_scenario, join_address, swarm_cli, terminate_and_wait
from tests.workers.tiny import UNLIMITED, cli_sets, tiny

PEER_ID = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
# The bootstrap's run: the demo config with the tests' tiny model, stopped after a few steps so that a
# joiner finishes fast.
RUN = ["--config", "configs/local-tiny.yaml", *cli_sets(tiny("train.max_steps=4"))]


def _member(config_hash: str, role: str = "trainer", protocol: int = PROTOCOL_VERSION, n: int = 0) -> Member:
    record = PeerRecord(
        peer_id=PEER_ID[:-1] + "ABCDEFGHJK"[n],
        protocol_version=protocol,
        package_version="0",
        config_hash=config_hash,
        role=role,
    )
    return Member(peer_id=record.peer_id, record=record, expires_at=time.time() + 60)


def test_published_yaml_drops_private_keys_and_keeps_the_hash() -> None:
    config = load_config(
        "configs/local-tiny.yaml",
        overrides=["network.identity_path=/home/org/.swarm/boot.key", "train.checkpoint_dir=/srv/ckpt"],
        env={},
    )
    text = shareable_config(config).to_yaml()
    assert "/home/org" not in text and "/srv/ckpt" not in text
    assert parse_config_text(text).config_hash() == config.config_hash()


def test_compatible_config_has_no_problems() -> None:
    config = load_config("configs/local-tiny.yaml", env={})
    members = [_member(config.config_hash())]
    assert compatibility_problems(config, shareable_config(config).to_yaml(), members) == []
    assert compatibility_problems(config, None, []) == []


def test_differing_config_lists_every_differing_key_with_both_values() -> None:
    swarm = load_config("configs/local-tiny.yaml", env={})
    local = load_config("configs/local-tiny.yaml", overrides=["model.n_layer=3", "train.lr=0.01"], env={})
    problems = compatibility_problems(local, swarm.to_yaml(), [])
    text = "\n".join(problems)
    assert "model.n_layer: yours 3, the swarm's 2" in text
    assert "train.lr: yours 0.01, the swarm's 0.001" in text
    assert "swarm config pull" in text


def test_without_a_published_config_the_trainers_hashes_decide() -> None:
    local = load_config("configs/local-tiny.yaml", env={})
    problems = compatibility_problems(local, None, [_member("0123456789abcdef")])
    assert len(problems) == 1 and "0123456789abcdef" in problems[0]
    # a bootstrap or monitor with another hash is no reason to refuse
    assert compatibility_problems(local, None, [_member("0123456789abcdef", role="bootstrap")]) == []


def test_protocol_mismatch_is_a_problem() -> None:
    local = load_config("configs/local-tiny.yaml", env={})
    problems = compatibility_problems(
        local, None, [_member(local.config_hash(), protocol=PROTOCOL_VERSION + 1)]
    )
    assert len(problems) == 1 and f"protocol version {PROTOCOL_VERSION}" in problems[0]


def test_only_a_trusted_publisher_is_chosen_whatever_the_votes() -> None:
    a = load_config("configs/local-tiny.yaml", env={})
    b = load_config("configs/local-tiny.yaml", overrides=["train.lr=0.01"], env={})
    trusted = PublishedConfig(a.to_yaml(), a.config_hash(), "trusted", 1.0, a)
    stranger = PublishedConfig(b.to_yaml(), b.config_hash(), "stranger", 2.0, b)
    assert choose_published([stranger, trusted], ["trusted"]) is trusted
    assert choose_published([stranger, trusted], ["other", "stranger", "trusted"]) is stranger  # in order
    assert choose_published([stranger], ["trusted"]) is None
    assert choose_published([], ["trusted"]) is None


def _start_bootstrap(spawn, *extra: str) -> tuple[object, str, str]:
    boot = spawn(swarm_cli("bootstrap", *RUN, *extra))
    maddr = join_address(boot)
    hash_line = boot.wait_for_line(lambda line: "config hash" in line, timeout=10)
    return boot, maddr, hash_line.rsplit("config hash ", 1)[1].rstrip(")")


def test_pull_refuses_a_key_file_that_is_not_private_before_dialling(tmp_path) -> None:
    loose = tmp_path / "loose.key"
    write_new_key(loose)
    loose.chmod(0o644)
    target = tmp_path / "run.yaml"
    args = ["config", "pull", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}", "-o", str(target)]
    result = CliRunner().invoke(app, [*args, "--swarm-key-file", str(loose)])
    assert result.exit_code == 2, result.output
    assert str(loose) in result.output and not target.exists()


@pytest.mark.multipeer
def test_pull_from_a_private_swarm_takes_its_key_from_a_file_or_the_environment(spawn, tmp_path) -> None:
    key_file = tmp_path / "swarm.key"
    write_new_key(key_file)
    boot, maddr, swarm_hash = _start_bootstrap(spawn, "--set", f"network.swarm_key_file={key_file}")
    pull_args = ["config", "pull", "--initial-peers", maddr, "-o"]

    by_file = tmp_path / "by-file.yaml"
    pull = spawn(swarm_cli(*pull_args, str(by_file), "--swarm-key-file", str(key_file)))
    by_env = tmp_path / "by-env.yaml"
    pull_env = spawn(swarm_cli(*pull_args, str(by_env)), env={"SWARM_KEY": key_file.read_text().strip()})
    assert pull.wait(timeout=90) == 0, pull.output()
    assert pull_env.wait(timeout=90) == 0, pull_env.output()
    assert load_config(by_file, env={}).config_hash() == swarm_hash
    assert by_env.read_text() == by_file.read_text()
    assert terminate_and_wait(boot, timeout=15) == 0


@pytest.mark.multipeer
def test_pull_returns_the_swarms_config_and_a_differing_joiner_is_refused(spawn, tmp_path) -> None:
    boot, maddr, swarm_hash = _start_bootstrap(spawn)
    boot.wait_for_line(lambda line: line.startswith("fetch the run config with: swarm config pull"), 10)

    target = tmp_path / "run.yaml"
    pull = spawn(swarm_cli("config", "pull", "--initial-peers", maddr, "-o", str(target)))
    assert pull.wait(timeout=90) == 0, pull.output()
    assert swarm_hash in pull.output()
    assert load_config(target, env={}).config_hash() == swarm_hash
    # the bootstrap publishes its own run only: any other run id has no config
    missing = tmp_path / "missing.yaml"
    nope = spawn(
        swarm_cli("config", "pull", "--initial-peers", maddr, "-o", str(missing), "--run-id", "nope")
    )
    assert nope.wait(timeout=90) == 2, nope.output()
    assert "no valid config is published for run 'nope'" in nope.output() and not missing.exists()

    joiner = spawn(swarm_cli("join", "--initial-peers", maddr, *RUN, "--set", "model.n_layer=3"))
    assert joiner.wait(timeout=90) == 2, joiner.output()
    assert "model.n_layer: yours 3, the swarm's 1" in joiner.output()
    assert terminate_and_wait(boot, timeout=15) == 0


@heavy_scenario
@pytest.mark.multipeer
def test_join_script_trains_then_resumes_with_the_same_identity(spawn, tmp_path) -> None:
    boot, maddr, swarm_hash = _start_bootstrap(spawn)
    home = tmp_path / "swarm-home"
    env = {"SWARM_HOME": str(home)}

    first = spawn(["bash", str(REPO / "scripts" / "join.sh"), maddr, "--public-name", "volunteer"], env=env)
    assert first.wait(timeout=150) == 0, first.output()
    assert "[join] device: " in first.output()
    peer_id = peer_id_of_identity(home / "identity.key")
    assert f"peer {peer_id} joined run" in first.output()
    assert load_config(home / "run.yaml", env={}).config_hash() == swarm_hash
    assert list((home / "checkpoints").glob("ckpt-*.pt"))
    assert list((home / "logs").glob("join-*.log"))

    second = spawn(["bash", str(REPO / "scripts" / "join.sh"), maddr], env=env)
    assert second.wait(timeout=150) == 0, second.output()
    assert "[join] resuming" in second.output()
    assert f"peer {peer_id} joined run" in second.output() and "resumed from" in second.output()
    assert terminate_and_wait(boot, timeout=15) == 0


# Trainers of the state test: many steps (they are stopped by the test), a sync every 5 steps.
STATE_RUN = [
    "--config",
    "configs/local-tiny.yaml",
    *cli_sets(tiny(UNLIMITED, "averaging.sync_every_steps=5")),
]
_KEPT = re.compile(r"serving the state of round (\d+), step (\d+), samples (\d+) \(digest ([0-9a-f]{12})\)")
_TOOK = re.compile(
    r"took over the swarm's state from 1 donor\(s\): round (\d+), step (\d+), samples (\d+) "
    r"\(digest ([0-9a-f]{12})\)"
)


@pytest.mark.multipeer
def test_bootstrap_keeps_the_state_and_serves_it_once_every_trainer_left(spawn, tmp_path) -> None:
    state_dir = tmp_path / "kept"
    keep = ["--serve-state", "--state-dir", str(state_dir), "--state-interval", "1"]
    boot = spawn(swarm_cli("bootstrap", *STATE_RUN, *keep))
    maddr = join_address(boot)
    # the copy is the median of three distinct trainer states: the mirror never copies one or two
    paced = ["--set", "emulation.step_time_s=0.1"]  # a per-peer key: the trainers leave the cores to the rest
    trainers = [spawn(swarm_cli("join", "--initial-peers", maddr, *STATE_RUN, *paced)) for _ in range(3)]
    # the bootstrap's copy has caught up with some training (round 2 or later)
    boot.wait_for_line(lambda line: (m := _KEPT.search(line)) is not None and int(m.group(1)) >= 2, 180)
    for trainer in trainers:
        assert terminate_and_wait(trainer, timeout=20) == 0, trainer.output()[-2000:]
    assert list(state_dir.glob("ckpt-*.pt")), "the kept state was not saved"

    joiner = spawn(swarm_cli("join", "--initial-peers", maddr, *STATE_RUN))
    took = _TOOK.search(joiner.wait_for_line(lambda line: _TOOK.search(line) is not None, 120))
    kept = [m.groups() for m in map(_KEPT.search, boot.output().splitlines()) if m]
    # what the joiner took over is exactly the bootstrap's last copy (it trusts its initial peer), with
    # its progress (not round 0)
    assert took.groups() == kept[-1]
    assert int(took.group(2)) > 0 and int(took.group(3)) > 0
    for process in (joiner, boot):
        assert terminate_and_wait(process, timeout=20) == 0, process.output()[-2000:]
