"""Peer state beyond one process: atomic, verified local checkpoints, and verified transfers between peers.

State transfer (docs/state-sync.md): a donor publishes its state as a :class:`ServedState` (its
canonical frames in a spool file, :func:`spool_state`, ``_served.py``) on a :class:`StateServer`
(``_server.py``); a joiner fetches a trusted donor's state or the median of several donors' with
:func:`download_state` (``_download.py``; its parts, snubbing and endgame in ``_schedule.py``; the
median and the checked progress in ``_merge.py``), both
over the wire protocol of ``_transfer_protocol.py``, and gets a decoded :class:`StateSnapshot`
(``_snapshot.py``: the canonical encoding and the digest). A bootstrap keeps and serves a copy with
:class:`StateMirror` (``_mirror.py``).
"""

from swarm.state._download import MIN_DONORS, DownloadOptions, download_state, fetch_state
from swarm.state._merge import MAX_PROGRESS, progress_of
from swarm.state._mirror import StateMirror, choose_donors, initial_peer_ids
from swarm.state._served import ServedState, default_spool_dir, spool_state
from swarm.state._server import MAX_STATES, ServeStats, SnapshotTooOld, StateServer
from swarm.state._snapshot import StateSnapshot, make_snapshot
from swarm.state._transfer_protocol import StateTransferError
from swarm.state.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    list_checkpoints,
    load_latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)

__all__ = [
    "FORMAT_VERSION",
    "MAX_PROGRESS",
    "MAX_STATES",
    "MIN_DONORS",
    "CheckpointError",
    "DownloadOptions",
    "ServeStats",
    "ServedState",
    "SnapshotTooOld",
    "StateMirror",
    "StateServer",
    "StateSnapshot",
    "StateTransferError",
    "choose_donors",
    "default_spool_dir",
    "download_state",
    "fetch_state",
    "initial_peer_ids",
    "list_checkpoints",
    "load_latest_checkpoint",
    "make_snapshot",
    "progress_of",
    "read_checkpoint",
    "save_checkpoint",
    "spool_state",
]
