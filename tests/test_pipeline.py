"""swarm.pipeline without a network: the cut into stages, the stage modules, the config section, the
compute side of a stage server (provisional gradients, commits, rollbacks), routing and rebalancing."""

from __future__ import annotations

import itertools
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from peers.cli import app
from swarm.config import ConfigError, load_config
from swarm.pipeline import (
    Rebalancer,
    Router,
    StageWorker,
    build_full,
    build_stage,
    choose_stage,
    describe_stages,
    estimate_stage,
    part_sizes,
    plan_stages,
    resolve_num_stages,
    stage_loads,
    stage_parameters,
)
from swarm.pipeline._balance import _ballot
from swarm.pipeline._compute import DeviceClock, Outcome, Work
from swarm.pipeline._protocol import Request
from swarm.pipeline._router import StageMember
from tests._cli import refused_output

TINY = ["model.n_layer=4", "model.n_embd=32", "model.n_head=2", "model.block_size=16"]


def _config(*overrides: str):
    return load_config(None, overrides=[*TINY, *overrides], env={})


# ---------------------------------------------------------------- the cut


@pytest.mark.parametrize(("layers", "stages"), [(2, 2), (4, 2), (8, 4), (24, 5), (12, 12), (7, 3)])
def test_stages_are_contiguous_nonempty_and_balance_the_largest_stage(layers: int, stages: int) -> None:
    config = load_config(None, overrides=[f"model.n_layer={layers}", f"pipeline.num_stages={stages}"], env={})
    specs = plan_stages(config)
    assert [s.index for s in specs] == list(range(stages))
    assert specs[0].first == 0 and specs[-1].last == layers
    assert all(s.blocks >= 1 and s.last == n.first for s, n in itertools.pairwise(specs))
    assert specs[0].embeddings and specs[-1].head and not any(s.embeddings for s in specs[1:])
    sizes = part_sizes(config.model)
    # no other cut has a smaller largest stage (exhaustive over the ways to place the stage boundaries)
    best = min(max(_weights(c, sizes)) for c in _compositions(layers, stages))
    assert max(s.parameters for s in specs) == best
    assert plan_stages(config) == specs  # a pure function: the same on every peer


def _compositions(n: int, k: int):
    if k == 1:
        yield [n]
        return
    for first in range(1, n - k + 2):
        for rest in _compositions(n - first, k - 1):
            yield [first, *rest]


def _weights(counts: list[int], sizes) -> list[int]:
    weights = [c * sizes.block for c in counts]
    weights[0] += sizes.embeddings
    weights[-1] += sizes.head
    return weights


def test_stage_modules_hold_their_share_and_compose_into_the_untied_model() -> None:
    config = _config("pipeline.num_stages=2")
    specs = plan_stages(config)
    stages = [build_stage(config.model, s, seed=3) for s in specs]
    full = build_full(config.model, seed=3)
    total = stage_parameters(full)
    assert sum(stage_parameters(s) for s in stages) == total
    assert [stage_parameters(s) for s in stages] == [s.parameters for s in specs]
    assert all(abs(stage_parameters(s) / total - 0.5) < 0.05 for s in stages)
    # the head is its own weight (tied, it would be the token embedding twice in two stages)
    assert "lm_head.weight" in dict(stages[1].named_parameters()) and "wte.weight" in dict(
        stages[0].named_parameters()
    )
    x = torch.randint(0, 256, (3, 16))
    targets = torch.randint(0, 256, (3, 16))
    assert torch.allclose(stages[1](stages[0](x)), full(x), atol=1e-6)
    assert torch.allclose(stages[1].loss(stages[0](x), targets), full.loss(x, targets), atol=1e-6)
    # the same parameter gets the same initial value whatever the cut
    four = [build_stage(config.model, s, seed=3) for s in plan_stages(config, 4)]
    merged = {n: p for s in four for n, p in s.named_parameters()}
    assert all(torch.equal(p, merged[n]) for n, p in full.named_parameters())
    assert not torch.equal(build_full(config.model, seed=4).wte.weight, full.wte.weight)


def test_the_pipeline_config_section_is_validated_and_hashed_by_its_resolved_cut() -> None:
    assert _config().pipeline.num_stages == 1
    with pytest.raises(ConfigError, match="memory_budget_gb"):
        _config("pipeline.num_stages=auto")
    with pytest.raises(ConfigError, match="num_stages"):
        _config("pipeline.num_stages=0")
    with pytest.raises(ValueError, match="n_layer"):
        plan_stages(_config("pipeline.num_stages=5"))
    with pytest.raises(ValueError, match="gossip"):
        plan_stages(_config("pipeline.num_stages=2", "averaging.backend=none"))
    # per-peer keys do not change the hash; the cut does
    base = _config("pipeline.num_stages=2").config_hash()
    assert (
        _config("pipeline.num_stages=2", "pipeline.max_inflight=9", "pipeline.routing=fixed").config_hash()
        == base
    )
    assert _config("pipeline.num_stages=4").config_hash() != base
    assert _config("pipeline.num_stages=2", "pipeline.activation_codec=fp16").config_hash() != base


