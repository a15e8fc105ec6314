"""swarm.gossip._robust: the pairwise centred clip and strikes for suspicious partners."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swarm.compression import get_codec
from swarm.gossip._exchange import ExchangeSpec, run_exchange
from swarm.gossip._mixing import Mixed
from swarm.gossip._partners import BanList
from swarm.gossip._protocol import Channel
from swarm.gossip._robust import ClipPolicy, clip_scale
from swarm.gossip._validation import NormPolicy
from tests._channels import channel_pair
from tests._faults import TamperingChannel
from tests._mixing import robust_mix

POLICY = ClipPolicy(clip_ratio=2.0, hard_factor=10.0)
INT8 = get_codec("int8")


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def _state(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 50, generator=g) * scale, "b": torch.randn(9, generator=g) * scale}


def _exchange(
    codec: str,
    left: dict,
    right: dict,
    weights: tuple[float, float],
    wrap: Callable[[Channel], Any] | None = None,
) -> tuple[Mixed, Mixed]:
    """One robust exchange over an in-memory stream; returns both sides' results."""

    async def scenario() -> tuple[Mixed, Mixed]:
        a, b = await channel_pair()
        c = get_codec(codec)
        spec = ExchangeSpec(codec=c, chunk_bytes=16384, policy=NormPolicy(), clip=POLICY)
        try:
            return await asyncio.gather(
                run_exchange(a if wrap is None else wrap(a), left, weights, spec, None),
                run_exchange(b, right, weights[::-1], spec, None),
            )
        finally:
            a.close()
            b.close()

    return asyncio.run(scenario())


def _mass(tensors: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
    return torch.cat([t.double().reshape(-1) for t in tensors.values()]) * weight


@pytest.mark.parametrize("codec", ["fp32", "int8"])
@pytest.mark.parametrize("far", [False, True], ids=["close", "clipped"])
def test_robust_exchange_conserves_the_pairs_mass(codec: str, far: bool) -> None:
    """Both sides clip the same difference, so w x + v y is unchanged, clipped or not, any codec."""
    left = _state(1)
    right = _state(2, scale=30.0 if far else 1.0)
    weights = (1.0, 3.0)
    mixed_a, mixed_b = _exchange(codec, left, right, weights)
    assert mixed_a.clip.scale == mixed_b.clip.scale  # the same tau on both sides
    assert mixed_a.clip.clipped == far
    assert (mixed_a.weight, mixed_b.weight) == weights  # robust mixing keeps the weights
    before = _mass(left, weights[0]) + _mass(right, weights[1])
    after = _mass(mixed_a.tensors, weights[0]) + _mass(mixed_b.tensors, weights[1])
    assert float((after - before).norm() / before.norm()) < 1e-6


def test_close_partners_are_not_clipped_and_average_exactly() -> None:
    x, y = _state(3), _state(4)
    out, stats = robust_mix(x, x, 1.0, y, 3.0, POLICY)
    assert not stats.clipped and not stats.hard
    for name in x:
        assert torch.allclose(out[name], (x[name] + 3 * y[name]) / 4, atol=1e-6)


@pytest.mark.parametrize("attack", ["scaled", "random", "huge_weight"])
def test_one_bad_partner_moves_us_at_most_tau(attack: str) -> None:
    """Damage bound: ||x' - x|| <= clip_ratio * ||x|| * v / (w + v), whatever the partner sends or claims."""
    x = _state(5)
    honest = _state(6)
    if attack == "scaled":
        theirs, weight = {n: t * 100 for n, t in honest.items()}, 1.0
    elif attack == "random":
        theirs, weight = {n: torch.randn_like(t) * 1e3 for n, t in x.items()}, 1.0
    else:
        theirs, weight = {n: t * 100 for n, t in honest.items()}, 1e12
    out, stats = robust_mix(x, x, 1.0, theirs, weight, POLICY)
    moved = _norm({n: out[n] - x[n] for n in x})
    bound = POLICY.clip_ratio * _norm(x) * weight / (1.0 + weight)
    assert moved <= bound * (1 + 1e-6)
    assert stats.clipped and stats.hard  # and the partner is suspect
    unclipped = _norm({n: theirs[n] - x[n] for n in x}) * weight / (1.0 + weight)
    assert moved < unclipped / 10  # what the plain mean would have done


def test_anchors_are_clipped_relative_to_the_parameters_and_a_joiner_adopts_unclipped() -> None:
    """The parameter exchange's policy (``averaging.param_clip_ratio``): an honest partner drifted a few
    percent away averages exactly; a poisoned anchor (x10) is clipped to a quarter of our norm and is
    suspect; a joiner (a stated weight of 1e-9) takes its partner's anchor whole."""
    anchors = ClipPolicy(clip_ratio=0.25)
    ours = _state(11, scale=10.0)
    drifted = {n: t + 0.05 * torch.randn_like(t) * t.abs().mean() for n, t in ours.items()}
    out, stats = robust_mix(ours, ours, 1.0, drifted, 1.0, anchors)
    assert not stats.clipped and not stats.hard
    assert all(torch.allclose(out[n], (ours[n] + drifted[n]) / 2, atol=1e-5) for n in ours)
    poisoned = {n: t * 10 for n, t in drifted.items()}
    out, stats = robust_mix(ours, ours, 1.0, poisoned, 1.0, anchors)
    assert stats.hard and _norm({n: out[n] - ours[n] for n in ours}) <= 0.25 * _norm(ours) / 2 * (1 + 1e-6)
    joiner = _state(12)
    out, stats = robust_mix(joiner, joiner, 1e-9, ours, 1.0, anchors)
    assert not stats.clipped and all(torch.allclose(out[n], ours[n], atol=1e-5) for n in ours)


def test_blame_uses_our_recent_norm_not_only_the_current_one() -> None:
    """Right after its own sync a trainer's pseudo-gradient is small; a full round's update is fine."""
    fresh = _state(7, scale=0.01)
    full_round = _state(8)
    alone = clip_scale(fresh, full_round, POLICY)
    with_reference = clip_scale(fresh, full_round, POLICY, reference=_norm(full_round))
    assert alone.hard and not with_reference.hard
    assert alone.scale == with_reference.scale  # the shared clip never depends on local history


def test_tampered_partner_is_clipped_and_suspect_over_a_stream() -> None:
    left, right = _state(9), _state(10)
    tamperers: list[TamperingChannel] = []

    def wrap(channel: Channel) -> TamperingChannel:
        tamperers.append(TamperingChannel(channel, lambda named: [(n, t * 50) for n, t in named], INT8))
        return tamperers[-1]

    _, mixed_b = _exchange("int8", left, right, (1.0, 1.0), wrap)
    assert [t.tampered for t in tamperers] == [1]
    assert mixed_b.clip.hard and mixed_b.clip.clipped  # the honest side suspects the tamperer
    moved = _norm({n: mixed_b.tensors[n] - right[n] for n in right})
    assert moved <= POLICY.clip_ratio * _norm(right) / 2 * (1 + 1e-3)


def test_suspicions_in_a_row_ban_and_a_good_exchange_forgives() -> None:
    now = [0.0]
    bans = BanList(base_s=10, max_s=100, clock=lambda: now[0])
    assert bans.suspect("p", "big", limit=2) is None and not bans.is_banned("p")
    assert bans.suspect("p", "big", limit=2) == 10 and bans.is_banned("p")
    assert bans.strikes() == {"p": 1}
    assert bans.suspect("p", "big", limit=2) is None
    assert bans.suspect("p", "big", limit=2) == 20  # the second strike doubles the ban
    bans.suspect("q", "big", limit=2)
    bans.forgive("q")
    assert bans.suspect("q", "big", limit=2) is None  # forgiving also cleared the suspicion


def test_clip_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="clip_ratio"):
        ClipPolicy(clip_ratio=0.0)
    with pytest.raises(ValueError, match="hard_factor"):
        ClipPolicy(hard_factor=0.5)


