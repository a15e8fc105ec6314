"""The live members of a pipeline run, refreshed in the background for routing, stage choice and the end.

Reading the members is a DHT lookup; the training thread and the routing on the client's event loop
must not wait for one, so a thread refreshes them every ``period_s`` (and :meth:`Roster.refresh` does it
at once) and hands the live stage peers to the :class:`~swarm.pipeline.Router`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from swarm.membership import PROTOCOL_VERSION
from swarm.pipeline._balance import ACTIVE
from swarm.pipeline._router import Router, StageMember

if TYPE_CHECKING:
    from swarm._node import SwarmNode

logger = logging.getLogger(__name__)


class Roster:
    """Compatible live trainers of the run (same config hash and protocol), kept fresh by a thread."""

    def __init__(
        self,
        node: SwarmNode,
        config_hash: str,
        num_stages: int,
        *,
        period_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._node, self._hash, self.num_stages = node, config_hash, num_stages
        self._period, self._clock = period_s, clock
        self._lock = threading.Lock()
        self._records: list[Any] = []
        self.router: Router | None = None
        self._holder_seen_at: float | None = None
        self._holders: frozenset[str] = frozenset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="pipeline-roster", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        failing = False
        while not self._stop.wait(self._period):
            try:
                self.refresh()
                failing = False
            except Exception as exc:  # a failed lookup must not end the thread; the next one may work
                if not failing:
                    logger.warning("reading the members failed (%s: %s); retrying", type(exc).__name__, exc)
                failing = True

    def refresh(self) -> None:
        """Read the members now and update the router."""
        records = [
            m.record
            for m in self._node.members()
            if m.record.config_hash == self._hash
            and m.record.protocol_version == PROTOCOL_VERSION
            and m.record.role == "trainer"
        ]
        with self._lock:
            self._records = records
            self._holders = frozenset(r.peer_id for r in records if r.stage == 0)
            if any(r.stage == 0 and r.state in ACTIVE and r.peer_id != self._node.peer_id for r in records):
                self._holder_seen_at = self._clock()
            router = self.router
        if router is not None:
            serving = [
                StageMember(r.peer_id, r.stage, r.stage_capacity)
                for r in records
                if r.state in ACTIVE and not r.client_mode and r.stage > 0
            ]
            holders = [r.peer_id for r in records if r.stage == 0 and r.state in ACTIVE]
            router.update(serving, holders)

    def records(self) -> list[Any]:
        with self._lock:
            return list(self._records)

    def is_data_holder(self, peer_id: str) -> bool:
        """``peer_id`` has a live record as a data holder (stage 0) of this run, whatever its state (its
        last commits may arrive as it leaves): the only peers a stage server takes gradients from."""
        with self._lock:
            return peer_id in self._holders

    def holder_samples(self, exclude: str) -> list[tuple[str, int]]:
        """``(peer id, samples trained)`` of each live data holder but ``exclude``."""
        with self._lock:
            return [
                (r.peer_id, r.samples_total) for r in self._records if r.stage == 0 and r.peer_id != exclude
            ]

    def holders_active(self) -> None:
        """A data holder's work just arrived (a server stepped on its samples): holders are here, even
        if no record read so far showed one active (a holder can join, train and leave between reads)."""
        with self._lock:
            self._holder_seen_at = self._clock()

    def holders_gone(self, grace_s: float = 10.0) -> bool:
        """Data holders were here, and none has been active for ``grace_s`` seconds: a server is done."""
        with self._lock:
            seen = self._holder_seen_at
        return seen is not None and self._clock() - seen > grace_s

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
