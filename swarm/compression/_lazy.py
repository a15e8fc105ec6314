"""LazyTensors: named tensors computed one at a time, whenever one is read.

A whole-model operation (an exchange, an update) touches every tensor, but one at a time. Where the
tensors are not stored but derived (a snapshot of the parameters as the anchor plus a compact
progress, the mix of two peers' frames), a :class:`LazyTensors` hands out each one freshly computed,
so that at most one of them is alive per reader instead of a whole model. Its names, shapes and
dtypes are known without computing anything (:attr:`LazyTensors.schema`).

Reading the same name twice computes it twice: a reader that needs a value twice keeps it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

Schema = dict[str, tuple[tuple[int, ...], torch.dtype]]


class LazyTensors(Mapping[str, torch.Tensor]):
    """A read-only mapping of names to tensors that ``compute(name)`` makes on each access."""

    def __init__(self, schema: Schema, compute: Callable[[str], torch.Tensor] | None = None) -> None:
        self.schema: Schema = dict(schema)
        self._make = compute

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.schema:
            raise KeyError(name)
        return self._value(name)

    def _value(self, name: str) -> torch.Tensor:
        """The tensor of ``name``, made anew: ``compute(name)``, or a subclass's own."""
        if self._make is None:
            raise NotImplementedError("give compute=, or override _value")
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.schema)

    def __len__(self) -> int:
        return len(self.schema)

    def __repr__(self) -> str:
        return f"LazyTensors({len(self.schema)} tensors)"


def schema_of(tensors: Mapping[str, torch.Tensor]) -> Schema:
    """Names, shapes and dtypes of ``tensors``, without computing a :class:`LazyTensors`."""
    if isinstance(tensors, LazyTensors):
        return dict(tensors.schema)
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
