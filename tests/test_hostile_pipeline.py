"""Pipeline stages among strangers (issue #28, finding 5; issue #41): who may apply gradients, how much
one micro-batch may move a stage (and a stage's answer the data holder), a data holder that never
commits, a peer that floods a stage's input cache, and routing by what the client measured rather than
what a server says or how fast it answers."""

from __future__ import annotations

import asyncio
import statistics
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from swarm.pipeline import Router, StageClient, StageError, StageWorker, build_stage, plan_stages
from swarm.pipeline._client import CallFailed, Reply
from swarm.pipeline._clip import CLIP_FACTOR, CLIP_WARMUP, INITIAL_CLIP_NORM, GradientClip
from swarm.pipeline._compute import DeviceClock, Outcome, Work
from swarm.pipeline._driver import DataHolder
from swarm.pipeline._estimate import MAX_CACHED
from swarm.pipeline._protocol import IO_TIMEOUT_S, Request
from swarm.pipeline._router import RATE_FACTOR, StageMember
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
        # a forward changes nothing: anyone may have one; its input is not cached (it may not BACKWARD)
        _call(stranger, s, Request("forward", mb, MICRO, TOKENS, False, False, True, 0), [("x", x)])
        assert len(s.worker._cache) == 0
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


def _middle_worker(clip: GradientClip | None = None, batch_size: int = 10**6, **options) -> StageWorker:
    from swarm.config import load_config

    config = load_config(None, overrides=CONFIG, env={})
    module = build_stage(config.model, plan_stages(config)[1], seed=0)
    clock = DeviceClock(0, 1, 8)
    return StageWorker(
        module, torch.device("cpu"), batch_size=batch_size, max_queue=4, clock=clock, clip=clip, **options
    )


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
    holder = _holder(router, _Client())
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


# ---------------------------------------------------------------- a data holder that never commits


def _applying(mb: str) -> Request:
    """A middle stage's FORWARD with the output gradient: forward and backward at once (it applies)."""
    return Request("forward", mb, MICRO, TOKENS, False, True, True, 2)


def test_a_data_holder_that_never_commits_does_not_hold_the_stage() -> None:
    """Mallory sends an applying request every round, reads the answer and never commits: the server
    rolls it back only once its stream ends, IO_TIMEOUT_S after the answer. The honest holder sends a
    batch's worth per round and commits each as soon as it is answered. Time is a fake clock: 0.1 s per
    honest round trip, 0.25 s per wait for an answer."""
    torch.manual_seed(1)
    clock = [0.0]
    worker = _middle_worker(batch_size=2 * MICRO, hold_s=1.0, now=lambda: clock[0])
    x, g = torch.randn(MICRO, TOKENS, 32), torch.randn(MICRO, TOKENS, 32) * 0.01
    streams: dict[tuple[str, str], float] = {}  # Mallory's answered requests, by when they were answered

    def answered(key: tuple[str, str]) -> Callable[[Outcome], None]:
        return lambda outcome: streams.update({key: clock[0]}) if outcome.error is None else None

    def tick(seconds: float) -> None:
        clock[0] += seconds
        for key, since in list(streams.items()):
            if clock[0] - since > IO_TIMEOUT_S:  # the server's wait for the COMMIT ends: rollback
                worker.resolve(key, commit=False)
                del streams[key]

    steps = honest = 0
    for i in range(120):
        bad = ("mallory", f"{i:032x}")
        assert worker.submit(
            Work(bad[0], _applying(bad[1]), {"x": x, "g": g}, None, clock[0] + 30, answered(bad))
        )
        for j in range(2):
            mb, answers = f"{10**6 + 2 * i + j:032x}", list[Outcome]()
            work = Work("holder", _applying(mb), {"x": x, "g": g}, None, clock[0] + 30, answers.append)
            assert worker.submit(work)
            for _ in range(40):  # 10 s at most: within the request's deadline, below IO_TIMEOUT_S
                worker.process(0)
                if answers:
                    break
                tick(0.25)
            assert answers and answers[0].error is None, (i, j, answers, worker.stats)
            worker.resolve(("holder", mb), commit=True)
            tick(0.1)
            while worker.process(0):
                if worker.step_ready:
                    worker.stepped()
                    steps += 1
            honest += 1
    assert steps == honest // 2 and worker.stats.committed == honest
    # her first one was parked, rolled back when its stream ended, and she came back: parked again
    assert worker.stats.parked >= 2 and worker.stats.rolled_back >= 1, worker.stats
    clock[0] += 31  # what she still has waiting expires; the rest of her streams end
    for key in streams:
        worker.resolve(key, commit=False)
    while worker.process(0):
        pass
    assert worker.provisional == 0
    reference = _apply(_middle_worker(), 0, x, g) * honest  # the honest micro-batches, alone
    moved = torch.cat([p.grad.flatten() for p in worker.module.parameters()])
    assert torch.allclose(moved, reference, rtol=1e-4, atol=1e-6)