def test_auto_takes_the_fewest_stages_whose_largest_fits_the_budget_which_is_hashed() -> None:
    big = ["model.n_layer=8", "model.n_embd=256", "model.n_head=4", "model.block_size=128"]
    whole = estimate_stage(
        load_config(None, overrides=big, env={}), plan_stages(load_config(None, overrides=big, env={}))[0]
    )
    budget = whole.memory / (1 << 30) / 2.5  # the whole model does not fit, a few stages do
    auto = load_config(
        None, overrides=[*big, "pipeline.num_stages=auto", f"pipeline.memory_budget_gb={budget}"], env={}
    )
    count = resolve_num_stages(auto)
    assert 3 <= count <= 8
    assert max(estimate_stage(auto, s).memory for s in plan_stages(auto)) <= budget * (1 << 30)
    fewer = plan_stages(auto, count - 1)
    assert max(estimate_stage(auto, s).memory for s in fewer) > budget * (1 << 30)
    assert auto.swarm_view()["pipeline"]["memory_budget_gb"] == budget  # peers must share the cut's budget
    lines = describe_stages(auto)
    assert lines[0].startswith(f"pipeline: {count} stages") and len(lines) == count + 2
    assert all("parameters" in line and "fits" in line for line in lines[1:-1])
    assert "activations per sample" in lines[-1]


# ---------------------------------------------------------------- the compute side of a stage server


def _worker(module, batch: int = 8) -> StageWorker:
    return StageWorker(
        module, torch.device("cpu"), batch_size=batch, max_queue=4, clock=DeviceClock(0, 1, batch)
    )


def _work(
    request: Request, tensors: dict, targets=None, peer: str = "client", answers: list | None = None
) -> Work:
    answers = answers if answers is not None else []
    return Work(peer, request, tensors, targets, deadline=1e18, done=answers.append)


def _grads(module) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in module.named_parameters()
    }


def test_a_rolled_back_microbatch_leaves_the_gradient_exactly_as_before_and_a_step_waits_for_it() -> None:
    config = _config("pipeline.num_stages=2")
    module = build_stage(config.model, plan_stages(config)[1], seed=0)
    worker = _worker(module)
    answers: list[Outcome] = []
    x, targets = torch.randn(4, 16, 32), torch.randint(0, 256, (4, 16))

    def apply(mb: str) -> None:
        assert worker.submit(
            _work(Request("forward", mb, 4, 16, True, False, True, 1), {"x": x}, targets, answers=answers)
        )
        assert worker.process(1.0)

    apply("a" * 32)
    worker.resolve(("client", "a" * 32), commit=True)
    worker.process(1.0)
    committed = _grads(module)
    apply("b" * 32)  # provisional: with a, a batch's worth, so the next applying request waits
    assert worker.submit(
        _work(Request("forward", "c" * 32, 4, 16, True, False, True, 1), {"x": x}, targets, answers=answers)
    )
    worker.process(1.0)
    assert len(answers) == 2 and not worker.step_ready  # c deferred; b not committed yet
    worker.resolve(("client", "b" * 32), commit=False)
    worker.process(1.0)
    assert worker.stats.rolled_back == 1 and worker.provisional == 0
    for name, grad in _grads(module).items():
        assert torch.allclose(grad, committed[name], atol=1e-7), name
    worker.process(1.0)  # the deferred request runs now that the batch is open again
    assert len(answers) == 3 and answers[-1].error is None
    worker.resolve(("client", "c" * 32), commit=True)
    worker.process(1.0)
    assert worker.step_ready and worker.committed_log == [("client", "a" * 32), ("client", "c" * 32)]
    worker.stepped()
    # the same micro-batch id again, committed or not: refused, nothing added
    for mb in ("a", "b", "c"):
        before = _grads(module)
        apply(mb * 32)
        if mb != "b":
            assert answers[-1].error == "micro-batch already applied here" and not answers[-1].retry
            assert all(torch.equal(g, before[n]) for n, g in _grads(module).items())


