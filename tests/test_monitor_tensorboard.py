"""The TensorBoard sink without a swarm: feed it snapshots, read the event files back."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from peers._monitor_tensorboard import SCALARS, TensorBoardSink
from swarm.config import RunConfig
from tests.test_monitor_http import snapshots


def read_back(log_dir) -> EventAccumulator:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def test_scalars_read_back_equal_the_snapshots_numbers(tmp_path) -> None:
    snaps = snapshots(4)
    sink = TensorBoardSink(tmp_path / "tb")
    for snapshot in snaps:
        sink.update(snapshot)
    sink.close()
    events = read_back(tmp_path / "tb")
    written = set(events.Tags()["scalars"])
    assert {"swarm/eval_loss", "swarm/train_loss", "swarm/samples_per_s", "swarm/peers"} <= written
    for tag, field in SCALARS:
        expected = [(s, getattr(s.totals, field, None)) for s in snaps]
        expected = [(s, v) for s, v in expected if v is not None]
        if not expected:
            assert tag not in written  # unknown totals (null in the JSON) are left out
            continue
        points = events.Scalars(tag)
        assert [p.step for p in points] == [int(s.time) for s, _ in expected], tag
        assert [p.wall_time for p in points] == pytest.approx([s.time for s, _ in expected]), tag
        assert [p.value for p in points] == pytest.approx([float(v) for _, v in expected], rel=1e-6), tag
    assert events.Scalars("swarm/eval_loss")[-1].value == pytest.approx(snaps[-1].totals.eval_loss_mean)
    assert events.Scalars("swarm/upload_bytes_per_s")[-1].value == pytest.approx(snaps[-1].totals.upload_bps)


def test_unknown_values_and_repeated_seconds_write_nothing(tmp_path) -> None:
    first, second = snapshots(2)
    blank = replace(second.totals, eval_loss_mean=None, loss_mean=None)
    sink = TensorBoardSink(tmp_path)
    sink.update(replace(second, totals=blank))
    sink.update(replace(second, time=second.time + 0.5))  # the same second again: skipped
    sink.update(first)  # older: skipped
    sink.close()
    events = read_back(tmp_path)
    assert "swarm/eval_loss" not in events.Tags()["scalars"]
    assert [p.step for p in events.Scalars("swarm/peers")] == [int(second.time)]


def test_tensorboard_dir_is_a_monitor_key() -> None:
    assert RunConfig().monitor.tensorboard_dir is None
    assert RunConfig(monitor={"tensorboard_dir": "runs/tb"}).monitor.tensorboard_dir == "runs/tb"
