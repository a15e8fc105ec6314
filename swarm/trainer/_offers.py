"""What a gossip trainer offers to an exchange, and what it does with a committed result.

The averagers run in offer mode (docs/gossip.md, "Offer mode"): for every exchange, initiated or
served, they ask for a fresh snapshot and report the mixed result back instead of writing into live
tensors. Both sides of an exchange use what they received.

Units (docs/training.md): a pseudo-gradient is a *sum* over the steps since the anchor. On the wire
it travels as a per-sample mean ``x = Δ / w`` with weight ``w`` = its samples, so means of peers that
took different numbers of steps are comparable (the robust clip compares their norms). The mix of a
pair is ``x' = (w x + v y) / (w + v)``; the outer gradient each side applies is ``x' (w + v) / 2 =
(Δ_a + Δ_b) / 2``: the pair's mean pseudo-gradient, in sum units, so every sample counts once.

A partner's stated weight is its own claim: nothing we receive proves it. Where it scales what we
apply it is capped (:func:`checked_weight`): a model offer's honest weight is 1, like ours, so a
partner counts at most as much as we do; a pseudo-gradient's weight is its samples, and a partner
counts at most :data:`MAX_WEIGHT_RATIO` times our samples (peers on one run take comparable numbers
of steps a round; one that claims more is undercounted, never overcounted). A HELLO claiming 1e29
samples therefore scales our outer step by at most ``(1 + MAX_WEIGHT_RATIO) / 2``, and the robust clip
bounds the direction.

With ``averaging.exchange: model`` (:class:`ModelOffers`, the default) the offer is a copy of our
parameters at weight 1 and the mix is the pair's mean model: one tensor each way carries both the
pseudo-gradients and the anchors' gap (docs/gossip.md, "The rule").

With ``averaging.anchor_pull: folded`` the pseudo-gradient offer carries a copy of the anchor as its
companion part (weight 1, ``param_codec``, ``param_clip_ratio``): one exchange gives both the pair's
mean pseudo-gradient and the anchors' pull, applied together as one update.
"""

from __future__ import annotations

import math
import threading

from swarm.gossip import Committed, MixedPart, MixedTensors, Offer, Part
from swarm.trainer._live import (
    LiveModel,
    ModelSnapshot,
    Tensors,
    Update,
    probe_distance,
    relative_norm,
)


class DeltaOffers:
    """Offers our pseudo-gradient snapshot; a committed exchange becomes a ``delta`` update.

    ``with_anchor`` (a folded anchor pull): the offer also carries our anchor as its companion part,
    and the update also shifts anchor and model by the anchors' pull, which measures the drift exactly.
    """

    def __init__(self, live: LiveModel, with_anchor: bool = False) -> None:
        self._live = live
        self._with_anchor = with_anchor
        self.accepting = True
        """False while we hold no swarm state (a joiner whose adoption failed): nothing is offered."""

    def offer(self) -> Offer | None:
        if not self.accepting:
            return None
        snapshot = self._live.delta_snapshot(with_anchor=self._with_anchor)
        if snapshot is None:
            return None
        companion = Part(snapshot.anchor, ANCHOR_WEIGHT) if snapshot.anchor is not None else None
        return Offer(
            tensors=snapshot.mean,
            weight=float(snapshot.samples),
            token=snapshot,
            probe=snapshot.probe,
            companion=companion,
        )

    def committed(self, offer: Offer, exchange: Committed) -> None:
        snapshot = offer.token
        capped = checked_weight(exchange.partner_weight, offer.weight, MAX_WEIGHT_RATIO)
        pair_weight = (offer.weight + capped) / 2
        gradient = {name: t.mul_(pair_weight) for name, t in exchange.mixed.items()}
        consumed = {name: t.mul_(snapshot.samples) for name, t in snapshot.mean.items()}
        shift: Tensors = {}
        drift = probe_distance(offer.probe, exchange.partner_probe)
        if offer.companion is not None and exchange.companion is not None:
            shift, drift = anchor_pull(offer.companion, exchange.companion)
        info = _info(exchange, weight=offer.weight, drift=drift)
        self._live.queue(
            Update(
                "delta", gradient=gradient, consumed=consumed, steps=snapshot.steps, shift=shift, info=info
            )
        )

    def released(self, offer: Offer) -> None:
        """Nothing to give back: each offer is a copy of its own."""


