"""Fixed tensors averaged in place: the simplest owner a :class:`~swarm.gossip.GossipAverager` can have.

The product's averagers belong to a trainer that keeps training while they exchange, so they only
ever ask an :class:`~swarm.gossip.Offerer` for snapshots. The averaging benchmark and most gossip
tests want less: a few tensors that an exchange overwrites with the pair's mix, and their weight.
:class:`HeldTensors` is that offerer, and :func:`gossip_averager` an averager around it with a direct
API (``sync(tensors, weight)``, ``set_tensors``, ``paused()``, ``reading()``, ``weight``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from swarm.gossip import Committed, GossipAverager, GossipOptions, MixedTensors, Offer, PartnerInfo

Tensors = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]


def named(tensors: Tensors) -> dict[str, torch.Tensor]:
    """A mapping as it is, a sequence named "0", "1", ..."""
    return dict(tensors) if isinstance(tensors, Mapping) else {str(i): t for i, t in enumerate(tensors)}


class HeldTensors:
    """Offers the same tensors to every exchange and writes each committed mix into them, folding the
    error feedback tensor by tensor. ``keeps_weight``: the robust rule, which leaves weights as they
    are; else the weight becomes the pair's mean."""

    def __init__(self, keeps_weight: bool) -> None:
        self.tensors: dict[str, torch.Tensor] | None = None
        self.weight = 1.0
        self._keeps_weight = keeps_weight

    def offer(self) -> Offer | None:
        return None if self.tensors is None else Offer(tensors=self.tensors, weight=self.weight)

    def settled(self, offer: Offer, exchange: Committed | None) -> None:
        """Write a committed mix into the tensors (nothing to give back: they stay ours)."""
        if exchange is None:
            return
        mixed = exchange.mixed
        assert isinstance(mixed, MixedTensors)
        mixed.keep()
        with torch.no_grad():
            for name, tensor in offer.tensors.items():
                tensor.copy_(mixed.take(name))
        if not self._keeps_weight:
            self.weight = (offer.weight + exchange.partner_weight) / 2


PartnerSource = Callable[[], Sequence[PartnerInfo]]
"""Who :meth:`Dialling.sync` may dial, asked at each sync."""


class Dialling:
    """A :class:`GossipAverager` whose :meth:`sync` asks ``partner_source`` for its partners; anything
    else is the averager's."""

    _OWN: tuple[str, ...] = ("averager", "partner_source")

    def __init__(self, averager: GossipAverager, partner_source: PartnerSource) -> None:
        self.averager, self.partner_source = averager, partner_source

    def sync(self) -> Any:
        return self.averager.sync(self.partner_source())

    def close(self) -> None:
        self.averager.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.averager, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.averager, name, value)


class HeldAverager(Dialling):
    """A :class:`Dialling` averager over :class:`HeldTensors`."""

    _OWN = ("averager", "partner_source", "held")

    def __init__(self, averager: GossipAverager, held: HeldTensors, partner_source: PartnerSource) -> None:
        super().__init__(averager, partner_source)
        self.held = held

    def set_tensors(self, tensors: Tensors, weight: float | None = None) -> None:
        """Hold (or replace) the tensors to serve, without syncing; exchanges in flight do not commit."""
        with self.averager._lock:
            self._hold(tensors, weight)

    def _hold(self, tensors: Tensors | None, weight: float | None) -> None:
        if weight is not None:
            if not (weight > 0 and weight < float("inf")):
                raise ValueError(f"weight must be a finite positive number, got {weight!r}")
            self.held.weight = float(weight)
        if tensors is not None:
            self.held.tensors = named(tensors)
        self.averager.invalidate()

    def sync(self, tensors: Tensors | None = None, weight: float | None = None) -> Any:
        """One exchange of the held tensors (``tensors``/``weight`` replace them first)."""
        if tensors is not None or weight is not None:
            self.set_tensors(tensors if tensors is not None else self.held.tensors or {}, weight)
        return super().sync()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Hold off exchanges while the caller reads or changes the tensors; one in flight does not
        commit."""
        with self.averager._lock:
            try:
                yield
            finally:
                self.averager.invalidate()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Read the tensors consistently (no commit lands meanwhile); unlike :meth:`paused`, an
        exchange in flight may still commit afterwards."""
        with self.averager._lock:
            yield

    @property
    def weight(self) -> float:
        return self.held.weight


OPTION_NAMES = {field.name for field in dataclasses.fields(GossipOptions)}


def gossip_averager(*, options: GossipOptions | None = None, **kwargs: Any) -> Any:
    """A :class:`Dialling` averager (with an ``offerer``) or else a :class:`HeldAverager`, whose syncs
    dial what ``partner_source`` returns (by default nobody); keyword arguments that name
    :class:`GossipOptions` fields tune its options, the others go to the averager."""
    tuning = {k: kwargs.pop(k) for k in list(kwargs) if k in OPTION_NAMES}
    opts = dataclasses.replace(options or GossipOptions(), **tuning)
    partner_source = kwargs.pop("partner_source", list)
    if "offerer" in kwargs:
        return Dialling(GossipAverager(options=opts, **kwargs), partner_source)
    weight = kwargs.pop("initial_weight", 1.0)
    held = HeldTensors(keeps_weight=opts.robust_clip)
    held.weight = float(weight)
    averager = GossipAverager(options=opts, offerer=held, **kwargs)
    return HeldAverager(averager, held, partner_source)
