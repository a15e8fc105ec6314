"""Checkpoints: round trip, retention, and that damaged or foreign files are never loaded."""

from __future__ import annotations

import hashlib
import io
import logging
import struct
from pathlib import Path

import pytest
import torch

from swarm.config import ModelSection, TrainSection
from swarm.learning import InnerTrainer, OuterOptimizer, build_model
from swarm.state import (
    CheckpointError,
    list_checkpoints,
    load_latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from swarm.state.checkpoint import HEADER_SIZE, MAGIC

HASH = "0123456789abcdef"


def training_state(step: int) -> dict:
    model = build_model(ModelSection(n_layer=1, n_embd=16, n_head=2, block_size=8), seed=step)
    trainer = InnerTrainer(model, TrainSection(batch_size=2), torch.device("cpu"))
    x = torch.randint(256, (2, 8))
    trainer.step(iter([(x, x)]))
    outer = OuterOptimizer(model, lr=0.7, momentum=0.9)
    outer.apply(outer.pseudo_gradient())
    return {
        "model": model.state_dict(),
        "inner_optimizer": trainer.optimizer.state_dict(),
        "outer_optimizer": outer.state_dict(),
        "progress": {"step": step, "round": 1, "samples": 2 * step},
        "config_hash": HASH,
    }


def test_round_trip_of_a_full_training_state(tmp_path: Path) -> None:
    state = training_state(5)
    path = save_checkpoint(tmp_path, state, step=5)
    assert path.name == "ckpt-000000000005.pt"
    loaded, loaded_path = load_latest_checkpoint(tmp_path, config_hash=HASH)
    assert loaded_path == path
    assert loaded["progress"] == state["progress"]
    for name, tensor in state["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    model = build_model(ModelSection(n_layer=1, n_embd=16, n_head=2, block_size=8), seed=0)
    model.load_state_dict(loaded["model"])
    OuterOptimizer(model, lr=1.0, momentum=0.0).load_state_dict(loaded["outer_optimizer"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(tmp_path, {"step": step}, step=step, keep=3)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5, 4, 3]
    assert load_latest_checkpoint(tmp_path)[0] == {"step": 5}


def test_missing_or_empty_directory_has_no_checkpoint(tmp_path: Path) -> None:
    assert load_latest_checkpoint(tmp_path) is None
    assert load_latest_checkpoint(tmp_path / "nope") is None


def damage_truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def damage_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + len(data[HEADER_SIZE:]) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def damage_magic(path: Path) -> None:
    path.write_bytes(b"NOTSWARM" + path.read_bytes()[8:])


def damage_header(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:20])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (damage_truncate, "truncated"),
        (damage_flip, "checksum mismatch"),
        (damage_magic, "bad magic"),
        (damage_header, "shorter than"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, reason: str
) -> None:
    save_checkpoint(tmp_path, {"step": 1}, step=1)
    newest = save_checkpoint(tmp_path, {"step": 2}, step=2)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="swarm.state.checkpoint"):
        state, path = load_latest_checkpoint(tmp_path)
    assert state == {"step": 1} and path.name == "ckpt-000000000001.pt"
    assert newest.name in caplog.text and reason in caplog.text


def test_all_kinds_of_damage_at_once_fall_back_to_the_last_good_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_checkpoint(tmp_path, {"step": 1}, step=1, keep=10)
    for step, damage in ((2, damage_truncate), (3, damage_flip), (4, damage_magic)):
        damage(save_checkpoint(tmp_path, {"step": step}, step=step, keep=10))
    # A whole, valid file that was never renamed into place must not count as a checkpoint.
    good = save_checkpoint(tmp_path / "elsewhere", {"step": 9}, step=9)
    (tmp_path / ".ckpt-000000000009.pt.123.tmp").write_bytes(good.read_bytes())
    with caplog.at_level(logging.WARNING):
        state, _ = load_latest_checkpoint(tmp_path)
    assert state == {"step": 1}
    assert caplog.text.count("skipping checkpoint") == 3


def test_another_config_hash_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"config_hash": "ffffffffffffffff"}, step=1)
    with pytest.raises(CheckpointError, match="config hash 'ffffffffffffffff'"):
        load_latest_checkpoint(tmp_path, config_hash=HASH)


class Exploit:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/swarm-checkpoint-pwned"),))


def write_raw(path: Path, payload: bytes, version: int = 1) -> None:
    header = struct.pack("<8sIQ32s", MAGIC, version, len(payload), hashlib.sha256(payload).digest())
    path.write_bytes(header + payload)


def test_a_well_formed_file_with_a_pickled_object_is_not_unpickled(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"evil": Exploit()}, buffer)
    path = tmp_path / "ckpt-000000000001.pt"
    write_raw(path, buffer.getvalue())
    with pytest.raises(CheckpointError, match="does not load"):
        read_checkpoint(path)
    assert not Path("/tmp/swarm-checkpoint-pwned").exists()


def test_other_format_versions_and_non_dicts_are_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    torch.save([1, 2], buffer)
    path = tmp_path / "ckpt-000000000001.pt"
    write_raw(path, buffer.getvalue(), version=99)
    with pytest.raises(CheckpointError, match="format version 99"):
        read_checkpoint(path)
    write_raw(path, buffer.getvalue())
    with pytest.raises(CheckpointError, match="not a dict"):
        read_checkpoint(path)
