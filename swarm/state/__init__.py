"""Peer state beyond one process: atomic, verified local checkpoints, and verified transfers between peers.

State transfer (docs/state-sync.md): a donor serves snapshots on a :class:`StateServer`
(``_server.py``), a joiner fetches one from several donors with :func:`download_state`
(``_download.py``; the donors' states merged by ``_merge.py`` when they differ), both over the wire
protocol of ``_transfer_protocol.py``. A bootstrap keeps and serves a copy with :class:`StateMirror`
(``_mirror.py``).
"""

from swarm.state._download import download_state
from swarm.state._mirror import StateMirror, choose_donors, progress_of
from swarm.state._server import ServeStats, StateServer
from swarm.state._transfer_protocol import StateSnapshot, StateTransferError, make_snapshot
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
    "CheckpointError",
    "ServeStats",
    "StateMirror",
    "StateServer",
    "StateSnapshot",
    "StateTransferError",
    "choose_donors",
    "download_state",
    "list_checkpoints",
    "load_latest_checkpoint",
    "make_snapshot",
    "progress_of",
    "read_checkpoint",
    "save_checkpoint",
]
