"""The mixing rules of :mod:`swarm.gossip._mixing` applied to whole dicts at once, for tests that check
the arithmetic without an exchange around it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swarm.gossip._mixing import Mixed, MixedTensors, measure, pair_norms
from swarm.gossip._robust import ClipPolicy, ClipStats, clip_stats

Tensors = Mapping[str, torch.Tensor]


def mix(local: Tensors, sent: Tensors, local_weight: float, remote: Tensors, remote_weight: float) -> Mixed:
    """The plain rule as a lazy :class:`MixedTensors`; the pair's weight is the mean of theirs."""
    tensors = MixedTensors(local, sent, remote, (local_weight, remote_weight))
    return Mixed(tensors, (local_weight + remote_weight) / 2)


def robust_mix(
    local: Tensors,
    sent: Tensors,
    local_weight: float,
    remote: Tensors,
    remote_weight: float,
    policy: ClipPolicy,
    reference: float = 0.0,
    blame_norm: float | None = None,
) -> tuple[dict[str, torch.Tensor], ClipStats]:
    """The robust rule, computed at once; ``reference`` and ``blame_norm``: what the partner is judged
    against (:func:`~swarm.gossip._robust.clip_scale`). Weights are unchanged."""
    norms = pair_norms(measure(local, sent, remote))
    stats = clip_stats(norms, policy, reference, (local_weight, remote_weight), blame_norm)
    mixed = MixedTensors(local, sent, remote, (local_weight, remote_weight), clip=stats.scale)
    return dict(mixed), stats


def computed(local: Tensors, values: Tensors) -> MixedTensors:
    """A mix whose result was computed elsewhere: ``values`` (the plain rule at weights 0 and 1), owing
    no error feedback: what a test hands an offerer as a committed exchange."""
    return MixedTensors(local, local, values, (0.0, 1.0))
