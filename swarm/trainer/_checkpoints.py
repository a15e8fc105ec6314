"""Checkpoints: what a trainer of either kind keeps on disk, and resumes from (``--resume``).

A checkpoint is written periodically (``train.checkpoint_every_s``, after a completed round) and once
on the way out, at most one per (step, round), never of non-finite parameters; the files are written
atomically and the oldest are pruned (:mod:`swarm.state.checkpoint`). What goes in is the peer's own
state (a whole model, or one stage and its index) beside the progress and the config hash, so a
checkpoint of another run's config is never resumed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from swarm.config import RunConfig
from swarm.learning import all_finite
from swarm.state import load_latest_checkpoint, save_checkpoint
from swarm.trainer._progress import Progress

logger = logging.getLogger(__name__)


class Checkpoints:
    """A trainer's checkpoints in ``train.checkpoint_dir`` (none kept when it is unset)."""

    def __init__(self, config: RunConfig, progress: Progress) -> None:
        directory = config.train.checkpoint_dir
        self.directory = None if directory is None else os.path.expanduser(directory)
        self.every_s = config.train.checkpoint_every_s
        self.config_hash = config.config_hash()
        self.progress = progress
        self._saved: tuple[tuple[int, int], Path] | None = None  # (step, round) of the newest
        self._last = time.monotonic()

    def due(self) -> bool:
        """Whether a periodic checkpoint is due (never without a directory)."""
        return self.directory is not None and time.monotonic() - self._last >= self.every_s

    def save(
        self, state: Callable[[], dict[str, Any]], parameters: Callable[[], Iterable[torch.Tensor]]
    ) -> Path | None:
        """Write ``state()`` with the progress and the config hash, unless the newest checkpoint holds
        this step and round already, or ``parameters()`` are not finite; the newest checkpoint's path."""
        if self.directory is None:
            return None
        self._last = time.monotonic()
        if not all_finite(p.detach() for p in parameters()):
            logger.warning(
                "not saving a checkpoint at step %d: the parameters are not finite", self.progress.step
            )
            return self._saved[1] if self._saved is not None else None
        at = (self.progress.step, self.progress.round)
        if self._saved is None or self._saved[0] != at:
            full = {**state(), "progress": self.progress.checkpoint_state(), "config_hash": self.config_hash}
            self._saved = (at, save_checkpoint(self.directory, full, self.progress.step))
        return self._saved[1]

    def load_latest(self) -> tuple[dict[str, Any], Path] | None:
        """The newest valid checkpoint of this config with its path (None: start fresh), its progress
        restored; ValueError without ``train.checkpoint_dir``."""
        if self.directory is None:
            raise ValueError("--resume needs train.checkpoint_dir")
        found = load_latest_checkpoint(self.directory, config_hash=self.config_hash)
        if found is None:
            logger.warning("no valid checkpoint in %s: starting fresh", self.directory)
            return None
        self.progress.restore(found[0]["progress"])
        return found
