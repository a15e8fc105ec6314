"""What a gossip trainer offers to an exchange, and what it does with a committed result.

The averagers run in offer mode (docs/gossip.md, "Offer mode"): for every exchange, initiated or
served, they ask for a fresh snapshot and report the mixed result back instead of writing into live
tensors. Both sides of an exchange use what they received.

Units (docs/training.md): a pseudo-gradient is a *sum* over the steps since the anchor. On the wire
it travels as a per-sample mean ``x = Δ / w`` with weight ``w`` = its samples, so means of peers that
took different numbers of steps are comparable (the robust clip compares their norms). The mix of a
pair is ``x' = (w x + v y) / (w + v)``; the outer gradient each side applies is ``x' (w + v) / 2 =
(Δ_a + Δ_b) / 2``: the pair's mean pseudo-gradient, in sum units, so every sample counts once.

With ``averaging.anchor_pull: folded`` the pseudo-gradient offer carries a copy of the anchor as its
companion part (weight 1, ``param_codec``, ``param_clip_ratio``): one exchange gives both the pair's
mean pseudo-gradient and the anchors' pull, applied together as one update.
"""

from __future__ import annotations

from swarm.gossip import Committed, MixedPart, Offer, Part
from swarm.trainer._live import LiveModel, Tensors, Update, probe_distance, relative_norm


class DeltaOffers:
    """Offers our pseudo-gradient snapshot; a committed exchange becomes a ``delta`` update.

    ``with_anchor`` (a folded anchor pull): the offer also carries our anchor as its companion part,
    and the update also shifts anchor and model by the anchors' pull, which measures the drift exactly.
    """

    def __init__(self, live: LiveModel, with_anchor: bool = False) -> None:
        self._live = live
        self._with_anchor = with_anchor

    def offer(self) -> Offer | None:
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
        pair_weight = (offer.weight + exchange.partner_weight) / 2
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


class AnchorOffers:
    """Offers a copy of our anchor; a committed exchange shifts our anchor (and model) by its pull.

    ``weight`` is 1 between peers (the pair's mean); a joiner sets a tiny weight to take over its
    partner's parameters. The shift also measures drift: with partner share ``s = v / (w + v)`` and the
    robust clip's factor ``c``, the distance to the partner before the exchange is ``|shift| / (s c)``,
    reported relative to our anchor.
    """

    def __init__(self, live: LiveModel) -> None:
        self._live = live
        self.weight = ANCHOR_WEIGHT

    def offer(self) -> Offer | None:
        anchor = self._live.anchor_snapshot()
        return None if anchor is None else Offer(tensors=anchor, weight=self.weight)

    def committed(self, offer: Offer, exchange: Committed) -> None:
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
    ``s = v / (w + v)`` and clip factor ``c`` that distance is ``|shift| / (s c)``."""
    shift = {name: mixed.mixed[name].sub_(before) for name, before in ours.tensors.items()}
    share = mixed.partner_weight / (ours.weight + mixed.partner_weight)
    return shift, relative_norm(shift, ours.tensors) / max(share * mixed.clip_scale, 1e-12)


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
