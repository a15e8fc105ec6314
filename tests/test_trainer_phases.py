"""swarm/trainer/_phases.py: the training loop's own split of its wall time, and a lone peer's report."""

from __future__ import annotations

import threading

import pytest

from swarm.config import load_config
from swarm.gossip import FAILURES
from swarm.network import NetworkOptions
from swarm.trainer import PHASES, PhaseTimers, TrainingPeer
from tests.workers.tiny import TINY


class _Clock:
    """A clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_nested_phases_book_each_second_once() -> None:
    clock = _Clock()
    timers = PhaseTimers(clock)
    with timers.loop():
        clock.now += 1.0  # in the loop, in no phase: other
        with timers.phase("sync"):
            clock.now += 2.0
            with timers.phase("evaluate"):
                clock.now += 3.0
            clock.now += 0.5
    summary = timers.summary()
    assert (summary["loop"], summary["sync"], summary["evaluate"]) == (6.5, 2.5, 3.0)
    assert summary["other"] == pytest.approx(1.0)
    assert sum(summary[p] for p in PHASES) + summary["other"] == pytest.approx(summary["loop"])


def test_only_the_loops_thread_books_and_only_inside_the_loop() -> None:
    clock = _Clock()
    timers = PhaseTimers(clock)
    with timers.phase("dht"):  # before the loop: not the loop's time
        clock.now += 4.0

    def elsewhere() -> None:
        with timers.phase("apply"):
            clock.now += 2.0

    with timers.loop():
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        with timers.phase("dht"):
            clock.now += 1.0
    assert (timers.totals["dht"], timers.totals["apply"], timers.loop_seconds) == (1.0, 0.0, 3.0)


def test_moved_device_time_is_capped_by_what_the_step_took_and_unknown_phases_are_refused() -> None:
    clock = _Clock()
    timers = PhaseTimers(clock)
    with timers.loop(), timers.phase("step_other"):
        clock.now += 1.0
    timers.move(0.75, "step_other", "device")
    assert (timers.totals["device"], timers.totals["step_other"]) == (0.75, 0.25)
    timers.move(5.0, "step_other", "device")  # a step reporting more device time than it took
    assert (timers.totals["device"], timers.totals["step_other"]) == (1.0, 0.0)
    with pytest.raises(ValueError, match="unknown phase 'sleep'"), timers.phase("sleep"):
        pass


def test_a_stop_records_where_it_found_the_loop_and_how_long_the_way_out_took() -> None:
    clock = _Clock()
    timers = PhaseTimers(clock)
    assert timers.current() is None and timers.stop.summary() is None  # no stop: nothing to say
    with timers.loop():
        assert timers.current() == "loop"
        with timers.phase("step_other"):
            clock.now += 1.0
            timers.stop.seen(7, 2, timers.current())
            clock.now += 0.5
            timers.stop.seen(8, 2, "sync")  # only the first sighting counts
        clock.now += 0.25
    with timers.stop.part("checkpoint"):
        clock.now += 2.0
    assert timers.stop.summary() == {
        "at_step": 7,
        "at_round": 2,
        "in_phase": "step_other",
        "loop_s": 0.75,
        "checkpoint_s": 2.0,
    }


def test_a_lone_peers_summary_splits_its_loop_by_phase() -> None:
    """Emulated 50 ms steps: the device share is the emulated time, the rest is booked elsewhere."""
    config = load_config(
        None,
        overrides=[
            *TINY,
            "train.max_steps=12",
            "averaging.backend=none",
            "averaging.sync_every_steps=4",
            "emulation.step_time_s=0.05",
        ],
        env={},
    )
    peer = TrainingPeer(config, NetworkOptions())
    try:
        peer.run(threading.Event())
        summary = peer.summary()
        split = summary["phase_seconds"]
        assert summary["stop"] is None  # it ended at max_steps
        # the process's failed exchanges by role and cause, which scripts/soak.py reads
        assert summary["exchanges_failed_by_cause"] == FAILURES.snapshot()
    finally:
        peer.close()
    assert split["device"] == pytest.approx(peer.progress.device_seconds, rel=1e-6)
    assert split["device"] >= 12 * 0.05 - 1e-9
    assert split["evaluate"] > 0  # rounds every 4 steps, each evaluated
    parts = sum(split[p] for p in PHASES)
    assert parts <= split["loop"] + 1e-9 and split["other"] == pytest.approx(split["loop"] - parts)
