"""A partner's stated weight is a claim nothing checks: it must not scale what we apply.

A HELLO may state any weight below 1e30 (``swarm.gossip._protocol``). The committed mix weights the
partner by it, and the pseudo-gradient rule multiplied the mixed mean by the pair's mean weight: a
partner claiming 1e29 samples made our outer step 1e29 times its size. The offerers cap a partner's
weight at most as much as ours (``swarm.trainer._offers.checked_weight``).
"""

from __future__ import annotations

import torch

from swarm.gossip import Committed, Offer, SyncOutcome, SyncResult
from swarm.learning import OuterOptimizer
from swarm.trainer._live import LiveModel
from swarm.trainer._offers import MAX_WEIGHT_RATIO, DeltaOffers, ModelOffers

CLAIM = 1e29


def _offered(
    offerer: type[DeltaOffers] | type[ModelOffers], steps: int
) -> tuple[LiveModel, DeltaOffers | ModelOffers, Offer]:
    """A model trained ``steps`` inner steps, its ``offerer`` and that offerer's first offer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    live = LiveModel(model, OuterOptimizer(model, lr=1.0, momentum=0.0), 2)
    for _ in range(steps):
        with live.updating(), torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    offers = offerer(live)
    offer = offers.offer()
    assert offer is not None
    return live, offers, offer


def _committed(mixed: dict[str, torch.Tensor], partner_weight: float) -> Committed:
    result = SyncResult(SyncOutcome.OK, "liar", 0, 0, 0.0, 1.0)
    return Committed(mixed, partner_weight, True, result)


def _anchor_move(live: LiveModel, before: dict[str, torch.Tensor]) -> float:
    return max(float((live.outer.anchor[n] - t).abs().max()) for n, t in before.items())


def test_a_claimed_weight_cannot_scale_the_applied_pseudo_gradient() -> None:
    live, offers, offer = _offered(DeltaOffers, 3)
    before = {n: t.clone() for n, t in live.outer.anchor.items()}
    # the mix as the averager computes it with the claimed weight: almost all the partner's mean,
    # which the robust clip keeps near ours (here: equal to ours, the most harmless-looking case)
    mixed = {n: t.clone() for n, t in offer.tensors.items()}
    offers.committed(offer, _committed(mixed, CLAIM))
    live.apply_pending()
    own_step = max(float(t.abs().max()) for t in offer.tensors.values()) * offer.weight
    # the partner counts at most MAX_WEIGHT_RATIO times our samples: a bounded step, not 1e29 of it
    assert _anchor_move(live, before) <= own_step * (1 + MAX_WEIGHT_RATIO) / 2 * 1.0001
    assert all(torch.isfinite(t).all() for t in live.outer.anchor.values())


def test_a_claimed_weight_cannot_pull_our_model_past_the_pair_mean() -> None:
    live, offers, offer = _offered(ModelOffers, 2)
    ours = {n: t.clone() for n, t in offer.tensors.items()}  # the offer's tensors are used up on apply
    theirs = {n: t + 1.0 for n, t in ours.items()}
    share = CLAIM / (offer.weight + CLAIM)  # how the averager weighted the liar: all of it
    mixed = {n: offer.tensors[n] + share * (theirs[n] - offer.tensors[n]) for n in theirs}
    offers.committed(offer, _committed(mixed, CLAIM))
    live.apply_pending()
    for name, anchor in live.outer.anchor.items():
        halfway = (ours[name] + theirs[name]) / 2  # an equal share, not theirs outright
        assert torch.allclose(anchor, halfway, atol=1e-5)
