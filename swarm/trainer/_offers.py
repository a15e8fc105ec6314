"""What a gossip trainer offers to an exchange, and what it does with a committed result.

The averagers ask for a fresh snapshot for every exchange, initiated or served, and report the mixed
result back instead of writing into live tensors (docs/gossip.md, "Offerers"). Both sides of an
exchange use what they received.

The model averager's offer (:class:`ModelOffers`) is our parameters at weight 1, and the mix is the
pair's mean model: one tensor set each way carries both sides' progress and the anchors' gap
(docs/gossip.md, "The rule"). The anchor averager's (:class:`AnchorOffers`) is our anchor; it serves
joiners, which take a partner's state over at a negligible weight.

A partner's stated weight is its own claim: nothing we receive proves it. Where it scales what we
apply it is capped: an honest offer's weight is 1, like ours, so a partner counts at most as much as
we do (:func:`equal_share_scale`, :func:`anchor_pull`). A HELLO claiming 1e29 pulls us to the pair's
mean, never past it to the partner's model.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping

import torch

from swarm.gossip import Committed, Offer
from swarm.trainer._live import LiveModel, ModelSnapshot, Tensors, Update, relative_norm


class _Held:
    """Counts the offers that exchanges hold now; :meth:`settled` gives one back, after queueing what
    a committed exchange changes (:meth:`_committed`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0

    def settled(self, offer: Offer, exchange: Committed | None) -> None:
        if exchange is not None:
            self._committed(offer, exchange)
        with self._lock:
            self._holders -= 1
            if not self._holders:
                self._all_released()

    def _committed(self, offer: Offer, exchange: Committed) -> None:
        """What a committed exchange changes here."""

    def _all_released(self) -> None:
        """Called (under the lock) when the last held offer came back."""

    def in_flight(self) -> bool:
        """Whether an exchange still holds one of our offers. If it reads our live anchor, our own
        round then takes no outer step on its own (a solo round): that would move the anchor under
        it and stop it, while it is usually the partner's exchange (or a joiner's) that made ours
        find the partner busy or missing."""
        with self._lock:
            return self._holders > 0


class ModelOffers(_Held):
    """Offers a copy of our parameters; a committed exchange becomes a ``model`` update: the outer step
    along ``anchor - mean`` (with outer lr 1 and no momentum: the pair's mean model), keeping the steps
    taken since the snapshot.

    ``round`` is our position in the partner schedule: every exchange, either side, counts one, and
    the offer's probe carries it so that the pair leaves with the same count (the larger one plus
    one), which keeps a swarm's hypercube rounds aligned after joins and missed exchanges.
    """

    def __init__(self, live: LiveModel) -> None:
        super().__init__()
        self._live = live
        self.round = 0
        self._shared: ModelSnapshot | None = None
        """The snapshot the exchanges in flight hold (a served exchange and our own may overlap: they
        share it)."""
        self.accepting = True
        """False while we hold no swarm state (a joiner whose adoption failed): nothing is offered."""

    def offer(self) -> Offer | None:
        if not self.accepting:
            return None
        with self._lock:
            snapshot = self._live.model_snapshot(reuse=self._shared)
            if snapshot is None:
                return None
            self._shared = snapshot
            self._holders += 1
        return Offer(
            tensors=snapshot.params,
            weight=ANCHOR_WEIGHT,
            token=snapshot,
            probe=(float(self.round),),
            blame_norm=snapshot.progress_norm,
        )

    def _all_released(self) -> None:
        self._shared = None

    def _committed(self, offer: Offer, exchange: Committed) -> None:
        """Queue the update; it reads the mix tensor by tensor when applied (and folds our error
        feedback then), so no whole mean model is ever held."""
        snapshot = offer.token
        self.round = max(self.round, partner_round(exchange.partner_probe)) + 1
        mixed = exchange.mixed
        mixed.keep()
        mean = mixed.scaled(equal_share_scale(offer.weight, exchange.partner_weight))
        drift = 2 * mean.pull_norm() / max(mixed.local_norm() * exchange.clip_scale, 1e-12)
        info = _info(exchange, weight=float(snapshot.steps * self._live.samples_per_step), drift=drift)
        self._live.queue(Update("model", gradient=mean, snapshot=snapshot, steps=snapshot.steps, info=info))


MAX_ROUND = 2**40
"""A partner's stated schedule round above this (or not a whole number) is ignored."""


def partner_round(probe: tuple[float, ...]) -> int:
    """The schedule round a model offer's probe states, or 0 if it states none we believe."""
    if len(probe) != 1 or not math.isfinite(probe[0]) or not 0 <= probe[0] <= MAX_ROUND:
        return 0
    return int(probe[0]) if probe[0] == int(probe[0]) else 0


def equal_share_scale(own_weight: float, partner_weight: float) -> float:
    """How much to scale the pull ``mixed - ours`` of a mix at the partner's stated weight, so that it
    counts at most as ours (the claim is unchecked): from share ``v / (w + v)`` to ``min(v, w) / (w +
    min(v, w))``. The distance of the two models before the exchange is then twice our move over the
    clip's factor."""
    capped = min(partner_weight, own_weight)
    return (capped / (own_weight + capped)) / (partner_weight / (own_weight + partner_weight))


class AnchorOffers(_Held):
    """Offers our anchor; a committed exchange shifts our anchor (and model) by its pull.

    The offer reads the live anchor in place (:meth:`LiveModel.anchor_view`): a joiner's exchange
    leaves it unchanged, so that serving one costs no memory.

    ``weight`` is 1 between peers (the pair's mean); a joiner sets a tiny weight to take over its
    partner's parameters. The shift also measures drift: with partner share ``s = v / (w + v)`` and the
    robust clip's factor ``c``, the distance to the partner before the exchange is ``|shift| / (s c)``,
    reported relative to our anchor.
    """

    def __init__(self, live: LiveModel) -> None:
        super().__init__()
        self._live = live
        self.weight = ANCHOR_WEIGHT

    def offer(self) -> Offer | None:
        with self._lock:
            anchor = self._live.anchor_view()
            if anchor is None:
                return None
            self._holders += 1
            return Offer(tensors=anchor, weight=self.weight)

    def _committed(self, offer: Offer, exchange: Committed) -> None:
        if exchange.mixed.unchanged:
            return  # a joiner took our anchor over: nothing moved here
        shift, drift = anchor_pull(offer.tensors, offer.weight, exchange)
        self._live.queue(
            Update("anchor", shift=shift, info=_info(exchange, weight=offer.weight, drift=drift))
        )


ANCHOR_WEIGHT = 1.0
"""An anchor's weight between peers: each side counts alike, so the pull goes to the pair's mean."""


def anchor_pull(
    ours: Mapping[str, torch.Tensor], own_weight: float, exchange: Committed
) -> tuple[Tensors, float]:
    """How far an anchor exchange moved our anchor snapshot (``mixed - ours``, reusing the mixed
    tensors), and the distance to the partner's anchor before it, relative to ours: with partner share
    ``s = v / (w + v)`` and clip factor ``c`` that distance is ``|shift| / (s c)``.

    The partner's stated weight counts at most :data:`ANCHOR_WEIGHT` (an honest anchor's): the mix was
    made at its claim, so the shift is scaled back to the capped share. A claim of 1e29 pulls us to
    the pair's mean, never past it to the partner's anchor."""
    partner_weight, mixed = exchange.partner_weight, exchange.mixed
    capped = min(partner_weight, ANCHOR_WEIGHT)
    rescale = equal_share_scale_to(own_weight, partner_weight, capped)
    shift = {name: mixed[name].sub_(before).mul_(rescale) for name, before in ours.items()}
    share = capped / (own_weight + capped)
    return shift, relative_norm(shift, ours) / max(share * exchange.clip_scale, 1e-12)


def equal_share_scale_to(own_weight: float, partner_weight: float, capped: float) -> float:
    """The factor from the share a mix gave the partner's stated weight, ``v / (w + v)``, to the share
    of ``capped``, ``c / (w + c)`` (1 when nothing was capped)."""
    if capped >= partner_weight:
        return 1.0
    return (capped / (own_weight + capped)) / (partner_weight / (own_weight + partner_weight))


def _info(exchange: Committed, **extra: object) -> dict[str, object]:
    result = exchange.result
    return {
        "outcome": result.outcome.value,
        "partner": result.partner,
        "bytes_sent": result.bytes_sent,
        "bytes_received": result.bytes_received,
        "role": "initiator" if exchange.initiator else "responder",
        **extra,
    }
