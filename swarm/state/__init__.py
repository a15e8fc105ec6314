"""Peer state beyond one process: atomic, verified local checkpoints, and verified downloads from donors."""

from swarm.state.checkpoint import (
    FORMAT_VERSION,
    CheckpointError,
    list_checkpoints,
    load_latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from swarm.state.transfer import (
    ServeStats,
    StateServer,
    StateSnapshot,
    StateTransferError,
    download_state,
    make_snapshot,
)

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "ServeStats",
    "StateServer",
    "StateSnapshot",
    "StateTransferError",
    "download_state",
    "list_checkpoints",
    "load_latest_checkpoint",
    "make_snapshot",
    "read_checkpoint",
    "save_checkpoint",
]
