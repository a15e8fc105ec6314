"""Pipeline stages among strangers (issue #28, finding 5): who may apply gradients, how much one
micro-batch may move a stage, and routing by what the client measured rather than what a server says."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from swarm.pipeline import Router, StageClient, StageError, StageWorker, build_stage, plan_stages
from swarm.pipeline._client import CallFailed, Reply
from swarm.pipeline._compute import (
    CLIP_FACTOR,
    CLIP_WARMUP,
    INITIAL_CLIP_NORM,
    DeviceClock,
    GradientClip,
    Outcome,
    Work,
)
from swarm.pipeline._driver import DataHolder
from swarm.pipeline._protocol import Request
from swarm.pipeline._router import StageMember
from tests._processes import wait_until
from tests.test_pipeline_server import CONFIG, MICRO, TOKENS, _Stage

# ---------------------------------------------------------------- only data holders apply gradients


@pytest.fixture
def stage() -> Iterator[_Stage]:
    s = _Stage(1)
    yield s
    s.close()


def _stranger(s: _Stage) -> StageClient:
    """A second client on its own daemon, connected to the stage server: no data holder of the run."""
    from hivemind.p2p import P2P

    maddrs = s.server._loop.run(s.server._p2p.get_visible_maddrs(), timeout=10)

    async def connected() -> P2P:
        return await P2P.create(initial_peers=maddrs)

    return StageClient("pp", s.limits, p2p_factory=connected)


def _call(client: StageClient, s: _Stage, request: Request, tensors: list) -> Reply:
    return client.run(client.call(s.server.peer_id, 1, request, tensors, None, timeout=20), timeout=30)


def test_a_peer_that_is_no_data_holder_cannot_apply_gradients_to_a_stage(stage: _Stage) -> None:
    s = stage
    x, g = torch.randn(MICRO, TOKENS, 32), torch.randn(MICRO, TOKENS, 32) * 1e-3
    mb = "ab" * 16
    stranger = _stranger(s)
    try:
        # a forward changes nothing: anyone may have one
        _call(stranger, s, Request("forward", mb, MICRO, TOKENS, False, False, True, 0), [("x", x)])
        before = s.grads()
        # refused with the reason, or (on a loaded machine) the refused stream closes before the
        # client reads the reason; either way nothing below may change
        with pytest.raises((StageError, CallFailed), match=r"data holders|IncompleteReadError"):
            _call(stranger, s, Request("backward", mb, MICRO, TOKENS, False, False, True, 0), [("g", g)])
        with pytest.raises((StageError, CallFailed), match=r"data holders|IncompleteReadError"):
            _call(
                stranger, s, Request("forward", mb, MICRO, TOKENS, False, True, True, 0), [("x", x), ("g", g)]
            )
    finally:
        stranger.close()
    assert s.worker.stats.committed == 0 and s.worker.provisional == 0
    assert all(torch.equal(grad, before[n]) for n, grad in s.grads().items())
    # the run's data holder (the stage's own client) is served as before
    s.call(Request("forward", mb, MICRO, TOKENS, False, True, True, 0), [("x", x), ("g", g)])
    wait_until(lambda: s.worker.stats.committed == 1, 10, "the data holder's commit")


# ---------------------------------------------------------------- each micro-batch's gradient is clipped


def _middle_worker(clip: GradientClip | None = None) -> StageWorker:
    from swarm.config import load_config

    config = load_config(None, overrides=CONFIG, env={})
    module = build_stage(config.model, plan_stages(config)[1], seed=0)
    clock = DeviceClock(0, 1, 8)
    return StageWorker(module, torch.device("cpu"), batch_size=10**6, max_queue=4, clock=clock, clip=clip)


def _apply(worker: StageWorker, index: int, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Commit one micro-batch with output gradient ``g``; the change it made to the stage's gradient."""
    before = [
        p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in worker.module.parameters()
    ]
    answers: list[Outcome] = []
    request = Request("forward", f"{index:032x}", MICRO, TOKENS, False, True, True, 2)
    assert worker.submit(Work("holder", request, {"x": x, "g": g}, None, 1e18, answers.append))
    assert worker.process(1.0) and answers[0].error is None
    worker.resolve(("holder", request.mb), commit=True)
    worker.process(1.0)
    return torch.cat(
        [(p.grad - b).flatten() for p, b in zip(worker.module.parameters(), before, strict=True)]
    )


