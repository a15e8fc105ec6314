"""The inputs a stage server keeps for the BACKWARD of a micro-batch: bounded, and shared per peer.

A middle stage's training FORWARD caches its input, so that the BACKWARD can recompute the forward
(:mod:`swarm.pipeline._compute`). The cache holds at most :data:`~swarm.pipeline._estimate.MAX_CACHED`
inputs and none older than its timeout. When it is full, the entry that goes is the oldest of the peer
holding the most entries (the newcomer's own first among equals), never simply the oldest: one peer
that sends training forwards as fast as it can evicts its own inputs, not the inputs of data holders
with a few chains in flight. A peer whose input is gone redoes that hop as a FORWARD with the output
gradient (the driver's fallback), so eviction costs a recompute, never a micro-batch.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import torch

from swarm.pipeline._estimate import MAX_CACHED

Key = tuple[str, str]
"""(client peer id, micro-batch id)."""


class InputCache:
    """Cached micro-batch inputs by key; one thread's only (the compute thread)."""

    def __init__(
        self,
        timeout_s: float,
        capacity: int = MAX_CACHED,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s, self.capacity, self._now = timeout_s, capacity, now
        self._entries: collections.OrderedDict[Key, tuple[torch.Tensor, float]] = collections.OrderedDict()
        self._per_peer: collections.Counter[str] = collections.Counter()
        self.evicted = 0
        """Inputs dropped because the cache was full (not counting expired ones)."""

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def held_by(self, peer: str) -> int:
        return self._per_peer[peer]

    def put(self, key: Key, x: torch.Tensor) -> None:
        now = self._now()
        self._drop(key)
        self._entries[key] = (x, now)
        self._per_peer[key[0]] += 1
        while self._entries and now - next(iter(self._entries.values()))[1] > self.timeout_s:
            self._drop(next(iter(self._entries)))
        while len(self._entries) > self.capacity:
            self._drop(self._victim(key[0]))
            self.evicted += 1

    def pop(self, key: Key) -> torch.Tensor:
        x, _ = self._entries[key]
        self._drop(key)
        return x

    def clear(self) -> None:
        self._entries.clear()
        self._per_peer.clear()

    def _victim(self, newcomer: str) -> Key:
        """The oldest entry of the peer holding the most (the newcomer first among equals)."""
        peer = max(self._per_peer, key=lambda p: (self._per_peer[p], p == newcomer))
        return next(key for key in self._entries if key[0] == peer)

    def _drop(self, key: Key) -> None:
        if self._entries.pop(key, None) is not None:
            self._per_peer[key[0]] -= 1
            if not self._per_peer[key[0]]:
                del self._per_peer[key[0]]
