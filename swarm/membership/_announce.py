"""Periodic announcement of this peer's record under its shard of the run's DHT keys."""

from __future__ import annotations

import logging
from collections.abc import Callable

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.timed_storage import get_dht_time

from swarm._periodic import PeriodicTask
from swarm.membership._record import PeerRecord
from swarm.membership._signed import MAX_RECORD_AHEAD_S

logger = logging.getLogger(__name__)


class Announcer:
    """Stores a fresh signed record under ``key`` (:func:`~swarm.membership.record_key` of its shard) every
    ``interval_s`` with an expiration ``ttl_s`` ahead.

    The record is built by ``snapshot`` at each announcement, so it always carries current metrics.
    ``after`` runs on the announcer's thread after each periodic announcement.
    A record that is not refreshed disappears from :func:`list_members` once it expires; that is how a
    crashed peer leaves the swarm.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        key: str,
        signer: RSASignatureValidator,
        snapshot: Callable[[], PeerRecord],
        *,
        interval_s: float,
        ttl_s: float,
        after: Callable[[], object] | None = None,
    ):
        if ttl_s < interval_s:
            raise ValueError(f"record ttl {ttl_s}s must not be shorter than the interval {interval_s}s")
        self._dht, self._key, self._signer = dht, key, signer
        # nodes refuse records that expire later than this (swarm/membership/_validators.py)
        self._snapshot, self._ttl_s, self._after = snapshot, min(ttl_s, MAX_RECORD_AHEAD_S), after
        self._task = PeriodicTask(self._announce_then, interval_s, name="swarm-announcer")

    def start(self) -> None:
        """Announce once synchronously (so the peer is visible on return), then keep announcing."""
        self._task.start()

    def announce_now(self) -> bool:
        """Store the current record; return whether at least one DHT node accepted it."""
        record = self._snapshot()
        stored = self._dht.store(
            self._key,
            subkey=self._signer.local_public_key,
            value=record.dict(),
            expiration_time=get_dht_time() + self._ttl_s,
        )
        if not stored:
            logger.warning("no DHT node accepted our membership record (is the swarm reachable?)")
        return bool(stored)

    def _announce_then(self) -> None:
        self.announce_now()
        if self._after is not None:
            self._after()  # e.g. the owner's view of the members, read on this thread too

    def announce_soon(self) -> None:
        """Store the current record on the announcer's thread as soon as it can, without waiting."""
        self._task.trigger()

    def stop(self) -> None:
        """Stop announcing; the last record expires on its own."""
        self._task.stop()
