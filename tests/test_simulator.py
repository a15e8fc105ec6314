"""scripts/simulate.py: the event clock, the exchanges' arithmetic on tiny models, and consensus under
churn with training off."""

from __future__ import annotations

import json

import pytest
import torch

from scripts._sim_engine import SimConfig, Simulation
from scripts._sim_net import MESSAGE_OVERHEAD, Network
from scripts._sim_peer import Peer, World
from scripts._sim_rules import Rule, Tensors, spread

TINY = ("model.n_embd=8", "model.n_layer=1", "model.n_head=1")
LOSSLESS = Rule("factored", model_wire="fp32", delta_wire="fp32", max_lag=1)


@pytest.fixture(scope="module")
def world() -> World:
    return World(list(TINY), training=False)


def _pair(world: World, rule: Rule) -> Simulation:
    """Two peers whose anchors and models all differ, on steps so slow that no round ends by itself:
    the test drives the exchanges."""
    cfg = SimConfig(rule=rule, peers=2, step_times="1000", training=False, eval_batches=0, curve_batches=0)
    sim = Simulation(cfg, world=world)
    for index, peer in enumerate(sim.live()):
        torch.manual_seed(10 + index)
        peer.set_anchor({n: torch.randn_like(p) for n, p in peer.params.items()})
        _move(peer, scale=0.1)
    return sim


@torch.no_grad()
def _move(peer: Peer, scale: float, seed: int | None = None) -> Tensors:
    """Local progress: a random step added to the peer's parameters (returned)."""
    if seed is not None:
        torch.manual_seed(seed)
    step = {n: torch.randn_like(p) * scale for n, p in peer.params.items()}
    for name, param in peer.params.items():
        param.add_(step[name])
    return step


def _models(sim: Simulation) -> list[Tensors]:
    return [{n: p.detach().clone() for n, p in peer.params.items()} for peer in sim.live()]


def _mean(tensors: list[Tensors]) -> Tensors:
    return {n: sum(t[n] for t in tensors) / len(tensors) for n in tensors[0]}


def _close(a: Tensors, b: Tensors, atol: float = 1e-6) -> bool:
    return all(torch.allclose(a[n], b[n], atol=atol) for n in a)


def _exchange(sim: Simulation, progress: bool = True) -> list[Tensors]:
    """Prefetch both anchors, let them land, start an exchange from the first peer, make local progress
    while it is in flight, and let it land; returns the progress each peer made meanwhile."""
    first, second = sim.live()
    for peer in (first, second):
        sim.exchanges.prefetch(peer)
    sim.clock.run(until=sim.clock.now + 5.0)
    sim.exchanges.initiate(first)
    steps = [_move(peer, 0.01 if progress else 0.0) for peer in (first, second)]
    sim.clock.run(until=sim.clock.now + 5.0)
    return steps


def test_a_bigger_message_lands_later_and_a_peer_s_messages_queue() -> None:
    net = Network(rate=1000.0, latency=0.05)
    small = net.send("a", "b", 100, now=0.0)
    assert small == pytest.approx((100 + MESSAGE_OVERHEAD) / 1000 + 0.05)
    big = Network(rate=1000.0, latency=0.05).send("a", "b", 10_000, now=0.0)
    assert big > small + 9.0
    queued = net.send("a", "c", 100, now=0.0)  # a's uplink is busy with the first message until it left
    assert queued == pytest.approx(small + (100 + MESSAGE_OVERHEAD) / 1000)
    assert net.send("d", "e", 100, now=0.0) == pytest.approx(small)  # another pair's link is free


def test_a_dial_and_the_goodput_decide_when_an_exchange_lands(world: World) -> None:
    def lands(**link: float) -> float:
        """Seconds from a round's end to its exchange's landing, between two idle peers."""
        cfg = SimConfig(rule=LOSSLESS, peers=2, step_times="1000", training=False, latency_s=0.0, **link)
        sim = Simulation(cfg, world=world)
        first = sim.live()[0]
        sim.exchanges.initiate(first)
        assert first.exchange is not None
        return first.exchange.lands - sim.clock.now

    transfer = lands(dial_s=0.0)  # both models cross at once, each way on its own link
    assert transfer > 0
    assert lands(dial_s=0.5) == pytest.approx(transfer + 0.5)  # the handshake before the first byte
    assert lands(dial_s=0.0, goodput=0.957 / 2) == pytest.approx(2 * transfer)  # half the link's rate


