"""swarm.trainer._live: snapshots, queued updates, kept local progress, steps used once (no network)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarm.gossip import Committed, Offer, SyncOutcome, SyncResult
from swarm.learning import OuterOptimizer
from swarm.trainer._live import LiveModel, Update
from swarm.trainer._offers import AnchorOffers, ModelOffers
from tests._mixing import computed

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


def _offer(live: LiveModel) -> tuple[ModelOffers, Offer, dict[str, torch.Tensor]]:
    """A fresh offerer's offer of our model, and the model it offers (values, read now)."""
    offers = ModelOffers(live)
    offer = offers.offer()
    assert offer is not None
    return offers, offer, {name: t.clone() for name, t in offer.tensors.items()}


def _commit(offers: ModelOffers, offer: Offer, mean: dict[str, torch.Tensor]) -> None:
    """What the averager hands the offerer for a committed exchange whose mix is ``mean``."""
    result = SyncResult(SyncOutcome.OK, "partner", 0, 0, 0.0, 1.0)
    offers.settled(offer, Committed(computed(offer.tensors, mean), 1.0, True, result))


def test_the_overlapped_step_keeps_the_progress_made_after_the_snapshot() -> None:
    model, live = _live()
    for seed in range(3):
        _step(model, live, seed)
    offers, offer, offered = _offer(live)  # snapshot after 3 steps, exchange starts ...
    later = [_step(model, live, seed) for seed in (10, 11)]  # ... and 2 more steps run meanwhile
    before_apply = _params(model)
    mean = {name: t + 0.5 for name, t in offered.items()}
    _commit(offers, offer, mean)
    live.apply_pending()
    for name, p in model.named_parameters():
        assert torch.allclose(live.outer.anchor[name], mean[name], atol=1e-6)  # lr 1, no momentum
        since = later[0][name] + later[1][name]
        assert torch.allclose(p.detach(), mean[name] + before_apply[name] - offered[name], atol=1e-6)
        assert torch.allclose(before_apply[name] - offered[name], since, atol=1e-3)  # bf16 rounding
    assert live.steps == 2  # the two steps taken meanwhile start the next round


def test_averaging_with_our_own_model_at_lr_one_and_no_momentum_leaves_the_model_unchanged() -> None:
    model, live = _live()
    for seed in range(4):
        _step(model, live, seed)
    offers, offer, offered = _offer(live)
    _commit(offers, offer, offered)
    _step(model, live, 99)
    expected = _params(model)
    live.apply_pending()
    for name, p in model.named_parameters():
        assert torch.allclose(p.detach(), expected[name], atol=1e-6)


def test_a_queued_update_blocks_new_snapshots_and_applies_exactly_once() -> None:
    model, live = _live(lr=0.7, momentum=0.9)
    for seed in range(3):
        _step(model, live, seed)
    offers, offer, offered = _offer(live)
    _commit(offers, offer, offered)
    assert live.model_snapshot() is None, "parameters already averaged were offered again"
    _step(model, live, 5)
    assert live.model_snapshot() is None
    applied = live.apply_pending()
    assert [u.kind for u in applied] == ["model"]
    after = _params(model)
    assert live.apply_pending() == []
    assert all(torch.equal(p.detach(), after[name]) for name, p in model.named_parameters())
    assert live.outer.rounds == 1
    snapshot = live.model_snapshot()  # the next snapshot holds exactly the one step taken since
    assert snapshot is not None and snapshot.steps == 1


def test_an_anchor_shift_moves_anchor_and_model_together_and_keeps_the_progress() -> None:
    model, live = _live()
    for seed in range(2):
        _step(model, live, seed)
    before = live.model_snapshot()
    anchor = {name: t.clone() for name, t in live.outer.anchor.items()}
    shift = {name: torch.full_like(t, 0.25) for name, t in anchor.items()}
    live.queue(Update("anchor", shift=shift))
    assert live.anchor_view() is None and live.model_snapshot() is None
    live.apply_pending()
    after = live.model_snapshot()
    for name in shift:
        assert torch.allclose(live.outer.anchor[name], anchor[name] + 0.25)
        assert torch.allclose(after.progress[name].float(), before.progress[name].float(), atol=1e-3)