def test_a_model_offer_is_judged_against_our_progress_not_the_parameters_norm() -> None:
    """A model exchange clips by the parameters' ratio but blames by our progress since the anchor
    (``blame_norm``, ``blame_ratio``): an honest partner 15% away while we moved 9% is ordinary, though
    it is over the parameters' radius; a push of 30 times our progress is hard, though it is only 3% of
    the parameters' norm."""
    models = ClipPolicy(clip_ratio=0.1, hard_factor=10.0, blame_ratio=2.0)
    anchors = ClipPolicy(clip_ratio=0.1, hard_factor=10.0)  # judged by the parameters' norm
    ours = _state(13, scale=10.0)
    direction = _state(14)
    unit = {n: t / _norm(direction) for n, t in direction.items()}

    def at(distance: float) -> dict[str, torch.Tensor]:
        return {n: ours[n] + distance * _norm(ours) * unit[n] for n in ours}

    progress = 0.09 * _norm(ours)
    honest = clip_scale(ours, at(0.15), models, blame_norm=progress)
    by_parameters = clip_scale(ours, at(0.15), anchors)
    assert by_parameters.excess > 1 and honest.excess < 1 and not honest.hard
    assert honest.scale == by_parameters.scale < 1  # the shared clip is the parameters' either way
    assert honest.own_norm == pytest.approx(progress)  # what the reputation keeps as its reference
    small_progress = 0.001 * _norm(ours)
    pushed = clip_scale(ours, at(0.03), models, blame_norm=small_progress)
    assert pushed.hard and not clip_scale(ours, at(0.03), anchors).hard
    with pytest.raises(ValueError, match="blame_ratio"):
        ClipPolicy(blame_ratio=0.0)