@pytest.mark.parametrize("clock_round_s", [0.0, 2.0])
def test_rounds_are_counted_by_exchanges_or_by_a_shared_clock(world: World, clock_round_s: float) -> None:
    from swarm.gossip import hypercube_partner

    cfg = SimConfig(rule=LOSSLESS, peers=4, step_times="1000", training=False, clock_round_s=clock_round_s)
    sim = Simulation(cfg, world=world)
    me = sim.live()[0]
    sim.clock.run(until=2.1)  # the clock's round 1 (2.1 s over 2 s, rounded); nobody exchanged yet
    sim.exchanges.initiate(me)
    assert me.exchange is not None
    partner = me.exchange.sides[1]
    assert partner.pid == hypercube_partner(me.order, me.pid, 1 if clock_round_s else 0)
    assert hypercube_partner(me.order, me.pid, 1) != hypercube_partner(me.order, me.pid, 0)
    if clock_round_s:
        assert (me.round, partner.round) == (1, 0)  # the exchange leaves them: the clock says
    else:
        assert me.round == partner.round == 1  # the pair leaves with max(r_i, r_j) + 1


def test_the_factored_exchange_with_lossless_codecs_is_the_pair_s_mean_model(world: World) -> None:
    sim = _pair(world, LOSSLESS)
    before = _models(sim)
    steps = _exchange(sim)
    mean = _mean(before)
    for peer, step in zip(sim.live(), steps, strict=True):
        assert _close(peer.anchor, mean)  # (a_i + a_j)/2 - (Δ_i + Δ_j)/2 = (x_i + x_j)/2
        assert _close(dict(peer.params), {n: mean[n] + step[n] for n in mean})  # progress kept
    assert (sim.counters.factored, sim.counters.fallbacks) == (1, 0)


def _moved_on(peer: Peer) -> None:
    """``peer`` exchanged with someone else meanwhile: its anchor moved, and its model with it."""
    peer.set_anchor({n: t + 0.5 for n, t in peer.anchor.items()})
    with torch.no_grad():
        for param in peer.params.values():
            param.add_(0.5)


def _exchange_after_the_partner_moved_on(sim: Simulation, first: Peer, second: Peer) -> list[Tensors]:
    """``second`` moves on (:func:`_moved_on`), then ``first`` exchanges with it; returns the pair's
    models from before the exchange."""
    _moved_on(second)
    before = _models(sim)
    sim.exchanges.initiate(first)
    sim.clock.run(until=10.0)
    return before


def test_a_stale_anchor_is_not_counted_twice_the_pair_falls_back(world: World) -> None:
    sim = _pair(world, LOSSLESS)
    first, second = sim.live()
    for peer in (first, second):
        sim.exchanges.prefetch(peer)
    sim.clock.run(until=5.0)
    # the partner exchanged with someone else meanwhile: its anchor moved (and its model with it)
    before = _exchange_after_the_partner_moved_on(sim, first, second)
    assert sim.counters.fallbacks == 1 and sim.counters.factored == 0
    assert all(_close(peer.anchor, _mean(before), atol=1e-5) for peer in sim.live())


def test_a_shared_base_need_not_be_current_the_pair_still_gets_its_mean(world: World) -> None:
    """The trainer's rule: one side pushes its anchor as the pair's base; the partner's anchor may move
    after that (it exchanged with someone else), and x - B still carries the whole model."""
    sim = _pair(world, Rule("based", model_wire="fp32", delta_wire="fp32", max_lag=1))
    first, second = sim.live()
    for peer in (first, second):
        sim.exchanges.prefetch(peer)  # exactly one of the pair pushes
    sim.clock.run(until=5.0)
    assert first.bases[second.pid] is second.bases[first.pid]
    before = _exchange_after_the_partner_moved_on(sim, first, second)
    assert sim.counters.fallbacks == 0 and sim.counters.committed == 1
    assert all(_close(peer.anchor, _mean(before), atol=1e-5) for peer in sim.live())


