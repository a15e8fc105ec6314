"""StateMirror: a bootstrap's copy of the swarm's latest state, and which donors a state comes from.

A bootstrap started with ``--serve-state`` keeps a copy of the latest state the live trainers announce
and is a donor too, so a joiner finds one even when no trainer is online; a joiner that was given the
bootstrap as an initial peer trusts that copy (the bootstrap's signed record names its digest). The
copy is made on the same robust path a joiner without a trusted donor takes: the coordinate-wise
median of at least three distinct trainer states, never one or two of them.
:func:`choose_donors` picks the members to download from (a joiner uses it as well). See
docs/state-sync.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm._periodic import PeriodicTask
from swarm.state._download import MIN_DONORS, download_state
from swarm.state._merge import progress_of
from swarm.state._server import StateServer
from swarm.state._snapshot import StateSnapshot, make_snapshot
from swarm.state._transfer_protocol import StateTransferError
from swarm.state.checkpoint import CheckpointError, load_latest_checkpoint, save_checkpoint

if TYPE_CHECKING:
    from swarm._node import SwarmNode
    from swarm.membership import Member

logger = logging.getLogger(__name__)

MAX_REFUSED = 3
"""Refreshes in a row whose state has less progress than the kept one that the mirror refuses;
after that it takes the trainers' state: a kept state whose progress was inflated cannot freeze the
copy for good."""


def initial_peer_ids(maddrs: Iterable[str]) -> frozenset[str]:
    """The peer ids the user named in ``network.initial_peers`` (the last ``/p2p/<id>`` of each
    address, the target of a relayed one): the donors a joiner trusts."""
    ids = set()
    for maddr in maddrs:
        parts = maddr.split("/")
        found = [parts[i + 1] for i, part in enumerate(parts[:-1]) if part == "p2p"]
        if found:
            ids.add(found[-1])
    return frozenset(ids)


def choose_donors(
    members: Iterable[Member],
    self_id: str,
    *,
    roles: Iterable[str] = ("trainer", "bootstrap"),
    trusted: Collection[str] = (),
) -> list[tuple[str, str]]:
    """(peer id, announced digest) of the members to download state from.

    Only dialable members (not in client mode) of ``roles`` that announce a state count: the
    ``trusted`` ones first, then by role in the order of ``roles`` (live trainers before a bootstrap
    keeping a copy). :func:`~swarm.state.download_state` decides what to take from them.
    """
    order = list(roles)
    usable = [m for m in members if m.peer_id != self_id and m.record.role in order and m.record.state_hash]
    usable = [m for m in usable if not m.record.client_mode]
    usable.sort(key=lambda m: (m.peer_id not in trusted, order.index(m.record.role)))
    return [(m.peer_id, m.record.state_hash) for m in usable]


@dataclass(frozen=True)
class MirrorStatus:
    """What a :class:`StateMirror` holds now, and why it took nothing new at its last refresh.

    ``donors``: how many distinct trainer states the kept copy is the median of (0: loaded from
    ``state_dir``). ``live_trainers`` and ``distinct_states``: what the last refresh saw. ``reason``:
    why that refresh kept what it had ("" when it took a new state, or before the first refresh)."""

    holding: bool
    round: int = 0
    step: int = 0
    samples_total: int = 0
    donors: int = 0
    taken_at: float = 0.0
    refreshes: int = 0
    live_trainers: int = 0
    distinct_states: int = 0
    min_donors: int = MIN_DONORS
    reason: str = ""

    def describe(self, now: float | None = None) -> str:
        """One line for a person: what is served (from how many donors, at what step), or why nothing."""
        now = time.time() if now is None else now
        if not self.holding:
            return f"holds no state yet: {self.reason or 'no refresh has run yet'}"
        source = f"the median of {self.donors} trainer state(s)" if self.donors else "the state saved on disk"
        text = (
            f"serving step {self.step} (round {self.round}, {self.samples_total} samples), "
            f"{source}, taken {max(0.0, now - self.taken_at):.0f}s ago"
        )
        return f"{text}; kept at the last refresh: {self.reason}" if self.reason else text


def _too_few(live: int, distinct: int, min_donors: int) -> str:
    if live == 0:
        return f"no trainer is live (it needs {min_donors} distinct trainer states)"
    if live < min_donors:
        return f"fewer than {min_donors} trainers live: {live}"
    return f"fewer than {min_donors} distinct new trainer states: {distinct} (from {live} trainers live)"


class StateMirror:
    """A bootstrap's copy of the swarm's latest state, refreshed from live trainers and served to joiners.

    Every ``interval_s`` it downloads the state the live trainers announce, as a joiner without a
    trusted donor would: the coordinate-wise median of at least ``min_donors`` distinct trainer states
    (those announcing the copy it already serves do not count), each verified frame by frame. With
    fewer it keeps what it has. It publishes the result on its own :class:`StateServer` (by default one
    on ``node``'s DHT) and, with ``state_dir``, writes it there atomically; a restarted bootstrap serves
    the newest valid file at once. A state with less progress than the kept one is refused up to
    :data:`MAX_REFUSED` refreshes in a row. ``download`` is :func:`download_state` or one with its
    signature; ``download_options`` go to it as they are (e.g. the receive floor's ``min_rate`` and
    ``window_s``): a refresh is bounded like a joiner's download (a slow or silent trainer is dropped,
    the median taken without it), so a trainer cannot freeze the copy. Call :meth:`start`, then
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
        min_donors: int = MIN_DONORS,
        server: StateServer | None = None,
        download: Callable[..., StateSnapshot] = download_state,
        download_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._node, self._state_dir, self._config_hash = node, state_dir, config_hash
        self._options = dict(download_options or {})
        self._on_update, self._min_donors, self._download = on_update, min_donors, download
        self._lock = threading.Lock()
        self._snapshot: StateSnapshot | None = None
        self._behind: set[str] = set()  # digests of states with less progress than ours: not fetched again
        self._refused = 0  # refreshes in a row that were behind the kept state
        self._status = MirrorStatus(holding=False, min_donors=min_donors)
        self._server = server if server is not None else StateServer(node.dht, node.info.run_id)
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

    @property
    def status(self) -> MirrorStatus:
        """What is held now and what the last refresh saw (see :class:`MirrorStatus`)."""
        with self._lock:
            return self._status

    def _note(self, reason: str, live: int, distinct: int) -> None:
        """Record the outcome of a refresh (``reason`` "" when a new state was taken)."""
        with self._lock:
            self._status = dataclasses.replace(
                self._status,
                refreshes=self._status.refreshes + 1,
                live_trainers=live,
                distinct_states=distinct,
                reason=reason,
            )

    def start(self) -> None:
        """Serve the saved copy (if any), then fetch once now and every ``interval_s`` in a thread."""
        if self._state_dir is not None:
            self._load_saved(self._state_dir)
        self._task.start()

    def refresh(self) -> bool:
        """Fetch the median of the trainers' current states if there are enough new ones; return whether
        ours changed."""
        own = self.digest
        members = self._node.members()
        live = sum(m.record.role == "trainer" and m.peer_id != self._node.peer_id for m in members)
        donors = [d for d in choose_donors(members, self._node.peer_id, roles=("trainer",)) if d[1] != own]
        digests = {digest for _, digest in donors}
        if len(digests) < self._min_donors or digests <= self._behind:
            logger.debug("%d new distinct trainer state(s): keeping the copy", len(digests))
            if len(digests) < self._min_donors:
                reason = _too_few(live, len(digests), self._min_donors)
            else:
                reason = "the trainers' states are behind the kept one"
            self._note(reason, live, len(digests))
            return False
        if not self._server.can_publish():  # the state it replaced is still named by our record
            logger.debug("the replaced state is still served: keeping the copy for now")
            self._note("the state it replaced is still being served", live, len(digests))
            return False
        options = {**self._options, "run_id": self._node.info.run_id, "min_donors": self._min_donors}
        try:
            snapshot = self._download(self._node.dht, donors, **options)
        except (StateTransferError, ValueError, OSError) as exc:
            self._note(f"the download failed: {exc}", live, len(digests))
            raise
        samples = progress_of(snapshot.meta)["samples_total"]
        kept = self.snapshot
        if kept is not None and samples < progress_of(kept.meta)["samples_total"]:
            self._refused += 1
            if self._refused < MAX_REFUSED:
                logger.info("not replacing the kept state by one with less progress (%d samples)", samples)
                self._behind |= digests
                self._note(f"the trainers' state has less progress ({samples} samples)", live, len(digests))
                return False
            logger.warning("the trainers' state was behind the kept one %d times: taking it", self._refused)
        self._refused = 0
        self._publish(snapshot, donors=len(set(snapshot.sources)) or len(digests))
        self._note("", live, len(digests))
        if self._state_dir is not None:
            state = {"tensors": snapshot.tensors, "meta": snapshot.meta, "config_hash": self._config_hash}
            save_checkpoint(self._state_dir, state, samples, keep=2)
        return True

    def _refresh_logged(self) -> None:
        try:
            self.refresh()
        except (StateTransferError, ValueError, OSError) as exc:
            logger.warning("could not refresh the kept state: %s", exc)

    def _publish(self, snapshot: StateSnapshot, donors: int) -> None:
        self._server.publish(snapshot)
        progress = progress_of(snapshot.meta)
        with self._lock:
            self._snapshot = snapshot
            self._status = dataclasses.replace(
                self._status,
                holding=True,
                round=progress["round"],
                step=progress["step"],
                samples_total=progress["samples_total"],
                donors=donors,
                taken_at=time.time(),
            )
        self._node.announce_now()
        if self._on_update is not None:
            self._on_update(snapshot)

    def _load_saved(self, state_dir: str) -> None:
        try:
            found = load_latest_checkpoint(state_dir, config_hash=self._config_hash)
        except CheckpointError as exc:
            logger.warning("ignoring the saved state in %s: %s", state_dir, exc)
            return
        if found is None:
            return
        state, path = found
        try:
            progress_of(state["meta"])
            snapshot = make_snapshot(state["tensors"], state["meta"])
        except (KeyError, TypeError, ValueError, AttributeError, StateTransferError) as exc:
            logger.warning("ignoring the saved state %s: %s", path, exc)
            return
        self._publish(snapshot, donors=0)
        logger.info("serving the state saved in %s", path)

    def close(self) -> None:
        """Stop refreshing and serving."""
        self._task.stop()
        self._server.close()
