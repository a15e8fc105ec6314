"""What one exchange averages on our side (:class:`Local`): an offer's tensors, weight and schema, and
what a committed exchange reports back to the offerer (:func:`committed_of`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from swarm.gossip._metrics import SyncResult
from swarm.gossip._mixing import Mixed
from swarm.gossip._offer import Committed, Offer
from swarm.gossip._protocol import Hello


@dataclass
class Local:
    """The snapshot the offerer gave for one exchange (``offer``, never written to), its tensors as
    checked, their weight, schema hash and size on the wire; ``settled`` once the offerer has it back
    (:meth:`Offerer.settled`)."""

    tensors: Mapping[str, torch.Tensor]
    weight: float
    schema_hash: str
    nbytes: int
    """On the wire, one direction: what the exchange's deadline is sized by."""
    offer: Offer
    settled: bool = field(default=False, compare=False)

    def stated(self) -> tuple[str, float, tuple[float, ...]]:
        """What a HELLO states about these tensors (:meth:`Handshake.hello`'s arguments): schema hash,
        weight and the offer's probe."""
        return self.schema_hash, self.weight, self.offer.probe


def committed_of(mixed: Mixed, theirs: Hello, initiator: bool, result: SyncResult) -> Committed:
    """What the averager reports to its offerer for a committed exchange."""
    clip = mixed.clip.scale if mixed.clip is not None else 1.0
    return Committed(mixed.tensors, theirs.weight, initiator, result, theirs.probe, clip)