def test_a_delta_whose_anchor_never_arrived_falls_back_and_a_dead_partner_commits_nothing(
    world: World,
) -> None:
    sim = _pair(world, Rule("factored", model_wire="fp32", delta_wire="int4", max_lag=1))
    first, second = sim.live()
    sim.exchanges.prefetch(first)  # only one side's anchor crossed
    sim.clock.run(until=5.0)
    before = _models(sim)
    sim.exchanges.initiate(first)
    sim.clock.run(until=10.0)
    assert sim.counters.fallbacks == 1 and sim.counters.committed == 1
    assert all(_close(peer.anchor, _mean(before), atol=1e-5) for peer in sim.live())

    anchor, params, residual = dict(first.anchor), first.snapshot(), first.residual
    sim.exchanges.initiate(first)  # both anchors are current now: a factored exchange ...
    second.alive, second.died = False, sim.clock.now  # ... whose partner dies before it lands
    sim.clock.run(until=20.0)
    assert sim.counters.aborted == 1 and sim.counters.committed == 1
    assert _close(first.anchor, anchor) and _close(dict(first.params), params)
    assert first.residual is residual  # the error feedback residual of the failed send is dropped
    assert first.exchange is None  # free to meet the next partner


@pytest.mark.parametrize(("wire", "feedback"), [("int4", True), ("int4", False), ("topk0.1", True)])
def test_error_feedback_keeps_the_pair_s_mean_over_rounds(world: World, wire: str, feedback: bool) -> None:
    """With an int4 (or a top-10%) Δ the anchor, less the residuals still owed, follows the exact
    pair-mean trajectory (the anchor plus the mean local progress) to float precision, however many
    rounds; without error feedback the rounding errors stay in the anchor."""
    rule = Rule("factored", model_wire="fp32", delta_wire=wire, error_feedback=feedback, max_lag=1)
    sim = _pair(world, rule)
    exact = _mean(_models(sim))  # the first exchange makes the pair's anchors the mean model
    for round_ in range(8):
        steps = _exchange(sim, progress=False)
        first, second = sim.live()
        assert sim.counters.factored == round_ + 1
        assert _close(first.anchor, second.anchor)
        for peer, seed in ((first, 2 * round_), (second, 2 * round_ + 1)):
            steps.append(_move(peer, 0.05, seed=100 + seed))
        exact = {n: exact[n] + (steps[-2][n] + steps[-1][n]) / 2 for n in exact}
    sim.exchanges.initiate(first)
    sim.clock.run(until=sim.clock.now + 5.0)
    owed = {n: (first.residual or {}).get(n, 0) + (second.residual or {}).get(n, 0) for n in exact}
    kept = {n: first.anchor[n] - owed[n] / 2 for n in exact}
    assert _close(kept, exact, atol=1e-5) == feedback
    assert not _close(first.anchor, exact, atol=1e-5)  # the codec does lose something each round


@pytest.mark.parametrize("rule", ["late", "factored"])
def test_with_training_off_the_spread_of_8_shrinks_geometrically_under_churn(world: World, rule: str) -> None:
    cfg = SimConfig(
        rule=Rule(rule, model_wire="fp32", delta_wire="fp32", max_lag=1),
        peers=8,
        samples=8 * 5 * 24,
        step_times="0.1x3,0.3",
        churn_per_min=3.0,
        join_delay_s=1.0,
        view_refresh_s=1.0,
        training=False,
        init_spread=1.0,
        eval_every=8 * 5 * 4,  # about 4 rounds of the fast peers
        curve_batches=0,
        eval_batches=0,
    )
    sim = Simulation(cfg, world=world)
    start = spread([{n: p.detach().clone() for n, p in peer.params.items()} for peer in sim.live()])
    result = sim.run()
    assert result["churn"]["left"] >= 2 and result["churn"]["joined"] >= 1
    spreads = [start] + [point[3] for point in result["curve"]]
    assert start > 0.1
    for k, now in enumerate(spreads):  # geometric: 4x smaller every 4 rounds of the fast peers, or better
        assert now <= start / 4**k
    assert spreads[-1] < start * 1e-4
    assert result["pairing"]["success"] > 0.8