def test_a_parked_microbatch_whose_commit_comes_late_still_counts_once() -> None:
    clock = [0.0]
    worker = _middle_worker(batch_size=2 * MICRO, hold_s=1.0, now=lambda: clock[0])
    x, g = torch.randn(MICRO, TOKENS, 32), torch.randn(MICRO, TOKENS, 32) * 0.01
    answers: list[Outcome] = []
    for i, peer in enumerate(("slow", "holder", "holder")):
        assert worker.submit(Work(peer, _applying(f"{i:032x}"), {"x": x, "g": g}, None, 1e9, answers.append))
    worker.process(0)
    worker.process(0)
    worker.resolve(("holder", f"{1:032x}"), commit=True)
    while worker.process(0):
        pass
    assert len(answers) == 2  # the batch is full: the holder's second request waits for the slow one
    clock[0] += 1.5
    while worker.process(0):
        pass
    assert len(answers) == 3 and worker.stats.parked == 1  # parked: the holder's request ran
    worker.resolve(("holder", f"{2:032x}"), commit=True)
    worker.resolve(("slow", f"{0:032x}"), commit=True)  # its COMMIT came after all
    while worker.process(0):
        pass
    assert worker.stats.reapplied == 1 and worker.stats.committed == 3 and worker.provisional == 0
    assert sorted(worker.committed_log) == sorted(
        [("slow", f"{0:032x}"), ("holder", f"{1:032x}"), ("holder", f"{2:032x}")]
    )
    reference = _apply(_middle_worker(), 0, x, g) * 3
    moved = torch.cat([p.grad.flatten() for p in worker.module.parameters()])
    assert torch.allclose(moved, reference, rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- one peer's forwards cannot flush the cache


def test_a_peer_flooding_training_forwards_does_not_evict_a_data_holders_cached_inputs() -> None:
    worker = _middle_worker()
    x, g = torch.randn(MICRO, TOKENS, 32), torch.randn(MICRO, TOKENS, 32) * 0.01
    answers: list[Outcome] = []

    def send(peer: str, op: str, mb: str, tensors: dict) -> None:
        request = Request(op, mb, MICRO, TOKENS, False, False, True, 1)
        assert worker.submit(Work(peer, request, tensors, None, 1e18, answers.append))
        assert worker.process(1.0)

    chains = [f"{i:032x}" for i in range(4)]  # the holder's chains in flight (pipeline.max_inflight)
    for mb in chains:
        send("holder", "forward", mb, {"x": x})
    for i in range(3 * MAX_CACHED):  # anyone may send training forwards; each caches its input
        send("flooder", "forward", f"{10**6 + i:032x}", {"x": x})
    assert worker._cache.held_by("flooder") == MAX_CACHED - len(chains)
    for mb in chains:
        send("holder", "backward", mb, {"g": g})
        assert answers[-1].error is None, answers[-1].error
        worker.resolve(("holder", mb), commit=True)
        worker.process(1.0)
    assert worker.stats.committed == len(chains)


# ---------------------------------------------------------------- a server that skips its compute


class _Instant:
    """A stage client: ``honest`` takes 0.5 s to answer, ``instant`` answers at once (it computes
    nothing) and claims no compute time; its input gradient is 65504 everywhere."""

    limits = [None, None]

    async def call(self, peer, stage, request, tensors, targets, timeout) -> Reply:
        instant = peer == "instant"
        dx = torch.full((MICRO, TOKENS, 32), 65504.0) if instant else torch.randn(MICRO, TOKENS, 32) * 0.01
        latency = 0.001 if instant else 0.5
        return Reply(loss=1.0, tensor=dx, queue=0, compute_s=0.0 if instant else 0.4, latency_s=latency)


def _holder(router: Router, client: object | None = None) -> DataHolder:
    """A data holder over ``router`` and ``client`` (by default one that answers at once)."""
    return DataHolder(
        None,  # type: ignore[arg-type]
        torch.device("cpu"),
        client if client is not None else _Instant(),  # type: ignore[arg-type]
        router,
        microbatch_size=MICRO,
        max_inflight=1,
        timeout_s=5,
        clock=DeviceClock(0, 1, 8),
    )


def test_a_server_that_answers_instantly_gets_at_most_its_capped_share() -> None:
    router = Router(num_stages=2, me="holder", seed=5)
    router.update([StageMember("instant", 1, 0.0), StageMember("honest", 1, 0.0)])
    holder = _holder(router)
    request = Request("forward", "ef" * 16, MICRO, TOKENS, True, False, True, 0)

    async def hops() -> Counter[str]:
        return Counter([(await holder._hop(1, request, [], None))[1] for _ in range(2000)])

    picks = asyncio.run(hops())
    cap = RATE_FACTOR / (1 + RATE_FACTOR)  # what a peer RATE_FACTOR times faster than the other gets
    assert picks["instant"] < (cap + 0.05) * sum(picks.values()), picks
    assert picks["honest"] > 0.1 * sum(picks.values()), picks


def test_the_input_gradient_a_stage_answers_is_clipped_before_stage_zero_uses_it() -> None:
    router = Router(num_stages=2, me="holder", seed=6)
    holder = _holder(router)
    h0, targets = torch.randn(MICRO, TOKENS, 32), torch.randint(0, 256, (MICRO, TOKENS))

    def chain_through(peer: str) -> torch.Tensor:
        router.update([StageMember(peer, 1, 0.0)])
        _, grad = asyncio.run(holder._chain("ab" * 16, h0, targets, train=True))
        assert grad is not None
        return grad.flatten(1).norm(dim=1)

    assert (chain_through("instant") <= INITIAL_CLIP_NORM * (1 + 1e-5)).all()
    honest = torch.cat([chain_through("honest") for _ in range(CLIP_WARMUP)])
    bound = CLIP_FACTOR * statistics.median([INITIAL_CLIP_NORM] * MICRO + honest.tolist())
    assert (chain_through("instant") <= bound * (1 + 1e-5)).all()
    assert holder.clips[1].clipped == 2 * MICRO
