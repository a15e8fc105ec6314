"""A JSON-lines history of snapshots: the monitor appends one per refresh, a trainer one per sync.

Both write the same schema (:meth:`SwarmSnapshot.to_dict`), so ``swarm monitor plot`` draws either.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

from swarm.metrics._policy import SnapshotPolicy
from swarm.metrics._snapshot import SwarmSnapshot, build_snapshot

logger = logging.getLogger(__name__)


class _OwnRecord(NamedTuple):
    """A peer's own record as a member (what :func:`build_snapshot` reads; swarm.membership's
    ``Member`` would import hivemind, and with it torch, into every `swarm` command)."""

    peer_id: str
    record: Any
    expires_at: float


class HistoryWriter:
    """Append snapshots to ``path`` as JSON lines (the file and its directory are created on demand).

    Each line is written with one ``write`` call on a file opened for appending, so a crash leaves at
    most one torn last line, which :func:`read_history` skips.
    """

    def __init__(self, path: str | os.PathLike[str], policy: SnapshotPolicy | None = None):
        self.path = Path(path)
        self.policy = policy
        self._previous: SwarmSnapshot | None = None

    def append(self, snapshot: SwarmSnapshot) -> None:
        line = json.dumps(snapshot.to_dict(), separators=(",", ":"), allow_nan=False)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as file:
            file.write(line + "\n")

    def append_record(self, record: Any, now: float) -> SwarmSnapshot:
        """For a trainer: snapshot its own :class:`~swarm.PeerRecord` (rates from its previous line).

        ``now`` is DHT time (``hivemind.utils.timed_storage.get_dht_time()``); needs ``policy``.
        """
        if self.policy is None:
            raise ValueError("HistoryWriter.append_record needs a SnapshotPolicy")
        own = _OwnRecord(record.peer_id, record, now + self.policy.record_ttl_s)
        snapshot = build_snapshot([own], self._previous, now, self.policy)
        self._previous = snapshot
        self.append(snapshot)
        return snapshot


def read_history(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every well-formed snapshot line of a history file, oldest first; torn or foreign lines are skipped."""
    snapshots = []
    skipped = 0
    with Path(path).open(encoding="utf-8", errors="replace") as file:
        for line in file:
            item = _parse(line)
            if item is None:
                skipped += line.strip() != ""
            else:
                snapshots.append(item)
    if skipped:
        logger.warning("skipped %d malformed line(s) in %s", skipped, path)
    return snapshots


def _parse(line: str) -> dict[str, Any] | None:
    try:
        item = json.loads(line)
    except ValueError:
        return None
    if not isinstance(item, dict) or not isinstance(item.get("schema_version"), int):
        return None
    if not isinstance(item.get("peers"), list) or not isinstance(item.get("totals"), dict):
        return None
    return item