def test_sharded_views_pair_under_churn_for_a_fraction_of_the_whole_lists_bytes(world: World) -> None:
    """The product's sharded membership (scripts/_sim_views.py ``shards``: each peer reads one shard every
    other refresh) at N = 64: partners found as reliably, models pulled together, bytes cut."""
    results = {}
    for view in ("full", "shards"):
        cfg = SimConfig(
            rule=Rule("late", model_wire="fp32", max_lag=1),
            peers=64,
            samples=64 * 5 * 8,
            step_times="0.5",
            churn_per_min=1.0,
            join_delay_s=1.0,
            view_refresh_s=1.0,
            record_ttl_s=4.0,
            view=view,
            training=False,
            init_spread=1.0,
            eval_every=64 * 5 * 8,
            curve_batches=0,
            eval_batches=0,
        )
        results[view] = Simulation(cfg, world=world).run()
    full, shards = results["full"], results["shards"]
    assert shards["churn"]["left"] >= 5 and shards["churn"]["joined"] >= 1
    assert shards["pairing"]["success"] > 0.9 and shards["pairing"]["scheduled_partner"] == 0
    assert shards["curve"][-1][3] < 0.05  # 8 rounds of random pairs: the spread of 1.0 shrank 20-fold
    assert shards["membership"]["bytes_per_peer_s"] < full["membership"]["bytes_per_peer_s"] / 2
    assert shards["membership"]["hottest_key_served_s"] < full["membership"]["hottest_key_served_s"] / 10


def test_the_cli_prints_one_row_per_run_with_its_gaps(capsys: pytest.CaptureFixture[str]) -> None:
    from scripts import simulate

    model = ",".join(TINY)
    args = ["--rules", "factored-int4", "--peers", "2", "--samples", "40", "--model", model]
    args += ["--eval-batches", "1", "--curve-batches", "1", "--eval-every", "20", "--quiet", "--json"]
    assert simulate.main(args) == 0
    rows = {row["rule"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"data-parallel", "allreduce", "factored-int4"}
    row = rows["factored-int4"]
    assert row["samples"] == 40 and [point[0] for point in row["curve"]] == [20, 40]
    assert row["gap_vs_allreduce"] == round(row["final_loss"] / rows["allreduce"]["final_loss"] - 1, 4)
    assert row["gap_vs_dataparallel"] == round(row["final_loss"] / rows["data-parallel"]["final_loss"] - 1, 4)
    assert row["bytes_per_param_per_round"]["critical"] > 0 and row["pairing"]["success"] == 1.0


def test_calibrate_sets_the_testbeds_regime_and_an_option_given_still_wins() -> None:
    from scripts import simulate

    regime = simulate.parse(["--calibrate"])
    assert regime.step_times == simulate.CALIBRATION["step_times"] and regime.flat and regime.stop_at_target
    assert regime.rules == simulate.TRAINER_RULE and not regime.baselines
    longer = simulate.parse(["--calibrate", "--step-times", "0.25", "--rate-mbit", "1.5", "--rules", "late"])
    assert (longer.step_times, longer.rate_mbit, longer.rules) == ("0.25", 1.5, "late")
    assert longer.flat and longer.target == simulate.CALIBRATION["target"]
    plain = simulate.parse([])
    assert not plain.flat and plain.baselines and plain.step_times != "0.25"
    costs = simulate.parse(["--calibrate", "--peers", "8", "--goodput", "0.77", "--dial-ms", "190"])
    (_, _, _, cfg, _), *_ = simulate.plan(costs)  # the trainer's measured link costs reach the simulation
    assert (cfg.goodput, cfg.dial_s) == (0.77, pytest.approx(0.19))
    assert simulate.plan(plain)[-1][3].dial_s is None  # a round trip
