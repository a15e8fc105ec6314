"""The averager's offerer: it asks its owner for a fresh snapshot per exchange and hands the result back.

A trainer keeps training while its exchanges run, so its averager never writes into live tensors; it
asks an :class:`Offerer` instead (docs/gossip.md, "Offerers"):

* for every exchange, initiated or served, the averager calls :meth:`Offerer.offer` with its exchange
  lock held; the offer's tensors belong to the averager for that exchange: a copy, or a
  :class:`~swarm.compression.LazyTensors` computed from state that changes only after the averager's
  generation moved (an exchange committed, or the owner called
  :meth:`~swarm.gossip.GossipAverager.invalidate` first). An exchange whose offer went stale that way
  never commits and stops sending at once. ``None`` means nothing to offer now: a partner gets BUSY,
  our own ``sync`` returns SKIPPED;
* every offer it took is settled once (:meth:`Offerer.settled`): when its exchange commits (both
  ACKs), with the mixed tensors, the partner's weight and which side we were, under the exchange lock;
  otherwise (failed, refused, or never begun) with ``None`` when the exchange ends. Nothing is
  written anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarm.gossip._metrics import SyncResult
from swarm.gossip._mixing import MixedTensors


@dataclass(frozen=True)
class Offer:
    """One exchange's tensors (owned by the averager until it ends) and their weight; ``token`` is
    the offerer's own bookkeeping, handed back on commit. ``probe``: a few numbers sent in the
    handshake, untouched by codec and mixing (the trainer sends a fixed sample of its anchor, so both
    sides can estimate how far apart their models are; at most ``MAX_PROBE``)."""

    tensors: Mapping[str, torch.Tensor]
    weight: float
    token: Any = None
    probe: tuple[float, ...] = ()
    blame_norm: float | None = None
    """How far an honest partner's tensors may plausibly be from ours, in norm, per unit of the clip's
    blame ratio (None: the norm of ours); see :mod:`swarm.gossip._robust`. Our own measurement."""


@dataclass(frozen=True)
class Committed:
    """A committed exchange: the mixed values, the partner's stated weight and probe, whether we
    initiated, and the exchange's result.

    ``mixed`` computes each tensor when it is read (fresh tensors each time): read what you need in
    :meth:`Offerer.settled`, or call ``mixed.keep()`` there and read each tensor once later with
    ``mixed.take(name)``, which also folds our error feedback."""

    mixed: MixedTensors
    partner_weight: float
    initiator: bool
    result: SyncResult
    partner_probe: tuple[float, ...] = ()
    clip_scale: float = 1.0
    """The robust clip's factor on the partner's pull (1.0: not clipped, or no clip)."""


class Offerer(Protocol):
    """What an averager asks of its owner. Both calls may come from any thread."""

    def offer(self) -> Offer | None: ...

    def settled(self, offer: Offer, exchange: Committed | None) -> None:
        """The exchange that took ``offer`` is over for it: ``exchange`` is what it committed, or None
        (it committed nothing). Called once per offer."""