@pytest.mark.parametrize("honest_first", [True, False], ids=["after-honest-ones", "first"])
def test_one_huge_output_gradient_moves_a_stage_as_a_sample_at_the_clip_bound_would(
    honest_first: bool,
) -> None:
    torch.manual_seed(0)
    worker = _middle_worker()
    x = torch.randn(MICRO, TOKENS, 32)
    norms: list[float] = []
    if honest_first:
        for i in range(CLIP_WARMUP):
            g = torch.randn(MICRO, TOKENS, 32) * 0.02
            norms += g.flatten(1).norm(dim=1).tolist()
            _apply(worker, i, x, g)
    bound = CLIP_FACTOR * statistics.median(norms) if honest_first else INITIAL_CLIP_NORM
    hostile = torch.full((MICRO, TOKENS, 32), 65504.0)  # the largest fp16 value, everywhere
    moved = _apply(worker, 999, x, hostile)
    assert worker.clip.clipped == MICRO
    # exactly what the same direction at the bound's norm does on an unclipped copy of the stage
    unclipped = _middle_worker(GradientClip(initial=1e30))
    reference = _apply(unclipped, 0, x, hostile / hostile[0].norm() * bound)
    assert torch.allclose(moved, reference, rtol=1e-3, atol=1e-6)
    assert moved.norm() < 1e-3 * _apply(unclipped, 1, x, hostile).norm()


# ---------------------------------------------------------------- routing by what the client measured


class _Client:
    """A stage client whose peers all take the same time (what the real client measures itself);
    ``liar`` reports that it took none."""

    limits = [None, None]

    async def call(self, peer, stage, request, tensors, targets, timeout) -> Reply:
        reported = 0.0 if peer == "liar" else 0.4
        return Reply(loss=None, tensor=None, queue=0, compute_s=reported, latency_s=0.5)


def test_a_server_that_reports_no_compute_time_gets_no_more_than_its_measured_share() -> None:
    router = Router(num_stages=2, me="holder", seed=3)
    router.update([StageMember("liar", 1, 0.0), StageMember("honest", 1, 0.0)])
    holder = DataHolder(
        None,  # type: ignore[arg-type]
        torch.device("cpu"),
        _Client(),  # type: ignore[arg-type]
        router,
        microbatch_size=MICRO,
        max_inflight=1,
        timeout_s=5,
        clock=DeviceClock(0, 1, 8),
    )
    request = Request("forward", "cd" * 16, MICRO, TOKENS, False, False, True, 0)

    async def hops() -> Counter[str]:
        return Counter([(await holder._hop(1, request, [], None))[1] for _ in range(400)])

    picks = asyncio.run(hops())
    rates = {peer: stat["rate"] for peer, stat in router.snapshot().items()}
    assert rates["liar"] <= rates["honest"] * 1.001, rates
    assert picks["liar"] < 0.6 * sum(picks.values()), picks


def test_a_capacity_a_peer_announces_is_capped_by_what_its_stage_was_measured_at() -> None:
    router = Router(num_stages=2, me="holder", seed=4)
    router.update([StageMember("boaster", 1, 1e9), StageMember("measured", 1, 0.0)])
    router.started("measured")
    router.finished("measured", 4, 0.5, 0)
    picks = Counter(router.choose(1) for _ in range(2000))
    assert picks["boaster"] < 0.6 * sum(picks.values()), picks
