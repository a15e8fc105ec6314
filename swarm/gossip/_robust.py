"""Robust aggregation: a pairwise centred clip for gossip exchanges, and CenteredClip for many inputs.

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

Both tensors are per-sample means; the noise of a mean over ``n`` samples shrinks as ``1 / sqrt(n)``, so
with ``||q||^2 >= noise^2 / w`` the difference of two honest means is at most about
``||q|| sqrt(1 + w / v)``. A partner stating few samples (it synced a step ago) may differ more; one
stating many must be close to us. The last factor is 1 for equal weights. ``reference`` is the largest
``own`` (or, for a model exchange, step) of recent exchanges. The partner is *suspect* when ``excess``
exceeds ``hard_factor``; smaller excesses count too, accumulated over exchanges
(``swarm.gossip._reputation``).

:func:`centered_clip` is the iterative CenteredClip of Karimireddy, He and Jaggi (2021) for three or
more contributions (e.g. several donors' state snapshots).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from swarm.gossip._validation import distance, norm_of, tensor_norm


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
    when no clip was computed (a joiner's weight, :func:`robust_mix`): then the exchange says nothing
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


def centered_clip(
    points: Sequence[torch.Tensor],
    weights: Sequence[float] | None = None,
    *,
    tau: float | None = None,
    iterations: int = 20,
    tol: float = 1e-7,
) -> torch.Tensor:
    """Iterative CenteredClip: ``v <- v + sum_i w_i clip_tau(x_i - v) / sum_i w_i``, from the median.

    Starts at the coordinate-wise median. ``tau=None`` takes the median distance of the points to
    that start, so that at most about half the points are clipped in the first iteration: with
    honest points close together and a minority far away, the far ones move the result by at most
    ``tau`` times their weight share. With two points (no majority) it returns their weighted mean.
    Computes in float32 (no float64: MPS has none) and returns values in the points' dtype.
    """
    if not points:
        raise ValueError("centered_clip needs at least one point")
    shape, dtype = points[0].shape, points[0].dtype
    if any(p.shape != shape for p in points):
        raise ValueError("centered_clip: all points must have the same shape")
    stacked = torch.stack([p.detach().float().reshape(-1) for p in points])
    w = torch.tensor([1.0] * len(points) if weights is None else list(weights), dtype=torch.float32)
    if w.shape != (len(points),) or not bool((w > 0).all()) or not bool(torch.isfinite(w).all()):
        raise ValueError("centered_clip: weights must be one finite positive number per point")
    w = (w / w.sum()).to(stacked.device)
    if len(points) <= 2:
        return (w @ stacked).reshape(shape).to(dtype)
    center = stacked.median(dim=0).values
    if tau is None:
        tau = float(_row_norms(stacked - center).median())
    for _ in range(iterations):
        diffs = stacked - center
        norms = _row_norms(diffs)
        factors = torch.where(norms > tau, tau / norms.clamp_min(1e-30), torch.ones_like(norms))
        step = (w * factors) @ diffs
        center = center + step
        if tensor_norm(step) <= tol * max(tensor_norm(center), 1e-12):
            break
    return center.reshape(shape).to(dtype)


def _row_norms(rows: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each row, accumulated in blocks (:func:`tensor_norm`)."""
    return torch.tensor([tensor_norm(row) for row in rows], dtype=torch.float32, device=rows.device)


def centered_clip_named(
    states: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float] | None = None,
    *,
    tau: float | None = None,
    iterations: int = 20,
    tol: float = 1e-7,
) -> dict[str, torch.Tensor]:
    """:func:`centered_clip` per tensor name (scales differ between tensors, e.g. weights and momenta).

    Non-floating-point tensors (counters) are taken from the first state.
    """
    if not states:
        raise ValueError("centered_clip_named needs at least one state")
    out = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            out[name] = first.clone()
            continue
        out[name] = centered_clip([s[name] for s in states], weights, tau=tau, iterations=iterations, tol=tol)
    return out
