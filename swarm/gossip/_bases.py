"""Shared bases: what lets a round's exchange send only what the round changed.

The anchor of a DiLoCo round does not change while the round trains, so the big message can travel
while the device computes. Of a scheduled pair, the member that dials pushes its anchor to the partner
at the start of the round (:meth:`~swarm.gossip.GossipAverager.push_base`, in the averager's codec,
int8 by default). Both sides keep the pushed frames: the *base* ``B``, the same bits on both sides.
At the round's end the pair's exchange sends each model relative to it, ``x - B``, in the delta codec
(int4 by default, with error feedback), and each side adds ``B`` back to what it receives. Only that
waits on the network after the last inner step (docs/gossip.md, "Nothing waits on the full model").

``B`` need not be anybody's current anchor: it only has to be the same on both sides. A partner whose
anchor moved since (it exchanged with someone else) still sends an exact ``x - B``, only a larger one.
An exchange whose two sides name no common base sends the whole models, as before.

What a base costs and who may impose one: a base is kept as its frames (about one byte per parameter
in int8), at most :data:`MAX_BASES` of them and one per partner, the oldest dropped first; a partner
may push at most once per serve interval. A base is checked like any received tensor (decodes,
finite), and an exchange through it checks that our own values came through it faithfully
(:data:`MAX_BASE_ERROR`): a base far from our model would put its quantization error into our own
mix, and the partner who pushed it is to blame.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm.compression import FrameError, FrameStore, LazyTensors, Schema
from swarm.gossip._validation import ValidationError, check_finite

MAX_BASES = 2
"""Bases an averager keeps at once: the one of this round's pair and one pushed early for the next."""
MAX_BASE_ERROR = 0.05
"""The largest ``||x - q|| / ||x||`` an exchange through a base may give our own values (``q``: what
our frames decode to with the base added). Honest bases (a partner's anchor, a few hundredths of the
model away) give far less in int4; a base far from our model makes it larger, and is refused."""
BASE_ID = re.compile(r"^[0-9a-f]{16}$")
"""A base's name on the wire: 16 lowercase hex digits, drawn at random by the pusher."""


def new_base_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Base:
    """A base both sides of a pair hold: its name and its frames, decoded per tensor when read."""

    base_id: str
    frames: FrameStore
    schema: Schema

    @property
    def tensors(self) -> LazyTensors:
        """The base's values, as float32 tensors decoded when read."""
        return LazyTensors(self.schema, lambda name: self.frames.tensor(name).float())

    @property
    def nbytes(self) -> int:
        return self.frames.nbytes


def check_base(frames: FrameStore, schema: Schema) -> None:
    """ValidationError unless every tensor of a received base decodes and is finite."""
    for name in schema:
        try:
            check_finite(name, frames.tensor(name))
        except FrameError as exc:
            raise ValidationError(f"bad base frame: {exc}") from exc


class BaseStore:
    """The bases this averager shares with partners: one per partner, at most :data:`MAX_BASES`,
    the oldest dropped first. Thread-safe."""

    def __init__(self, capacity: int = MAX_BASES) -> None:
        self._capacity = capacity
        self._bases: OrderedDict[str, Base] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, partner: str, base: Base) -> None:
        with self._lock:
            self._bases.pop(partner, None)
            self._bases[partner] = base
            while len(self._bases) > self._capacity:
                self._bases.popitem(last=False)

    def get(self, partner: str) -> Base | None:
        with self._lock:
            return self._bases.get(partner)

    def drop(self, partner: str) -> None:
        with self._lock:
            self._bases.pop(partner, None)

    def agreed(self, partner: str, base_id: str) -> Base | None:
        """The base we hold with ``partner`` if it is the one named ``base_id``, else None."""
        base = self.get(partner)
        return base if base is not None and base_id and base.base_id == base_id else None

    def nbytes(self) -> int:
        with self._lock:
            return sum(base.nbytes for base in self._bases.values())


def relative(
    local: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], schema: Schema
) -> LazyTensors:
    """``local - base`` per tensor, computed when read (float32, on ``local``'s device)."""

    def difference(name: str) -> torch.Tensor:
        x = local[name]
        return x.detach().to(torch.float32, copy=True).sub_(base[name].to(x.device))

    return LazyTensors(schema, difference)


def absolute(
    values: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], schema: Schema
) -> LazyTensors:
    """``values + base`` per tensor, computed when read (float32, on ``values``' device)."""

    def total(name: str) -> torch.Tensor:
        v = values[name]
        return v.to(torch.float32, copy=True).add_(base[name].to(v.device))

    return LazyTensors(schema, total)