def test_a_full_queue_answers_busy_and_an_expired_request_is_not_served() -> None:
    config = _config("pipeline.num_stages=3")
    module = build_stage(config.model, plan_stages(config)[1], seed=0)
    worker = _worker(module)
    answers: list[Outcome] = []
    request = Request("forward", "e" * 32, 4, 16, False, False, True, 1)
    works = [_work(request, {"x": torch.randn(4, 16, 32)}, answers=answers) for _ in range(5)]
    assert [worker.submit(w) for w in works] == [True] * 4 + [False]
    works[0].cancelled = True
    while worker.process(0.01):
        pass
    assert answers[0].error == "expired before it was served"
    assert all(a.error is None and a.tensors[0][0] == "y" for a in answers[1:])


# ---------------------------------------------------------------- routing


def test_routing_gives_peers_micro_batches_in_proportion_to_their_measured_throughput() -> None:
    router = Router(num_stages=2, me="holder", seed=1)
    router.update([StageMember("fast", 1, 0.0), StageMember("slow", 1, 0.0)])
    for peer, rate in (("fast", 30.0), ("slow", 10.0)):  # one answer each: samples per device second
        router.started(peer)
        router.finished(peer, 4, 4 / rate, 0)
    picks = Counter(router.choose(1) for _ in range(4000))
    assert 2.5 < picks["fast"] / picks["slow"] < 3.5
    # a busy peer (our requests in flight) gets fewer; a failed one is avoided while another is there
    for _ in range(3):
        router.started("fast")
    busier = Counter(router.choose(1) for _ in range(4000))
    assert busier["fast"] < picks["fast"]
    router.finished("fast", 4, None, None)
    assert {router.choose(1) for _ in range(200)} == {"slow"}
    assert router.choose(1, exclude=["slow"]) == "fast"  # the only one left is still tried
    assert router.choose(1, exclude=["slow", "fast"]) is None


def test_fixed_routing_pins_each_data_holder_to_one_peer_per_stage() -> None:
    members = [StageMember(p, 1, 5.0) for p in ("s1", "s2")]
    pinned = set()
    for holder in ("h1", "h2"):
        router = Router(num_stages=2, me=holder, policy="fixed")
        router.update(members, holders=["h1", "h2"])
        picks = {router.choose(1) for _ in range(50)}
        assert len(picks) == 1
        pinned |= picks
        assert router.choose(1, exclude=picks) in {"s1", "s2"} - picks  # failover still works
    assert pinned == {"s1", "s2"}


# ---------------------------------------------------------------- choosing and changing stages


def _record(
    stage: int, capacity: float, state: str = "training", speed: float = 0.0, peer_id: str = ""
) -> SimpleNamespace:
    return SimpleNamespace(
        peer_id=peer_id or f"peer-{next(_ids)}",
        role="trainer",
        state=state,
        stage=stage,
        stage_capacity=capacity,
        samples_per_s=speed,
        config_hash="ab",
    )


_ids = itertools.count()


def test_a_joiner_takes_the_stage_with_the_lowest_capacity() -> None:
    assert choose_stage(stage_loads([], 3)) == 0  # nobody yet: hold data
    records = [_record(0, 50), _record(1, 40), _record(2, 10), _record(1, 0, state="joining")]
    assert choose_stage(stage_loads(records, 3)) == 2
    assert choose_stage(stage_loads([_record(0, 50), _record(1, 40)], 3)) == 2  # an empty stage first


def test_rebalancing_needs_a_clear_persistent_gain_keeps_a_peer_per_stage_and_moves_rarely() -> None:
    rebalancer = Rebalancer(hysteresis=0.25, patience=3, min_interval_s=100, epoch_s=1e9)

    def consider(capacity: float, others: list[SimpleNamespace], now: float) -> int | None:
        return rebalancer.consider("me", 1, capacity, others, 2, now)

    loser = _loser("me", 1, 0)  # a peer the election for 1 -> 0 ranks after us
    lopsided = [_record(0, 30), _record(1, 30, peer_id=loser), _record(1, 30, peer_id=loser + "x")]
    lopsided[2].peer_id = _loser("me", 1, 0, after=loser)
    assert [consider(30, lopsided, now=t) for t in (0, 1)] == [None, None]  # not persistent yet
    assert consider(30, lopsided, now=2) == 0  # 30 vs 90 (us included): moving gives 60 vs 60
    rebalancer.moved(2)
    assert [consider(30, lopsided, now=t) for t in (3, 4, 5)] == [None, None, None]  # too soon
    near = [_record(0, 50), _record(1, 30)]  # 50 vs 60 with us: moving gives 30 vs 80
    assert all(consider(30, near, now=1000 + t) is None for t in range(5))
    alone = [_record(0, 90)]
    assert all(consider(10, alone, now=2000 + t) is None for t in range(5))
    unmeasured = [_record(0, 30), _record(1, 0), _record(1, 30)]
    assert all(consider(30, unmeasured, now=3000 + t) is None for t in range(5))


