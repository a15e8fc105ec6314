"""What one exchange averages on our side (:class:`Local`), and its companion part in offer mode.

An averager in offer mode with a companion codec (docs/gossip.md, "Anchors in the same exchange")
turns each offer's :class:`~swarm.gossip.Part` into a second :class:`Local`, hands both parts'
inputs to the data phase, and reports the companion's result back as a
:class:`~swarm.gossip.MixedPart`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm.compression import schema_of
from swarm.gossip._deadlines import payload_nbytes
from swarm.gossip._exchange import Companion, ExchangeSpec, as_named
from swarm.gossip._metrics import SyncResult
from swarm.gossip._mixing import Mixed
from swarm.gossip._offer import Committed, MixedPart, Offer
from swarm.gossip._protocol import Hello
from swarm.gossip._validation import schema_hash


@dataclass
class Local:
    """The tensors this peer averages (the caller's objects, updated in place) and their weight; in
    offer mode, a snapshot the offerer gave for one exchange (``offer``), never written to."""

    tensors: Mapping[str, torch.Tensor]
    weight: float
    schema_hash: str
    nbytes: int = 0  # on the wire, one direction: what the exchange's deadline is sized by
    offer: Offer | None = None
    companion: Local | None = None  # offer mode with a companion codec: the offer's second part

    @property
    def total_nbytes(self) -> int:
        return self.nbytes + (self.companion.nbytes if self.companion is not None else 0)

    def stated(self) -> tuple[str, float, tuple[float, ...], tuple[str, float] | None]:
        """What a HELLO states about these tensors (:meth:`Handshake.hello`'s arguments): schema hash,
        weight, the offer's probe, and the companion part's schema hash and weight."""
        probe = self.offer.probe if self.offer is not None else ()
        part = self.companion
        return self.schema_hash, self.weight, probe, (part.schema_hash, part.weight) if part else None


def with_companion(local: Local, offer: Offer, spec: ExchangeSpec | None) -> Local:
    """``local`` with the offer's companion part; ValueError unless the offer has one exactly when the
    averager has a companion ``spec``, or if its weight is not a finite positive number."""
    part = offer.companion
    if (spec is None) != (part is None):
        raise ValueError(
            "an offer must carry a companion part exactly when the averager has a companion_codec"
        )
    if spec is None or part is None:
        return local
    if not (part.weight > 0 and part.weight < float("inf")):
        raise ValueError(f"companion weight must be a finite positive number, got {part.weight!r}")
    named = as_named(part.tensors)
    companion = Local(
        named, float(part.weight), schema_hash(schema_of(named)), payload_nbytes(named, spec.codec)
    )
    return dataclasses.replace(local, companion=companion)


def companion_of(local: Local, theirs: Hello, spec: ExchangeSpec | None) -> Companion | None:
    """The companion part's inputs to the data phase (both HELLOs described one: the handshake
    checked it), or None."""
    part = local.companion
    if part is None or spec is None or theirs.companion is None:
        return None
    return Companion(part.tensors, (part.weight, theirs.companion.weight), spec)


def clip_factor(mixed: Mixed) -> float:
    """The robust clip's factor on the partner's pull (1.0: not clipped, or no clip)."""
    return mixed.clip.scale if mixed.clip is not None else 1.0


def mixed_part(mixed: Mixed | None, theirs: Hello) -> MixedPart | None:
    """The companion's committed result for the offerer, or None without one."""
    if mixed is None or theirs.companion is None:
        return None
    return MixedPart(mixed.tensors, theirs.companion.weight, clip_factor(mixed))


def committed_of(mixed: Mixed, theirs: Hello, initiator: bool, result: SyncResult) -> Committed:
    """What an offer-mode averager reports to its offerer for a committed exchange."""
    return Committed(
        mixed.tensors,
        theirs.weight,
        initiator,
        result,
        theirs.probe,
        clip_factor(mixed),
        mixed_part(mixed.companion, theirs),
    )
