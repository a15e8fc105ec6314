"""A trainer whose parameters go non-finite rolls back to its last round, and never serves or saves NaN."""

from __future__ import annotations

import logging
import threading

import torch

from swarm.config import load_config
from swarm.learning import all_finite
from swarm.network import NetworkOptions
from swarm.state import list_checkpoints, read_checkpoint
from swarm.trainer import TrainingPeer
from tests.workers.tiny import TINY

POISON_AT = (7, 18)  # inner steps after which a parameter is overwritten with NaN / Inf


def _poison_after(peer: TrainingPeer, steps: tuple[int, ...]) -> list[int]:
    """Make the inner step write NaN (then Inf) into a parameter after the given steps; returns the list
    of steps actually poisoned."""
    real_step, poisoned = peer.inner.step, []

    def step(*args, **kwargs):
        stats = real_step(*args, **kwargs)
        if peer.inner.steps in steps:
            value = float("nan") if not poisoned else float("inf")
            with torch.no_grad():
                next(peer.model.parameters()).view(-1)[:3] = value
            poisoned.append(peer.inner.steps)
        return stats

    peer.inner.step = step
    return poisoned


def test_a_non_finite_step_rolls_back_and_nothing_non_finite_is_served_or_saved(tmp_path, caplog) -> None:
    config = load_config(
        None,
        overrides=[
            *TINY,
            "train.max_steps=30",
            "averaging.sync_every_steps=5",
            f"train.checkpoint_dir={tmp_path}",
            "train.checkpoint_every_s=1e-6",
        ],
        env={},
    )
    peer = TrainingPeer(config, NetworkOptions())  # gossip, alone: it serves its state and its offers
    served = []
    state_server = peer.backend.state_server
    publish = state_server.publish
    # what each published state holds, decoded as a joiner would (a replaced one is closed later)
    state_server.publish = lambda state: (served.append(state.decode().tensors), publish(state))[1]
    poisoned = _poison_after(peer, POISON_AT)
    try:
        with caplog.at_level(logging.WARNING, logger="swarm.trainer"):
            peer.run(threading.Event())
        assert poisoned == list(POISON_AT)
        assert peer.progress.rollbacks == 2 and peer._status()["rollbacks"] == 2
        assert sum("non-finite" in r.getMessage() for r in caplog.records) == 2
        assert all_finite(p.detach() for p in peer.model.parameters())
        assert peer.progress.step >= 28  # the poisoned steps (and only those) are not counted
        assert served and all(all_finite(tensors.values()) for tensors in served)
        for _, path in list_checkpoints(tmp_path):
            model = read_checkpoint(path)["model"]
            assert all_finite(t for t in model.values() if t.is_floating_point())
        # a save asked for while the parameters are non-finite (e.g. a background round booked right
        # after a poisoned step) writes nothing
        newest = max(list_checkpoints(tmp_path))
        with torch.no_grad():
            next(peer.model.parameters()).view(-1)[0] = float("nan")
        peer.progress.step += 1  # a new step: a finite state here would be saved
        assert peer.save_checkpoint() == newest[1]
        assert max(list_checkpoints(tmp_path)) == newest
    finally:
        peer.close()