def test_a_pair_ends_on_its_mean_model_and_every_step_counts_once() -> None:
    """Both sides apply the pair's mean: their anchors agree, and the anchors' total movement is every
    step taken, once (a side that dropped its own progress, or counted it twice, fails here)."""
    models, lives = zip(*(_live(seed=i) for i in range(2)), strict=True)
    start = [_params(m) for m in models]
    produced = {name: torch.zeros_like(t) for name, t in start[0].items()}
    for i, steps in enumerate((5, 2)):  # a fast and a slow peer
        for seed in range(steps):
            for name, move in _step(models[i], lives[i], 100 * i + seed).items():
                produced[name] += move
    offered = [_offer(live) for live in lives]
    mean = {name: (offered[0][2][name] + offered[1][2][name]) / 2 for name in produced}
    for offers, offer, _ in offered:
        _commit(offers, offer, {name: t.clone() for name, t in mean.items()})
    for live in lives:
        live.apply_pending()
    for name in produced:
        moved = sum(live.outer.anchor[name] - start[i][name] for i, live in enumerate(lives))
        assert torch.allclose(moved, produced[name], atol=1e-3)  # bf16 progress in the offers
        assert torch.allclose(lives[0].outer.anchor[name], lives[1].outer.anchor[name], atol=1e-6)
    assert all(live.steps == 0 for live in lives)


def test_snapshots_taken_during_training_are_never_torn() -> None:
    """Another thread snapshotting while the training thread steps sees whole steps only: every
    coordinate moved by the same number of steps."""
    model, live = _live()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    live.outer.reset_anchor()
    stop = threading.Event()
    seen: list[tuple[int, float, float]] = []

    def snapshot_forever() -> None:
        while not stop.is_set():
            snap = live.model_snapshot()
            if snap is not None:
                values = torch.cat([t.float().flatten() for t in snap.progress.values()])
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
    for steps, low, high in seen:  # params - anchor == -steps in every coordinate (bf16 of it)
        assert low == high and low == pytest.approx(-steps, rel=1 / 128)


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


def test_non_finite_parameters_never_reach_the_anchor_and_roll_back_to_it() -> None:
    model, live = _live()
    _step(model, live, 0)
    anchor = {name: t.clone() for name, t in live.outer.anchor.items()}
    solo = Update("solo")
    live.queue(solo)  # a round with no partner, queued before the parameters went bad ...
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    assert live.model_snapshot() is None  # ... never offered to a partner
    live.apply_pending()  # ... and applied after: it must not carry the NaN into the anchor
    assert all(torch.equal(live.outer.anchor[n], anchor[n]) for n in anchor) and solo.steps == 0
    assert live.rollback()
    assert all(torch.equal(p.detach(), anchor[n]) for n, p in model.named_parameters())
    assert live.steps == 0 and live.model_snapshot() is not None  # the anchor, offered again


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
        offers.settled(offer, None)
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
    ModelOffers(live).settled(offer, Committed(computed(offer.tensors, mean), 1.0, True, result))
    live.apply_pending()
    for name, p in model.named_parameters():  # lr 1, no momentum: the anchor is the mean
        assert torch.allclose(live.outer.anchor[name], mean[name], atol=1e-6)
        assert torch.allclose(p.detach(), mean[name] + (before[name] - offered[name]), atol=1e-6)


def test_a_lazy_anchor_offer_reads_the_live_anchor_and_counts_while_an_exchange_holds_it() -> None:
    """A peer serves joiners its anchor in place (no copy): while such an offer is held the trainer
    takes no solo step (that would move the anchor under the exchange)."""
    _, live = _live()
    offers = AnchorOffers(live)
    offer = offers.offer()
    assert offers.in_flight()
    assert all(offer.tensors[n] is live.outer.anchor[n] for n in live.outer.anchor)  # the live tensors
    offers.settled(offer, None)
    assert not offers.in_flight()