class _Held:
    """Counts the offers that exchanges hold now (:meth:`Offerer.released` gives one back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0

    def released(self, offer: Offer) -> None:
        with self._lock:
            self._holders -= 1
            if not self._holders:
                self._all_released()

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

    def committed(self, offer: Offer, exchange: Committed) -> None:
        """Queue the update; it reads the mix tensor by tensor when applied (and folds our error
        feedback then), so no whole mean model is ever held."""
        snapshot = offer.token
        self.round = max(self.round, partner_round(exchange.partner_probe)) + 1
        mixed = exchange.mixed
        if not isinstance(mixed, MixedTensors):
            mixed = MixedTensors.of_values(offer.tensors, mixed)
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


MAX_WEIGHT_RATIO = 4.0
"""A partner's pseudo-gradient counts at most this many times our samples (:func:`checked_weight`)."""


def checked_weight(partner_weight: float, own_weight: float, ratio: float = 1.0) -> float:
    """A partner's stated weight, counted at most ``ratio`` times ours: the claim is unchecked."""
    return min(partner_weight, ratio * own_weight)


def equal_share_scale(own_weight: float, partner_weight: float) -> float:
    """How much to scale the pull ``mixed - ours`` of a mix at the partner's stated weight, so that it
    counts as :func:`checked_weight` says: from share ``v / (w + v)`` to ``min(v, w) / (w + min(v, w))``.
    The distance of the two models before the exchange is then twice our move over the clip's factor."""
    capped = checked_weight(partner_weight, own_weight)
    return (capped / (own_weight + capped)) / (partner_weight / (own_weight + partner_weight))


class AnchorOffers(_Held):
    """Offers our anchor; a committed exchange shifts our anchor (and model) by its pull.

    ``lazy``: the offer reads the live anchor (:meth:`LiveModel.anchor_view`) instead of a copy; for a
    peer whose anchor exchanges only serve joiners (``averaging.exchange: model``), which leave it
    unchanged, so that serving one costs no memory.

    ``weight`` is 1 between peers (the pair's mean); a joiner sets a tiny weight to take over its
    partner's parameters. The shift also measures drift: with partner share ``s = v / (w + v)`` and the
    robust clip's factor ``c``, the distance to the partner before the exchange is ``|shift| / (s c)``,
    reported relative to our anchor.
    """

    def __init__(self, live: LiveModel, lazy: bool = False) -> None:
        super().__init__()
        self._live = live
        self._lazy = lazy
        self.weight = ANCHOR_WEIGHT

    def offer(self) -> Offer | None:
        with self._lock:
            anchor = self._live.anchor_view() if self._lazy else self._live.anchor_snapshot()
            if anchor is None:
                return None
            self._holders += 1
            return Offer(tensors=anchor, weight=self.weight)

    def committed(self, offer: Offer, exchange: Committed) -> None:
        if isinstance(exchange.mixed, MixedTensors) and exchange.mixed.unchanged:
            return  # a joiner took our anchor over: nothing moved here
        mixed = MixedPart(exchange.mixed, exchange.partner_weight, exchange.clip_scale)
        shift, drift = anchor_pull(Part(offer.tensors, offer.weight), mixed)
        self._live.queue(
            Update("anchor", shift=shift, info=_info(exchange, weight=offer.weight, drift=drift))
        )


ANCHOR_WEIGHT = 1.0
"""An anchor's weight between peers: each side counts alike, so the pull goes to the pair's mean."""


def anchor_pull(ours: Part, mixed: MixedPart) -> tuple[Tensors, float]:
    """How far an anchor exchange moved our anchor snapshot (``mixed - ours``, reusing the mixed
    tensors), and the distance to the partner's anchor before it, relative to ours: with partner share
    ``s = v / (w + v)`` and clip factor ``c`` that distance is ``|shift| / (s c)``.

    The partner's stated weight counts at most :data:`ANCHOR_WEIGHT` (an honest anchor's): the mix was
    made at its claim, so the shift is scaled back to the capped share. A claim of 1e29 pulls us to
    the pair's mean, never past it to the partner's anchor."""
    capped = min(mixed.partner_weight, ANCHOR_WEIGHT)
    rescale = equal_share_scale_to(ours.weight, mixed.partner_weight, capped)
    shift = {name: mixed.mixed[name].sub_(before).mul_(rescale) for name, before in ours.tensors.items()}
    share = capped / (ours.weight + capped)
    return shift, relative_norm(shift, ours.tensors) / max(share * mixed.clip_scale, 1e-12)


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
