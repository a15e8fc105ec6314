"""A partner's stated weight is a claim nothing checks: it must not scale what we apply.

A HELLO may state any weight below 1e30 (``swarm.gossip._protocol``). The committed mix weights the
partner by it: a partner claiming 1e29 would pull us onto its model outright. The offerers count a
partner's weight at most as much as ours (``swarm.trainer._offers.equal_share_scale``).
"""

from __future__ import annotations

import torch

from swarm.gossip import Committed, Offer, SyncOutcome, SyncResult
from swarm.learning import OuterOptimizer
from swarm.trainer._live import LiveModel
from swarm.trainer._offers import ModelOffers
from tests._mixing import computed

CLAIM = 1e29


def _offered(steps: int) -> tuple[LiveModel, ModelOffers, Offer]:
    """A model trained ``steps`` inner steps, its offerer and that offerer's first offer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    live = LiveModel(model, OuterOptimizer(model, lr=1.0, momentum=0.0), 2)
    for _ in range(steps):
        with live.updating(), torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
    offers = ModelOffers(live)
    offer = offers.offer()
    assert offer is not None
    return live, offers, offer


def _committed(offer: Offer, mixed: dict[str, torch.Tensor], partner_weight: float) -> Committed:
    """The exchange of ``offer`` as the averager commits it: ``mixed`` against what we offered."""
    result = SyncResult(SyncOutcome.OK, "liar", 0, 0, 0.0, 1.0)
    return Committed(computed(offer.tensors, mixed), partner_weight, True, result)


def _anchor_move(live: LiveModel, before: dict[str, torch.Tensor]) -> float:
    return max(float((live.outer.anchor[n] - t).abs().max()) for n, t in before.items())


def test_a_claimed_weight_cannot_pull_our_model_past_the_pair_mean() -> None:
    live, offers, offer = _offered(2)
    ours = {n: t.clone() for n, t in offer.tensors.items()}  # the offer's tensors are used up on apply
    theirs = {n: t + 1.0 for n, t in ours.items()}
    share = CLAIM / (offer.weight + CLAIM)  # how the averager weighted the liar: all of it
    mixed = {n: offer.tensors[n] + share * (theirs[n] - offer.tensors[n]) for n in theirs}
    offers.settled(offer, _committed(offer, mixed, CLAIM))
    live.apply_pending()
    for name, anchor in live.outer.anchor.items():
        halfway = (ours[name] + theirs[name]) / 2  # an equal share, not theirs outright
        assert torch.allclose(anchor, halfway, atol=1e-5)
