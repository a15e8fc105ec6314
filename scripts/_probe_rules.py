"""The averaging rules of ``scripts/probe_outer.py``: who meets whom, what a meeting computes, and when
its result lands.

A round's exchanges produce one :class:`Pending` update per peer: the outer gradient it will apply and
the parameters it took its snapshot from. With ``lag`` L the update lands L rounds later, on top of
the local progress made meanwhile (``φ' = θ' + (φ - φs)``, the trainer's rule, docs/training.md); a
peer with an update in flight takes no part in new exchanges, as in the trainer (no new snapshot
while one is pending).

Exchanges (``Probe.exchange``):

* ``pseudo-gradient``: the group applies its mean pseudo-gradient (the old gossip rule; the anchors'
  gaps stay what they were, only ``anchor_pull`` closes them);
* ``model``: the group averages its *models* ``φs`` (one tensor per direction, each side seeing the
  others through ``codec``), and each peer takes the outer step along ``θ - mean(φs)``; with outer lr 1
  and no momentum that is the group's model average, so every exchange is a consensus step.

Schedules (``Probe.schedule``): ``random`` (a random partition into groups of ``group``) or
``hypercube`` (dimension exchange, :func:`swarm.gossip.hypercube_partner`: round r, peer i meets
i XOR 2^(r mod log2 N); exact averaging every log2 N rounds for N a power of two, and peers whose
scheduled partner does not exist, or is busy, meet a random free peer instead).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from swarm.compression import get_codec
from swarm.gossip import hypercube_partner
from swarm.learning import OuterOptimizer

Tensors = dict[str, torch.Tensor]


@dataclass
class Pending:
    """An exchange's result for one peer: its outer gradient, the parameters it was computed from, and
    the round it lands in."""

    gradient: Tensors
    snapshot: Tensors
    due: int


def groups_of(peers: list[int], schedule: str, size: int, round_: int, rng: random.Random) -> list[list[int]]:
    """This round's meetings among the free ``peers`` (indices into the shared order of all peers)."""
    if schedule == "hypercube" and size == 2:
        names = [str(p) for p in sorted(peers)]
        free, pairs = set(peers), []
        for peer in sorted(peers):
            if peer not in free:
                continue
            partner = hypercube_partner(names, str(peer), round_)
            if partner is not None and int(partner) in free and int(partner) != peer:
                pairs.append([peer, int(partner)])
                free -= {peer, int(partner)}
        rest = sorted(free)
        rng.shuffle(rest)  # the graceful fallback: a random free partner
        return pairs + [rest[i : i + 2] for i in range(0, len(rest), 2)]
    if schedule not in ("random", "hypercube"):
        raise ValueError(f"unknown schedule {schedule!r}: random or hypercube")
    order = list(peers)
    rng.shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _seen(tensors: Tensors, codec: str) -> Tensors:
    """``tensors`` as a partner receives them through ``codec``."""
    if codec == "fp32":
        return tensors
    coder = get_codec(codec)
    return {name: coder.roundtrip(t).clone() for name, t in tensors.items()}


def meet(outers: list[OuterOptimizer], group: list[int], exchange: str, codec: str) -> dict[int, Tensors]:
    """What each member of ``group`` will apply: its outer gradient (a copy, taken now)."""
    if exchange == "pseudo-gradient":
        grads = [outers[i].pseudo_gradient() for i in group]
        mean = {name: sum(g[name] for g in grads) / len(grads) for name in grads[0]}
        return {i: mean for i in group}
    if exchange != "model":
        raise ValueError(f"unknown exchange {exchange!r}: pseudo-gradient or model")
    models = {i: outers[i].copy_parameters() for i in group}
    seen = {i: _seen(models[i], codec) for i in group}
    result = {}
    for i in group:  # our own model exactly, the others' as they arrived
        mean = {n: (models[i][n] + sum(seen[j][n] for j in group if j != i)) / len(group) for n in models[i]}
        result[i] = {n: outers[i].anchor[n] - mean[n] for n in mean}
    return result


@torch.no_grad()
def land(outer: OuterOptimizer, pending: Pending) -> None:
    """Apply a late exchange: the outer step, then the local progress since its snapshot on top."""
    outer.advance(pending.gradient)
    current = outer.copy_parameters()  # φ' = θ' + (φ - φs)
    outer.load_parameters({n: current[n] + (outer.anchor[n] - pending.snapshot[n]) for n in current})


def spread(outers: list[OuterOptimizer]) -> float:
    """RMS relative distance of the peers' anchors to their mean."""
    names = list(outers[0].anchor)
    mean = {name: sum(outer.anchor[name] for outer in outers) / len(outers) for name in names}
    num = sum(float((o.anchor[n] - mean[n]).pow(2).sum()) for o in outers for n in names) / len(outers)
    den = sum(float(mean[n].pow(2).sum()) for n in names)
    return (num / den) ** 0.5
