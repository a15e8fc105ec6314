"""Peer state that outlives a process: atomic, verified local checkpoints."""

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
    "list_checkpoints",
    "load_latest_checkpoint",
    "read_checkpoint",
    "save_checkpoint",
]
