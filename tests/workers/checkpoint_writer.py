"""A process that writes large checkpoints in a loop, for the shutdown tests (tests/test_shutdown.py).

It handles SIGTERM the way a trainer does (``peers._signals.shutdown_on_signals``): the first one
lets the save in progress finish, then the loop ends and the process exits 0; a second one
interrupts at once (KeyboardInterrupt, possibly mid-write). SIGKILL can land anywhere.
Started through a forkserver that has torch loaded, so each start costs a fork, not an import.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import torch

CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "swarm.state.checkpoint", "peers._signals"])


def state_of(step: int, numel: int) -> dict[str, Any]:
    """The checkpoint content of ``step``: the tests recompute it to check a loaded file is intact."""
    generator = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(numel, generator=generator)}, "step": step, "config_hash": "chaos"}


def write_forever(directory: str, first_step: int, numel: int, saved: Any, started: Any) -> None:
    """Save ``state_of(step)`` for step = first_step, first_step + 1, ... until SIGTERM.

    ``saved`` (a shared int) holds the last step whose save returned; ``started`` is set once the
    signal handler is installed.
    """
    from peers._signals import shutdown_on_signals
    from swarm.state.checkpoint import save_checkpoint

    with shutdown_on_signals() as stop:
        started.set()
        step = first_step
        while not stop.is_set():
            save_checkpoint(Path(directory), state_of(step, numel), step, keep=3)
            saved.value = step
            step += 1
