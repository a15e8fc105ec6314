"""StateMirror: a bootstrap's copy of the swarm's latest state, and which donors a state comes from.

A bootstrap started with ``--serve-state`` keeps a copy of the latest state the live trainers announce
and is a donor too, so a joiner finds one even when no trainer is online. :func:`choose_donors` picks
the members to download from (a joiner uses it as well), :func:`progress_of` checks the progress
counters a donor put into a state's meta. See docs/state-sync.md.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from swarm._periodic import PeriodicTask
from swarm.state._download import download_state
from swarm.state._server import StateServer
from swarm.state._transfer_protocol import StateSnapshot, StateTransferError, make_snapshot
from swarm.state.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from swarm._node import SwarmNode
    from swarm.membership import Member

logger = logging.getLogger(__name__)

PROGRESS_KEYS = ("round", "step", "samples_total")


def progress_of(meta: dict[str, Any]) -> dict[str, int]:
    """The progress counters of a downloaded state's meta, checked: the donor chose them.

    Raises StateTransferError naming the key unless each is a non-negative integer below 2**63.
    """
    progress = {}
    for key in PROGRESS_KEYS:
        value = meta.get(key, 0)
        if type(value) is not int or not 0 <= value < 2**63:
            raise StateTransferError(f"donor state meta {key!r} is not a non-negative integer: {value!r:.40}")
        progress[key] = value
    return progress


def choose_donors(
    members: Iterable[Member], self_id: str, *, roles: Iterable[str] = ("trainer", "bootstrap")
) -> list[tuple[str, str]]:
    """(peer id, announced digest) of the members to download state from.

    Only dialable members (not in client mode) that announce a state count. Live trainers come first;
    when none has a state, the first role in ``roles`` that has one (a bootstrap keeping a copy).
    """
    usable = [m for m in members if m.peer_id != self_id and m.record.state_hash and not m.record.client_mode]
    for role in roles:
        donors = [(m.peer_id, m.record.state_hash) for m in usable if m.record.role == role]
        if donors:
            return donors
    return []


class StateMirror:
    """A bootstrap's copy of the swarm's latest state, refreshed from live trainers and served to joiners.

    Every ``interval_s`` it downloads the state the live trainers announce (as a joiner would, verified
    frame by frame; the mean of their states when they differ), publishes it on its own
    :class:`StateServer` unchanged (same meta, so same round/step/samples and the same digest as a
    single donor's) and, with ``state_dir``, writes it there atomically; a restarted bootstrap serves
    the newest valid file at once. Without trainers the last copy is kept. Call :meth:`start`, then
    :meth:`close`.
    """

    def __init__(
        self,
        node: SwarmNode,
        *,
        interval_s: float = 60.0,
        state_dir: str | None = None,
        config_hash: str = "",
        on_update: Callable[[StateSnapshot], None] | None = None,
    ) -> None:
        self._node, self._state_dir, self._config_hash = node, state_dir, config_hash
        self._on_update = on_update
        self._lock = threading.Lock()
        self._snapshot: StateSnapshot | None = None
        self._behind: set[str] = set()  # digests of states with less progress than ours: not fetched again
        self._server = StateServer(node.dht, node.info.run_id)
        self._task = PeriodicTask(self._refresh_logged, interval_s, name="state-mirror")

    @property
    def digest(self) -> str:
        """The digest of the state served now ("" before the first copy): goes into the record."""
        with self._lock:
            return "" if self._snapshot is None else self._snapshot.digest

    @property
    def snapshot(self) -> StateSnapshot | None:
        with self._lock:
            return self._snapshot

    def start(self) -> None:
        """Serve the saved copy (if any), then fetch once now and every ``interval_s`` in a thread."""
        if self._state_dir is not None:
            self._load_saved(self._state_dir)
        self._task.start()

    def refresh(self) -> bool:
        """Fetch the trainers' current state if it differs from ours; return whether ours changed."""
        donors = choose_donors(self._node.members(), self._node.peer_id, roles=("trainer",))
        digests = {digest for _, digest in donors}
        if not donors or digests == {self.digest} or digests <= self._behind:
            return False
        snapshot = download_state(self._node.dht, donors, run_id=self._node.info.run_id)
        samples = progress_of(snapshot.meta)["samples_total"]
        kept = self.snapshot
        if kept is not None and samples < progress_of(kept.meta)["samples_total"]:
            logger.info("not replacing the kept state by one with less progress (%d samples)", samples)
            self._behind |= digests
            return False
        self._publish(snapshot)
        if self._state_dir is not None:
            state = {"tensors": snapshot.tensors, "meta": snapshot.meta, "config_hash": self._config_hash}
            save_checkpoint(self._state_dir, state, samples, keep=2)
        return True

    def _refresh_logged(self) -> None:
        try:
            self.refresh()
        except (StateTransferError, ValueError, OSError) as exc:
            logger.warning("could not refresh the kept state: %s", exc)

    def _publish(self, snapshot: StateSnapshot) -> None:
        self._server.publish(snapshot)
        with self._lock:
            self._snapshot = snapshot
        self._node.announce_now()
        if self._on_update is not None:
            self._on_update(snapshot)

    def _load_saved(self, state_dir: str) -> None:
        try:
            found = load_latest_checkpoint(state_dir, config_hash=self._config_hash)
        except CheckpointError as exc:
            logger.warning("ignoring the saved state in %s: %s", state_dir, exc)
            return
        if found is not None:
            state, path = found
            self._publish(make_snapshot(state["tensors"], state["meta"]))
            logger.info("serving the state saved in %s", path)

    def close(self) -> None:
        """Stop refreshing and serving."""
        self._task.stop()
        self._server.close()