def _loser(me: str, stage: int, target: int, after: str = "") -> str:
    """A peer id (not ``after``) that the election from ``stage`` to ``target`` ranks after ``me``."""
    ids = (f"peer-{i}" for i in itertools.count())
    return next(p for p in ids if p != after and _ballot(p, stage, target, 0) > _ballot(me, stage, target, 0))


def test_exactly_one_peer_of_a_stage_moves_and_an_emptied_stage_is_refilled_at_once() -> None:
    def movers(records: list[SimpleNamespace], stage: int, now: float, last_move: float = -1e9) -> list[str]:
        """Who moves, each peer of ``stage`` deciding alone from the same records."""
        moved = []
        for me in records:
            if me.stage == stage:
                rebalancer = Rebalancer(patience=1, min_interval_s=1000, epoch_s=10)
                rebalancer._last_move = last_move
                if rebalancer.consider(me.peer_id, stage, me.stage_capacity, records, 2, now) is not None:
                    moved.append(me.peer_id)
        return moved

    # six equal peers of stage 1 against one at stage 0
    records = [_record(0, 10)] + [_record(1, 30) for _ in range(6)]
    elected = [movers(records, 1, now=10 * epoch + 5) for epoch in range(20)]
    assert all(len(moved) == 1 for moved in elected)
    assert len({moved[0] for moved in elected}) > 1  # another epoch, another peer (the last may be pinned)
    # two peers moved anyway (their views differed): one of the three at stage 0 refills stage 1 although
    # they moved a moment ago (an empty stage stops the whole swarm)
    records = [_record(0, 10), _record(0, 30), _record(0, 30)]
    assert len(movers(records, 0, now=1, last_move=0)) == 1


def test_of_two_peers_elected_from_views_a_moment_apart_only_one_claim_goes_through() -> None:
    stage0 = _record(0, 10)
    ours = [_record(1, 30, peer_id=f"peer-{i}") for i in range(2)]
    first, second = ours
    # an epoch that elects the first, followed by one that elects the second
    epoch = next(
        e
        for e in itertools.count()
        if _ballot(first.peer_id, 1, 0, e) < _ballot(second.peer_id, 1, 0, e)
        and _ballot(second.peer_id, 1, 0, e + 1) < _ballot(first.peer_id, 1, 0, e + 1)
    )
    rebalancers = {r.peer_id: Rebalancer(patience=1, min_interval_s=1000, epoch_s=10) for r in ours}
    stale = [stage0, *ours]  # neither has seen the other move yet

    def elected(me: SimpleNamespace, now: float) -> int | None:
        return rebalancers[me.peer_id].consider(me.peer_id, 1, 30, stale, 2, now)

    assert elected(first, 10 * epoch + 9.9) == 0 and elected(second, 10 * epoch + 10.1) == 0  # both elected

    def confirmed(me: SimpleNamespace, records: list[SimpleNamespace]) -> bool:
        return rebalancers[me.peer_id].confirm(me.peer_id, 1, 30, records, 2, 0)

    claimed = {r.peer_id: _record(1, 30, state="joining", peer_id=r.peer_id) for r in ours}
    # the first read before the second claimed: it goes; the second reads the first's claim: it stays
    assert confirmed(first, [stage0, claimed[first.peer_id], second])
    assert not confirmed(second, [stage0, claimed[first.peer_id], claimed[second.peer_id]])
    # both read after both claimed: both stay, and a later epoch elects again
    assert not confirmed(first, [stage0, *claimed.values()])
    # the first already moved: stage 1 would be left empty
    moved = _record(0, 30, peer_id=first.peer_id)
    assert not confirmed(second, [stage0, moved, claimed[second.peer_id]])
    # nothing changed since the election: the move holds
    assert confirmed(second, [stage0, first, claimed[second.peer_id]])
    # with a third peer the stage keeps one either way: only the rival's claim stops the second
    third = _record(1, 30)
    assert not confirmed(second, [stage0, claimed[first.peer_id], claimed[second.peer_id], third])
    assert confirmed(second, [stage0, first, claimed[second.peer_id], third])


# ---------------------------------------------------------------- the programs


