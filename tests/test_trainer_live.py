"""swarm.trainer._live: snapshots, queued updates, kept local progress, steps used once (no network)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarm.gossip import Committed, SyncOutcome, SyncResult
from swarm.learning import OuterOptimizer
from swarm.trainer._live import LiveModel, Update, probe_distance, probe_positions
from swarm.trainer._offers import AnchorOffers, ModelOffers

BATCH = 4


def _live(lr: float = 1.0, momentum: float = 0.0, seed: int = 0) -> tuple[torch.nn.Module, LiveModel]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(5, 3)
    return model, LiveModel(model, OuterOptimizer(model, lr=lr, momentum=momentum), BATCH)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _step(model: torch.nn.Module, live: LiveModel, seed: int) -> dict[str, torch.Tensor]:
    """A fake inner step: a known random move of every parameter, under the update guard."""
    generator = torch.Generator().manual_seed(seed)
    moves = {name: torch.randn(p.shape, generator=generator) * 0.01 for name, p in model.named_parameters()}
    with live.updating(), torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(moves[name])
    return moves


def _delta_update(live: LiveModel, gradient_from: dict[str, torch.Tensor] | None = None) -> Update:
    """What DeltaOffers queues for a committed exchange whose mixed gradient is ``gradient_from``
    (by default our own pseudo-gradient: the mix with a partner holding the same)."""
    snapshot = live.delta_snapshot()
    consumed = {name: t * snapshot.samples for name, t in snapshot.mean.items()}
    gradient = gradient_from if gradient_from is not None else {n: t.clone() for n, t in consumed.items()}
    return Update("delta", gradient=gradient, consumed=consumed, steps=snapshot.steps)


def test_the_overlapped_step_keeps_the_progress_made_after_the_snapshot() -> None:
    model, live = _live()
    anchor = _params(model)
    for seed in range(3):
        _step(model, live, seed)
    update = _delta_update(live)  # snapshot after 3 steps, exchange starts ...
    later = [_step(model, live, seed) for seed in (10, 11)]  # ... and 2 more steps run meanwhile
    before_apply = _params(model)
    partner = {name: torch.full_like(t, 0.5) for name, t in update.gradient.items()}
    mixed = {name: (update.consumed[name] + partner[name]) / 2 for name in partner}
    update.gradient = mixed
    live.queue(update)
    live.apply_pending()

    for name, p in model.named_parameters():
        new_anchor = anchor[name] - mixed[name]  # lr 1, no momentum: anchor moves by the mixed gradient
        assert torch.allclose(live.outer.anchor[name], new_anchor, atol=1e-6)
        progress_since = later[0][name] + later[1][name]
        assert torch.allclose(p.detach(), new_anchor + progress_since, atol=1e-6)
        assert not torch.allclose(p.detach(), before_apply[name])
    assert live.steps == 2  # the two steps taken meanwhile start the next round


def test_with_our_own_gradient_lr_one_and_no_momentum_the_model_is_unchanged() -> None:
    model, live = _live()
    for seed in range(4):
        _step(model, live, seed)
    live.queue(_delta_update(live))
    _step(model, live, 99)
    expected = _params(model)
    live.apply_pending()
    for name, p in model.named_parameters():
        assert torch.allclose(p.detach(), expected[name], atol=1e-6)


def test_a_queued_update_blocks_new_snapshots_and_applies_exactly_once() -> None:
    model, live = _live(lr=0.7, momentum=0.9)
    for seed in range(3):
        _step(model, live, seed)
    live.queue(_delta_update(live))
    assert live.delta_snapshot() is None, "steps already used by a committed exchange were offered again"
    _step(model, live, 5)
    assert live.delta_snapshot() is None
    applied = live.apply_pending()
    assert [u.kind for u in applied] == ["delta"]
    after = _params(model)
    assert live.apply_pending() == []
    assert all(torch.equal(p.detach(), after[name]) for name, p in model.named_parameters())
    assert live.outer.rounds == 1
    # the next snapshot holds exactly the one step taken after the used snapshot
    snapshot = live.delta_snapshot()
    assert snapshot.steps == 1 and snapshot.samples == BATCH


def test_an_anchor_shift_moves_anchor_and_model_together_and_keeps_the_pseudo_gradient() -> None:
    model, live = _live()
    for seed in range(2):
        _step(model, live, seed)
    before = live.delta_snapshot()
    anchor = live.anchor_snapshot()
    shift = {name: torch.full_like(t, 0.25) for name, t in anchor.items()}
    live.queue(Update("anchor", shift=shift))
    assert live.anchor_snapshot() is None
    live.apply_pending()
    after = live.delta_snapshot()
    for name in shift:
        assert torch.allclose(live.outer.anchor[name], anchor[name] + 0.25)
        assert torch.allclose(after.mean[name], before.mean[name], atol=1e-7)


def test_a_solo_round_uses_every_held_step() -> None:
    model, live = _live()
    for seed in range(3):
        _step(model, live, seed)
    expected = _params(model)
    update = Update("solo")
    live.queue(update)
    live.apply_pending()
    assert live.steps == 0 and update.steps == 3 and update.info["weight"] == 3 * BATCH
    for name, p in model.named_parameters():  # lr 1, no momentum: a lone peer is plain local training
        assert torch.allclose(p.detach(), expected[name], atol=1e-6)
        assert torch.allclose(live.outer.anchor[name], expected[name], atol=1e-6)


def test_pair_exchanges_conserve_the_swarm_s_total_progress() -> None:
    """Both sides apply the pair mean: the anchors' total movement equals all steps taken, once.

    A naive mix (the initiator applies the pair mean, the served side drops it) loses the served
    side's steps, and weighting a sum of k steps by k samples counts it k^2: both fail here.
    """
    models, lives = zip(*(_live(seed=i) for i in range(2)), strict=True)
    start = [_params(m) for m in models]
    produced = {name: torch.zeros_like(t) for name, t in start[0].items()}
    for i, steps in enumerate((5, 2)):  # a fast and a slow peer
        for seed in range(steps):
            for name, move in _step(models[i], lives[i], 100 * i + seed).items():
                produced[name] += move
    snapshots = [live.delta_snapshot() for live in lives]
    weights = [s.samples for s in snapshots]
    pair = (weights[0] + weights[1]) / 2
    for i, live in enumerate(lives):
        mixed = {
            name: (weights[0] * snapshots[0].mean[name] + weights[1] * snapshots[1].mean[name])
            / (weights[0] + weights[1])
            for name in produced
        }
        consumed = {name: t * snapshots[i].samples for name, t in snapshots[i].mean.items()}
        gradient = {name: t * pair for name, t in mixed.items()}
        live.queue(Update("delta", gradient=gradient, consumed=consumed, steps=snapshots[i].steps))
        live.apply_pending()
    for name in produced:
        moved = sum(live.outer.anchor[name] - start[i][name] for i, live in enumerate(lives))
        assert torch.allclose(moved, produced[name], atol=1e-5)
        assert torch.allclose(
            lives[0].outer.anchor[name],
            lives[1].outer.anchor[name] + start[0][name] - start[1][name],
            atol=1e-5,
        )


def test_snapshots_taken_during_training_are_never_torn() -> None:
    """Another thread snapshotting while the training thread steps sees whole steps only."""
    model, live = _live()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    live.outer.reset_anchor()
    stop = threading.Event()
    seen: list[tuple[int, float]] = []

    def snapshot_forever() -> None:
        while not stop.is_set():
            snap = live.delta_snapshot()
            if snap is not None:
                values = torch.cat([t.flatten() * snap.samples for t in snap.mean.values()])
                seen.append((snap.steps, float(values.min()), float(values.max())))

    reader = threading.Thread(target=snapshot_forever)
    reader.start()
    taken, hang_bound = 0, time.monotonic() + 120
    try:  # at least 300 steps, and on until the reader, however rarely it is scheduled, saw 20 snapshots
        while taken < 300 or len(seen) < 20:
            assert time.monotonic() < hang_bound, f"the reader got {len(seen)} snapshots in {taken} steps"
            with live.updating(), torch.no_grad():
                for p in model.parameters():
                    p.sub_(1.0)  # every step moves every parameter by exactly -1
            taken += 1
    finally:
        stop.set()
        reader.join()
    assert seen, "the reader never got a snapshot"
    for steps, low, high in seen:  # anchor - params == steps in every coordinate
        assert low == pytest.approx(steps) and high == pytest.approx(steps)


def test_probe_positions_are_the_same_on_every_peer_and_spread_over_all_parameters() -> None:
    sizes = {"b": 10, "a": 1000, "c": 5000}
    first, again = probe_positions(sizes, count=64), probe_positions(dict(reversed(sizes.items())), count=64)
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    assert sum(len(p) for p in first.values()) == 64
    assert all(int(p.max()) < sizes[name] and int(p.min()) >= 0 for name, p in first.items())
    assert len(first["c"]) > len(first["a"])  # uniform over elements, not tensors


def test_probe_distance_estimates_the_relative_distance_and_refuses_mismatched_probes() -> None:
    torch.manual_seed(0)
    a = torch.randn(100_000)
    b = a + 0.1 * torch.randn(100_000)
    positions = probe_positions({"w": a.numel()}, count=128)["w"]
    estimate = probe_distance(tuple(a[positions].tolist()), tuple(b[positions].tolist()))
    true = float((a - b).norm() / a.norm())
    assert estimate == pytest.approx(true, rel=0.25)
    assert probe_distance((1.0, 2.0), (1.0,)) is None and probe_distance((), ()) is None


def test_non_finite_parameters_never_reach_the_anchor_and_roll_back_to_it() -> None:
    model, live = _live()
    _step(model, live, 0)
    anchor = {name: t.clone() for name, t in live.outer.anchor.items()}
    solo = Update("solo")
    live.queue(solo)  # a round with no partner, queued before the parameters went bad ...
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert live.delta_snapshot() is None  # ... never offered to a partner
    live.apply_pending()  # ... and applied after: it must not carry the NaN into the anchor
    assert all(torch.equal(live.outer.anchor[n], anchor[n]) for n in anchor) and solo.steps == 0
    assert live.rollback()
    assert all(torch.equal(p.detach(), anchor[n]) for n, p in model.named_parameters())
    assert live.steps == 0 and live.delta_snapshot() is None


def test_overlapping_exchanges_share_one_model_snapshot_until_an_update_is_applied() -> None:
    """A served exchange and our own may overlap: the second gets the snapshot the first still holds
    (one compact copy, not two), until an update changes the anchor; then a fresh one."""
    model, live = _live(lr=0.7, momentum=0.9)
    offers = ModelOffers(live)
    _step(model, live, 0)
    first = offers.offer()
    _step(model, live, 1)  # training goes on while the first exchange runs
    second = offers.offer()
    assert second.token is first.token and second.token.steps == 1
    assert all(t.dtype == torch.bfloat16 for t in first.token.progress.values())  # 2 bytes a parameter
    live.queue(Update("solo"))
    live.apply_pending()
    third = offers.offer()
    assert third.token is not first.token and third.token.version > first.token.version
    for offer in (first, second, third):
        offers.released(offer)
    assert not offers.in_flight()
    _step(model, live, 2)
    assert offers.offer().token.steps == 1  # nothing held any more: a fresh snapshot, without an apply


def test_a_model_snapshot_is_the_anchor_plus_its_rounded_progress_and_the_update_keeps_the_rest() -> None:
    """The offered model is ``anchor + bf16(params - anchor)``; applying the pair's mean moves the
    parameters to ``new anchor + (params - offered)``: the rounding stays in our parameters."""
    model, live = _live()
    for seed in range(3):
        _step(model, live, seed)
    offer = ModelOffers(live).offer()
    offered = dict(offer.tensors)
    before = _params(model)
    for name in before:
        assert torch.equal(offered[name], live.outer.anchor[name] + offer.token.progress[name].float())
        assert float((offered[name] - before[name]).abs().max()) < 1e-3  # bf16 of a small progress
    partner = {name: t + 0.1 for name, t in offered.items()}
    mean = {name: (offered[name] + partner[name]) / 2 for name in offered}
    result = SyncResult(SyncOutcome.OK, "partner", 0, 0, 0.0, 1.0)
    ModelOffers(live).committed(offer, Committed(mean, 1.0, True, result))
    live.apply_pending()
    for name, p in model.named_parameters():  # lr 1, no momentum: the anchor is the mean
        assert torch.allclose(live.outer.anchor[name], mean[name], atol=1e-6)
        assert torch.allclose(p.detach(), mean[name] + (before[name] - offered[name]), atol=1e-6)


def test_a_lazy_anchor_offer_reads_the_live_anchor_and_counts_while_an_exchange_holds_it() -> None:
    """A model-exchanging peer serves joiners its anchor in place (no copy): while such an offer is
    held the trainer takes no solo step (that would move the anchor under the exchange)."""
    _, live = _live()
    offers = AnchorOffers(live, lazy=True)
    offer = offers.offer()
    assert offers.in_flight()
    assert all(offer.tensors[n] is live.outer.anchor[n] for n in live.outer.anchor)  # the live tensors
    offers.released(offer)
    assert not offers.in_flight()
    copied = AnchorOffers(live).offer()
    assert all(copied.tensors[n] is not live.outer.anchor[n] for n in live.outer.anchor)
