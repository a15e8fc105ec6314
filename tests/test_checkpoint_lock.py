"""One live peer per checkpoint directory: the lock file, its release on any exit, stale locks, and
where ``train.checkpoint_dir: auto`` puts checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.config import load_config
from swarm.config._sources import swarm_home
from swarm.state.checkpoint import LOCK_FILE, DirectoryLock, DirectoryLockedError
from swarm.trainer._checkpoints import checkpoint_dir_of, claim_checkpoint_dir, directory_name

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local-tiny.yaml"
HOLD = """
import sys
from swarm.state.checkpoint import DirectoryLock
lock = DirectoryLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.read()  # hold it until killed (or stdin closes)
"""


def test_a_second_holder_in_the_same_process_is_refused_until_release(tmp_path: Path) -> None:
    first = DirectoryLock(tmp_path / "ckpt")
    first.acquire()
    assert (tmp_path / "ckpt" / LOCK_FILE).is_file()
    second = DirectoryLock(tmp_path / "ckpt")
    with pytest.raises(DirectoryLockedError, match=f"pid {os.getpid()} on "):
        second.acquire()
    assert not second.held
    first.release()
    with second:
        assert second.held and second.stale_holder is None  # released cleanly: not stale
    assert (tmp_path / "ckpt" / LOCK_FILE).read_text() == ""


def test_a_killed_holder_releases_and_its_stale_lock_is_taken_over(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with pytest.raises(DirectoryLockedError) as refused:
            DirectoryLock(directory).acquire()
        assert f"pid {holder.pid} on " in str(refused.value) and str(directory) in str(refused.value)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.close()
        holder.stdout.close()
    with DirectoryLock(directory) as taken:
        assert taken.stale_holder is not None and f"pid {holder.pid} " in taken.stale_holder


def test_a_hostile_lock_file_is_shown_printable_and_short(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).write_bytes(b"\x1b[31mevil\x00" + b"x" * 10_000)
    holder = DirectoryLock(tmp_path)
    with holder, pytest.raises(DirectoryLockedError) as refused:
        DirectoryLock(tmp_path).acquire()
    assert holder.stale_holder is not None and "\x1b" not in holder.stale_holder
    assert len(holder.stale_holder) <= 256
    assert "\x1b" not in str(refused.value)


def test_auto_is_a_directory_of_the_run_and_peer_under_swarm_home(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWARM_HOME", str(tmp_path / "home"))
    config = load_config(None, overrides=["run.run_id=demo"], env={})
    assert config.train.checkpoint_dir == "auto"
    assert checkpoint_dir_of(config, "alice") == tmp_path / "home" / "runs" / "demo" / "alice" / "checkpoints"
    assert checkpoint_dir_of(config) == tmp_path / "home" / "runs" / "demo" / "peer" / "checkpoints"
    assert directory_name("../../etc") == "_.._etc" and directory_name("..") == "peer"
    assert checkpoint_dir_of(load_config(None, overrides=["train.checkpoint_dir=null"], env={})) is None
    monkeypatch.delenv("SWARM_HOME")
    assert swarm_home() == Path.home() / ".swarm"


def test_claiming_auto_skips_held_directories_but_an_explicit_one_is_refused(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SWARM_HOME", str(tmp_path))
    auto = load_config(None, overrides=["run.run_id=demo"], env={})
    first, first_lock = claim_checkpoint_dir(auto, "bob")
    second, second_lock = claim_checkpoint_dir(auto, "bob")
    assert first_lock is not None and second_lock is not None
    assert first.train.checkpoint_dir == str(tmp_path / "runs" / "demo" / "bob" / "checkpoints")
    assert second.train.checkpoint_dir == str(tmp_path / "runs" / "demo" / "bob-2" / "checkpoints")
    assert first.config_hash() == auto.config_hash() and auto.train.checkpoint_dir == "auto"
    explicit = load_config(None, overrides=[f"train.checkpoint_dir={first.train.checkpoint_dir}"], env={})
    with pytest.raises(DirectoryLockedError, match=f"pid {os.getpid()} "):
        claim_checkpoint_dir(explicit, "bob")
    first_lock.release()
    again, again_lock = claim_checkpoint_dir(explicit, "bob")
    assert again.train.checkpoint_dir == first.train.checkpoint_dir and again_lock is not None
    again_lock.release()
    second_lock.release()
    assert claim_checkpoint_dir(load_config(None, overrides=["train.checkpoint_dir=null"], env={})) == (
        load_config(None, overrides=["train.checkpoint_dir=null"], env={}),
        None,
    )


def test_swarm_join_refuses_a_directory_a_live_peer_holds(tmp_path: Path) -> None:
    """The lock is taken before anything starts: the second peer exits 2 naming the holder's pid."""
    from typer.testing import CliRunner

    from peers.cli import app

    directory = tmp_path / "shared"
    maddr = "/ip4/127.0.0.1/tcp/9/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    args = [
        "join",
        "--initial-peers",
        maddr,
        "--config",
        str(CONFIG),
        "--set",
        f"train.checkpoint_dir={directory}",
    ]
    with DirectoryLock(directory):
        result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert (
        f"checkpoint directory {directory} is in use by another peer (pid {os.getpid()} on " in result.output
    )