def test_config_check_prints_each_stage_and_refuses_a_cut_that_cannot_work() -> None:
    check = ["config", "check", "configs/local-tiny.yaml", "--set"]
    done = CliRunner().invoke(app, [*check, "pipeline.num_stages=2"])
    assert done.exit_code == 0, done.output
    assert "pipeline: 2 stages" in done.stdout and "activations per sample" in done.stdout
    assert "stage 0 (embeddings, blocks 0-0): 70,464 parameters" in done.stdout
    assert "stage 1 (blocks 1-1, head + loss): 66,496 parameters" in done.stdout
    refused = refused_output([*check, "pipeline.num_stages=3"])
    assert "exceeds model.n_layer = 2" in refused


def test_join_refuses_a_stage_the_run_does_not_have_before_touching_the_network() -> None:
    peer = "/ip4/127.0.0.1/tcp/9/p2p/QmQJ6SnRRMQNH1hFgKZZbvsxXJm5K4pUfRXYuDHYptAfUX"
    args = ["join", "--config", "configs/local-tiny.yaml", "--initial-peers", peer]
    beyond = refused_output([*args, "--set", "pipeline.num_stages=2", "--stage", "2"])
    assert "the run has stages 0..1" in beyond
    unpipelined = refused_output([*args, "--stage", "1"])
    assert "has no pipeline" in unpipelined
    no_checkpoints = ["--set", "train.checkpoint_dir=null"]  # (kept by default, under SWARM_HOME)
    resumed = refused_output([*args, "--set", "pipeline.num_stages=2", *no_checkpoints, "--resume"])
    assert "--resume needs train.checkpoint_dir" in resumed


# ---------------------------------------------------------------- the monitor


def test_the_monitor_shows_peers_throughput_and_capacity_per_stage_and_the_bottleneck() -> None:
    from io import StringIO

    from rich.console import Console

    from peers._monitor_table import render
    from swarm.membership import PROTOCOL_VERSION, PeerRecord
    from swarm.metrics import SnapshotPolicy, build_snapshot

    now = 1_700_000_000.0

    def member(n: int, stage: int, capacity: float, speed: float) -> SimpleNamespace:
        peer_id = "Qm" + "abcdefghijkmnopqrstuvwxyzABCDEFG"[:30] + "123456789"[n] * 2
        record = PeerRecord(
            peer_id=peer_id, protocol_version=PROTOCOL_VERSION, package_version="0.1.0", config_hash="ab",
            role="trainer", state="training", stage=stage, stage_capacity=capacity, samples_per_s=speed,
        )  # fmt: skip
        return SimpleNamespace(peer_id=peer_id, record=record, expires_at=now + 5)

    members = [
        member(1, 0, 40.0, 20.0),
        member(2, 1, 12.0, 10.0),
        member(3, 1, 12.0, 10.0),
        member(4, 2, 30.0, 20.0),
    ]
    policy = SnapshotPolicy(protocol_version=PROTOCOL_VERSION, config_hash="ab", record_ttl_s=10)
    snapshot = build_snapshot(members, None, now, policy)
    assert [(s.stage, s.peers, s.capacity, s.bottleneck) for s in snapshot.stages] == [
        (0, 1, 40.0, False), (1, 2, 24.0, True), (2, 1, 30.0, False),
    ]  # fmt: skip
    document = snapshot.to_dict()
    assert document["bottleneck_stage"] == 1 and document["stages"][1]["samples_per_s"] == 20.0
    assert [p["stage"] for p in document["peers"]] == [0, 1, 1, 2]
    console = Console(file=StringIO(), width=120)
    console.print(render(snapshot, 120))
    assert "stage 1: 2 peers, 20 samples/s, capacity 24 samples/s  <- bottleneck" in console.file.getvalue()
    plain = build_snapshot(members[:1], None, now, policy)
    assert plain.stages == () and plain.to_dict()["bottleneck_stage"] is None


def test_a_server_knows_its_data_holders_left_even_if_no_record_showed_one_active() -> None:
    """A data holder can join, train and leave between two reads of the records (a tiny run on a
    loaded machine): the samples the server stepped on say holders were here, and once none came for
    the grace period the server is done, instead of serving nobody for good."""
    from swarm.pipeline import _roster

    class NoMembers:
        peer_id = "server"

        def members(self) -> list:
            return []

    now = [1000.0]
    roster = _roster.Roster(NoMembers(), "hash", 2, period_s=3600, clock=lambda: now[0])  # type: ignore[arg-type]
    try:
        roster.refresh()
        assert not roster.holders_gone(grace_s=10)  # no holder ever: keep waiting for one
        roster.holders_active()
        now[0] += 5
        assert not roster.holders_gone(grace_s=10)
        now[0] += 6
        assert roster.holders_gone(grace_s=10)
    finally:
        roster.close()
