"""Background mode: a thread that syncs every interval until stopped."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from swarm.gossip._metrics import SyncResult

logger = logging.getLogger(__name__)

Tensors = Mapping[str, torch.Tensor] | Sequence[torch.Tensor]


class _Syncs(Protocol):
    run_id: str

    def sync(self, tensors: Tensors | None = None, weight: float | None = None) -> SyncResult: ...


class Background:
    """A thread that calls ``averager.sync`` every interval (jittered) until stopped."""

    def __init__(
        self,
        averager: _Syncs,
        get_tensors: Callable[[], Tensors] | None,
        interval_s: float,
        get_weight: Callable[[], float] | None,
        on_result: Callable[[SyncResult], None] | None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self._averager = averager
        self._get_tensors = get_tensors
        self._interval = interval_s
        self._get_weight = get_weight
        self._on_result = on_result
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name=f"gossip-bg-{averager.run_id}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        rng = random.Random()
        while not self._stop.wait(self._interval * rng.uniform(0.8, 1.2)):
            try:
                tensors = self._get_tensors() if self._get_tensors is not None else None
                weight = self._get_weight() if self._get_weight is not None else None
                result = self._averager.sync(tensors, weight)
                if self._on_result is not None:
                    self._on_result(result)
            except Exception:
                logger.exception("background gossip sync failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
