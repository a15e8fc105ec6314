"""The averaging rules of ``scripts/simulate.py``: their settings and the tensor arithmetic of one
exchange (pure functions on ``name -> tensor`` dicts, so the tests can check them on hand-made values).

DiLoCo rounds of H inner steps; anchor ``a``, parameters ``x``, pseudo-gradient ``Δ = a - x``; outer
lr 1 and no momentum, so a pair's new anchor is the pair's mean model:

* ``late`` (the trainer's default today): at its round's end a peer sends its whole model (``model_wire``)
  to its partner, who answers with its own; both keep training while the bytes cross, and when they
  land each sets ``a <- (x_i + x_j) / 2`` of the snapshots and ``x <- a + (x - snapshot)``.
* ``factored``: while a round trains, a peer sends its anchor (``model_wire``) to the partner its view
  schedules for that round's end (overlapped with compute); at the round's end only ``Δ`` crosses
  (``delta_wire``, error feedback per peer). When it lands ``a <- (a_i + a_j) / 2 - (Δ_i + Δ_j) / 2``,
  the pair's mean model, and ``x <- a + (x - snapshot)``. If either side lacks the other's current
  anchor (never sent, or the anchor moved since), the pair falls back to the ``late`` exchange.
* ``based`` (the trainer's rule, ``swarm/gossip/_bases.py``): when a peer's exchange lands, it
  computes the partner its view schedules next, and one of that pair (alternating every ``d`` rounds)
  pushes its anchor (``model_wire``) as the pair's *base* ``B``; both keep the same decoded copy. At the
  round's end each side sends ``x - B`` (``delta_wire``, error feedback per peer) and adds ``B`` back to
  what it receives; the rest is ``late``'s rule. ``B`` only has to be shared, not current: a partner
  whose anchor moved since still sends an exact ``x - B``. A pair without a common base (the partner
  is not the scheduled one, or the base has not landed) falls back to ``late``.
* ``allreduce``: every live peer waits for the others at the round's end; a ring all-reduce of
  ``model_wire`` bytes; each applies the exact mean ``Δ``.

``max_lag`` (gossip rules): rounds an exchange may stay in flight while the device trains on; 0 is a
blocking exchange (the device waits for it, both sides).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

Tensors = dict[str, torch.Tensor]

KINDS = ("late", "factored", "based", "allreduce")


@dataclass(frozen=True)
class Rule:
    kind: str
    model_wire: str = "int8"
    delta_wire: str = "int4"
    error_feedback: bool = True
    max_lag: int = 3
    sync_every: int = 5

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown rule kind {self.kind!r}: {', '.join(KINDS)}")
        if self.max_lag < 0 or self.sync_every < 1:
            raise ValueError(f"need max_lag >= 0 and sync_every >= 1, got {self.max_lag}, {self.sync_every}")


RULES: dict[str, Rule] = {
    "allreduce": Rule("allreduce", max_lag=0),
    "late": Rule("late"),
    "based-int4": Rule("based"),
    "based-int4-blocking": Rule("based", max_lag=0),
    "factored-int4": Rule("factored"),
    "factored-int4-blocking": Rule("factored", max_lag=0),
    "factored-int8": Rule("factored", delta_wire="int8"),
    "factored-topk": Rule("factored", delta_wire="topk0.25"),
    "based-topk10": Rule("based", delta_wire="topk0.1"),
    "based-topk3": Rule("based", delta_wire="topk0.03"),
}
"""The rules ``simulate.py --rules`` knows by name (``--max-lag`` and ``--sync-every`` override the
non-blocking ones' lag and every rule's H)."""


def named(name: str, sync_every: int, max_lag: int | None) -> Rule:
    """The rule ``name`` (a key of :data:`RULES`, or ``<name>@h<H>`` for another H) at the CLI's H
    and lag."""
    base, _, h = name.partition("@h")
    if base not in RULES:
        raise ValueError(f"unknown rule {base!r}: {', '.join(RULES)}")
    rule = replace(RULES[base], sync_every=int(h) if h else sync_every)
    if max_lag is not None and rule.max_lag > 0:
        rule = replace(rule, max_lag=max_lag)
    return rule


def clone(tensors: Tensors) -> Tensors:
    return {name: t.detach().clone() for name, t in tensors.items()}


def pair_mean(own: Tensors, seen: Tensors) -> Tensors:
    """Our own tensors exactly, the partner's as they arrived."""
    return {name: (own[name] + seen[name]) / 2 for name in own}


def factored_anchor(
    own_anchor: Tensors, seen_anchor: Tensors, own_delta: Tensors, seen_delta: Tensors
) -> Tensors:
    """``(a_i + a_j) / 2 - (Δ_i + Δ_j) / 2``: the pair's mean model, from the prefetched anchor and the
    pseudo-gradients (``own_delta`` as we sent it: with error feedback, what the partner decoded)."""
    return {
        name: (own_anchor[name] + seen_anchor[name]) / 2 - (own_delta[name] + seen_delta[name]) / 2
        for name in own_anchor
    }


@torch.no_grad()
def rebase(params: Tensors, anchor: Tensors, snapshot: Tensors) -> None:
    """``x <- anchor + (x - snapshot)`` in place: the new anchor plus the local progress made since the
    exchange's snapshot."""
    for name, param in params.items():
        param.add_(anchor[name] - snapshot[name])


def spread(models: list[Tensors]) -> float:
    """RMS distance of the models to their mean, relative to the mean's norm."""
    if len(models) < 2:
        return 0.0
    names = list(models[0])
    mean = {n: sum(m[n] for m in models) / len(models) for n in names}
    num = sum(float((m[n] - mean[n]).pow(2).sum()) for m in models for n in names) / len(models)
    den = sum(float(mean[n].pow(2).sum()) for n in names)
    return (num / den) ** 0.5 if den > 0 else 0.0
