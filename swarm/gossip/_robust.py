"""Robust mixing: the pairwise centred clip of a gossip exchange, and how it judges the partner.

Pairwise rule (see docs/gossip.md, "Malicious partners"). A side holds ``x`` with weight ``w``, sent
``q`` (what its frames decode to) and received the partner's ``p`` with weight ``v``::

    d   = p - q
    tau = clip_ratio * max(min(||q||, ||p||), clip_floor)
    s   = min(1, tau / ||d||)
    x'  = x + s * v / (w + v) * d          (weights unchanged)

Both sides know ``q`` and ``p`` bit for bit (the sender decodes its own frames), so both compute the
same ``tau`` and ``s`` and clip the same difference with opposite signs: ``w x + v y`` is conserved
exactly, whether anything was clipped or not. Taking the *smaller* norm keeps the bound relative to
our own tensor whatever the partner sends (a huge ``p`` makes ``tau`` ours), and the step never
exceeds ``tau`` whatever weight the partner claims. Norms are L2 over all tensors, in float32
accumulated in blocks (:func:`swarm.gossip._validation.tensor_norm`): no float64 (MPS has none).

Blame is local and judged per stated sample: ``excess`` is ``||d||`` over the radius that our own norms
and the two stated sample counts (weights ``w``, ``v``) make plausible::

    radius = blame_ratio * max(own, reference, clip_floor) * sqrt((1 + w / v) / 2)

``own`` is ``||q||`` unless the offer states what an honest partner's tensors may differ from ours by
(``blame_norm``): a model exchange sends parameters, whose norm says nothing about how far two honest
models are apart, so it is judged against our own progress since the last consensus, ``||theta -
anchor||``, with the pseudo-gradient's ratio (two honest models differ by about the difference of
their progress, as two pseudo-gradients do). ``blame_ratio`` is ``clip_ratio`` unless set. Its
clip radius follows progress too, as ClippedGossip's does: ``tau`` is at most :data:`PROGRESS_CLIP`
plausible radii, so a push moves us by about one round's progress at most, never by a share of the
parameters' norm. Such an exchange also reports how far its mix moved us (``ClipStats.moved``: the
clipped difference times the partner's share, its weight counted at most as ours), which later
exchanges with *other* partners are judged against too (``reference``): while the swarm is visibly
out of consensus (a partition healing, a straggler catching up), our own consensus steps are large,
and honest partners are as far from us as those steps say; in consensus they are small and the
progress rules. A partner never raises the reference it is judged against itself, so pushes
interleaved with tiny-weight "pumps" or with quiet exchanges gain it nothing.

The last factor widens the radius for a partner stating fewer samples than ours (the noise of a mean
over ``n`` samples shrinks as ``1 / sqrt(n)``); a model offer states weight 1 like ours, so it is 1.
``reference`` is the largest ``own`` (or, for a model exchange, step) of recent exchanges. The
partner is *suspect* when ``excess`` exceeds ``hard_factor``; smaller excesses count too, accumulated
over exchanges (``swarm.gossip._reputation``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm.gossip._validation import distance, norm_of


@dataclass(frozen=True)
class ClipPolicy:
    """Parameters of the pairwise clip; see the module docstring."""

    clip_ratio: float = 2.0
    clip_floor: float = 1e-8
    hard_factor: float = 10.0
    join_weight: float = 1e-6
    """An exchange where one side states a weight of at most this is a joiner taking over its
    partner's tensors, not an average: it is not clipped. (The other side moves by at most that weight's
    share; a partner claiming a *huge* weight instead is clipped as usual.)"""
    blame_ratio: float | None = None
    """The radius's multiple of our own norm when judging the partner (None: ``clip_ratio``)."""

    def __post_init__(self) -> None:
        if self.blame_ratio is not None and not self.blame_ratio > 0:
            raise ValueError(f"need blame_ratio > 0, got {self.blame_ratio}")
        if not (self.clip_ratio > 0 and self.clip_floor >= 0 and self.hard_factor >= 1):
            raise ValueError(
                f"need clip_ratio > 0, clip_floor >= 0, hard_factor >= 1; got {self.clip_ratio}, "
                f"{self.clip_floor}, {self.hard_factor}"
            )


