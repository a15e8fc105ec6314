"""PeerCore with each thing a peer trains, built beforehand and handed to it: the whole model
(:class:`~swarm.trainer.WholeModel`) and one pipeline stage (:class:`~swarm.pipeline.OneStage`). The
core's loop runs either, ends it by the trainee's rule (the step limit; a stage server's data holders
gone), books every completed round in order (evaluated, reported, checkpointed) and stops cleanly."""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path

import pytest

from swarm.config import load_config
from swarm.learning import count_parameters
from swarm.network import NetworkOptions
from swarm.pipeline import OneStage, plan_stages
from swarm.state import list_checkpoints
from swarm.trainer import PeerCore, SyncReport, WholeModel
from tests._processes import wait_until
from tests.test_pipeline_swarm import _config as pipeline_config
from tests.test_pipeline_swarm import _Peer as StageThread
from tests.test_pipeline_swarm import stop_all
from tests.workers.tiny import tiny

WHOLE = tiny("averaging.backend=none", "averaging.sync_every_steps=3", "train.eval_every_rounds=1")


def test_the_whole_model_runs_to_its_step_limit_booking_each_round_then_a_stop_ends_it(
    tmp_path: Path,
) -> None:
    kept = tmp_path / "checkpoints"
    config = load_config(
        None, overrides=[*WHOLE, f"train.checkpoint_dir={kept}", "train.checkpoint_every_s=1e-6"], env={}
    )
    reports: list[SyncReport] = []
    peer = PeerCore(config, NetworkOptions(), WholeModel, on_sync=reports.append)
    try:
        assert peer._status()["state"] == "joining" and peer.resumed_from is None
        peer.run(threading.Event(), max_steps=7)
        assert (peer.progress.step, peer.progress.round) == (7, 2)
        assert [(r.round, r.step) for r in reports] == [(1, 3), (2, 6)]
        assert all(math.isfinite(r.eval_loss or math.nan) and r.tokens_per_s for r in reports)
        assert [step for step, _ in list_checkpoints(kept)] == [6, 3]  # one per booked round
        summary = peer.summary()
        assert summary["n_params"] == count_parameters(peer.trainee.module) > 0
        assert (summary["steps"], summary["rounds"], summary["stop"]) == (7, 2, None)
        assert peer._status()["state"] == "leaving"
        assert math.isfinite(peer.final_evaluation()["eval_loss"])
    finally:
        peer.close()

    stop = threading.Event()
    stopped = PeerCore(config, NetworkOptions(), WholeModel, on_sync=lambda report: stop.set())
    try:
        stopped.run(stop, max_steps=1000)  # the first round's report sets the stop
        assert (stopped.progress.step, stopped.progress.round) == (3, 1)
        assert [step for step, _ in list_checkpoints(kept)] == [6, 3], "a checkpoint after the stop"
    finally:
        stopped.close()


class _Running(StageThread):
    """A core holding ``stage``, joining and training in a background thread."""

    def __init__(self, network: NetworkOptions, stage: int, max_steps: int) -> None:
        config = pipeline_config(f"train.max_steps={max_steps}", "train.eval_every_rounds=1")
        build = functools.partial(OneStage, specs=plan_stages(config), stage=stage)
        self.reports: list[SyncReport] = []
        core = PeerCore(config, network, build, on_sync=self.reports.append)
        super().__init__(config, network, stage, core=core)


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_a_stage_holder_runs_to_its_step_limit_and_its_server_ends_once_the_holder_left() -> None:
    steps = 10  # a round due every 5 steps (the pipeline tests' config)
    peers: list[_Running] = []
    try:
        server = _Running(NetworkOptions(), stage=1, max_steps=steps)
        peers.append(server)
        holder = _Running(NetworkOptions(initial_peers=server.peer.node.visible_maddrs()), 0, steps)
        peers.append(holder)
        for running in peers:
            running.thread.start()
        # the holder ends at its step limit; the server, never stopped, when no data holder is left
        wait_until(lambda: not holder.thread.is_alive(), 200, f"the data holder's {steps} steps")
        wait_until(lambda: not server.thread.is_alive(), 120, "the server to end without its data holder")
        assert [holder.error, server.error] == [None, None]
        # every round booked once, in order (a lone holder's last round may not complete before it ends)
        booked = holder.peer.progress.round
        assert holder.peer.progress.step == steps and booked >= 1
        assert [r.round for r in holder.reports] == list(range(1, booked + 1))
        assert all(r.step >= 5 * r.round for r in holder.reports)  # booked after the step it was due at
        assert all(r.eval_loss is not None for r in holder.reports)  # evaluated through the pipeline
        assert server.peer.progress.step > 0
        for running, stage in ((holder, 0), (server, 1)):
            summary = running.peer.summary()
            assert (summary["stage"], summary["num_stages"]) == (stage, 2)
            assert summary["n_params"] == plan_stages(running.peer.config)[stage].parameters
            assert running.peer._status()["state"] == "leaving"
    finally:
        stop_all(peers)