@dataclass(frozen=True)
class ClipStats:
    """What the clip did to one exchange.

    ``scale`` is ``s`` (1.0: nothing clipped); ``excess`` is ``||d||`` over the radius our own norms and
    the stated sample counts make plausible (module docstring); ``hard`` is ``excess > hard_factor``:
    the partner is suspect. ``own_norm`` is the norm blamed against (``||q||`` or the offer's
    ``blame_norm``), for the caller's reference. ``judged`` is False
    when no clip was computed (a joiner's weight): then the exchange says nothing
    about the partner either way.
    """

    scale: float
    excess: float
    hard: bool
    own_norm: float
    judged: bool = True
    moved: float = 0.0
    """Where the offer stated a ``blame_norm`` (a model exchange; else 0): how far the mix moves us,
    ``s ||d||`` times the partner's share with its weight counted at most as ours
    (:func:`capped_share`), kept with ``own_norm`` as a reference for later exchanges with *other*
    partners (``swarm.gossip._reputation``). A partner stating a tiny weight (a pump) moves it as
    little as it moves us; one claiming a huge weight no more than an equal partner."""

    @property
    def clipped(self) -> bool:
        return self.scale < 1.0


@dataclass(frozen=True)
class Blame:
    """What one exchange's partner is judged against: ``reference``, the largest norm we were judged
    against in recent exchanges, and ``own``, the offer's ``blame_norm`` (None: the norm we sent)."""

    reference: float = 0.0
    own: float | None = None


NO_BLAME = Blame()


def plausible_spread(weights: tuple[float, float]) -> float:
    """``sqrt((1 + w / v) / 2)`` for weights ``(w, v)`` (ours, the partner's): how much wider than for
    equal weights the honest difference of two per-sample means can be (module docstring)."""
    ours, theirs = weights
    if not (ours > 0 and theirs > 0):
        return 1.0
    return math.sqrt((1.0 + ours / theirs) / 2.0)


def clip_scale(
    sent: Mapping[str, torch.Tensor],
    received: Mapping[str, torch.Tensor],
    policy: ClipPolicy,
    reference: float = 0.0,
    weights: tuple[float, float] = (1.0, 1.0),
    blame_norm: float | None = None,
) -> ClipStats:
    """The shared clip factor ``s`` of an exchange (identical on both sides) and our local suspicion,
    judged per stated sample of ``weights`` (ours, the partner's) against ``blame_norm`` (None:
    ``||q||``) or ``reference``, whichever is larger (module docstring)."""
    norms = PairNorms(norm_of(sent), norm_of(received), distance(sent, received))
    return clip_stats(norms, policy, reference, weights, blame_norm)


@dataclass(frozen=True)
class PairNorms:
    """What the clip needs of an exchange: ``||q||`` (``sent``), ``||p||`` and ``||p - q||``, over all
    tensors."""

    sent: float
    received: float
    diff: float


def clip_stats(
    norms: PairNorms,
    policy: ClipPolicy,
    reference: float = 0.0,
    weights: tuple[float, float] = (1.0, 1.0),
    blame_norm: float | None = None,
) -> ClipStats:
    """:func:`clip_scale` from the exchange's norms; a side whose weight is at most
    ``policy.join_weight`` is a joiner taking over: not clipped, and not judged."""
    if min(weights) <= policy.join_weight:
        own = norms.sent if blame_norm is None else blame_norm
        return ClipStats(scale=1.0, excess=0.0, hard=False, own_norm=own, judged=False)
    own, theirs, diff = norms.sent, norms.received, norms.diff
    tau = policy.clip_ratio * max(min(own, theirs), policy.clip_floor)
    blamed = own if blame_norm is None else blame_norm
    ratio = policy.clip_ratio if policy.blame_ratio is None else policy.blame_ratio
    own_radius = ratio * max(blamed, reference, policy.clip_floor) * plausible_spread(weights)
    if blame_norm is not None:  # a model exchange: the step follows progress, not the parameters' norm
        tau = min(tau, PROGRESS_CLIP * own_radius)
    scale = 1.0 if diff <= tau else tau / diff
    excess = diff / own_radius if own_radius > 0 else (math.inf if diff > 0 else 0.0)
    moved = 0.0 if blame_norm is None else scale * diff * capped_share(weights)
    hard = excess > policy.hard_factor
    return ClipStats(scale=scale, excess=excess, hard=hard, own_norm=blamed, moved=moved)


PROGRESS_CLIP = 2.0
"""A model exchange's difference is clipped to this many plausible radii (ClippedGossip's rule: the
radius follows progress). Honest excesses stay far below it (median 0.18, p99 0.71 in a clean swarm;
1.4-2.2 while a partition heals), so an honest mix is rarely cut, while a push can move us by at most
about one honest round's progress per exchange, not a share of the parameters' norm."""


def capped_share(weights: tuple[float, float]) -> float:
    """The partner's share of a mix, its stated weight counted at most as ours: ``min(v, w) / (w +
    min(v, w))``, at most 1/2. What ``moved`` is scaled by, so that a partner stating a tiny weight
    moves the reference as little as it moves us, and one claiming a huge weight no more than an
    equal partner."""
    ours, theirs = weights
    capped = min(ours, theirs)
    return capped / (ours + capped) if ours + capped > 0 else 0.0
