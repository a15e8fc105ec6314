"""Checkpoints: what a trainer of either kind keeps on disk, and resumes from (``--resume``).

A checkpoint is written periodically (``train.checkpoint_every_s``, after a completed round) and once
on the way out, at most one per (step, round), never of non-finite parameters; the files are written
atomically and the oldest are pruned (:mod:`swarm.state.checkpoint`). What goes in is the peer's own
state (a whole model, or one stage and its index) beside the progress, the config hash, so a
checkpoint of another run's config is never resumed, and the resolved run config itself (YAML), so
``swarm export --checkpoint DIR`` needs nothing else.

``train.checkpoint_dir: auto`` (the default) is a directory of this run and peer under
``$SWARM_HOME`` (:func:`checkpoint_dir_of`); :func:`claim_checkpoint_dir` resolves it for a peer
program and locks it (:class:`~swarm.state.checkpoint.DirectoryLock`): one live peer per directory.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import yaml

from swarm.config import RunConfig, swarm_home
from swarm.learning import all_finite
from swarm.state import load_latest_checkpoint, save_checkpoint
from swarm.state.checkpoint import CONFIG_KEY, DirectoryLock, DirectoryLockedError
from swarm.trainer._progress import Progress

logger = logging.getLogger(__name__)

AUTO = "auto"
"""``train.checkpoint_dir`` of a directory of the run and the peer under ``$SWARM_HOME``."""
DEFAULT_PEER_NAME = "peer"
MAX_AUTO_DIRECTORIES = 64
"""How many directories ``auto`` tries (``peer``, ``peer-2``, ...) before giving up: one per live
peer of this run on this machine."""


def config_yaml(config: RunConfig) -> str:
    """The resolved run config as YAML text, every key written (what a checkpoint carries)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def directory_name(peer_name: str) -> str:
    """``peer_name`` as one safe path component (letters, digits, ``_ . -``; no leading dot)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", peer_name)[:64].lstrip(".")
    return safe or DEFAULT_PEER_NAME


def default_checkpoint_dir(run_id: str, peer_name: str = DEFAULT_PEER_NAME) -> Path:
    """``$SWARM_HOME/runs/<run_id>/<peer>/checkpoints``."""
    return swarm_home() / "runs" / directory_name(run_id) / directory_name(peer_name) / "checkpoints"


def checkpoint_dir_of(config: RunConfig, peer_name: str = DEFAULT_PEER_NAME) -> Path | None:
    """Where ``config`` keeps checkpoints (``auto`` resolved for ``peer_name``); None: it keeps none."""
    value = config.train.checkpoint_dir
    if value is None:
        return None
    if value == AUTO:
        return default_checkpoint_dir(config.run.run_id, peer_name)
    return Path(value).expanduser()


def claim_checkpoint_dir(
    config: RunConfig, peer_name: str = DEFAULT_PEER_NAME
) -> tuple[RunConfig, DirectoryLock | None]:
    """``config`` with ``train.checkpoint_dir`` resolved to a directory this process now holds the
    lock of, and that lock (release it on the way out; None when the config keeps no checkpoints).

    ``auto`` takes the first of ``<peer>``, ``<peer>-2``, ... that no live peer holds, so two
    unnamed peers of one run on one machine each get their own; an explicit directory held by a live
    peer raises :class:`~swarm.state.checkpoint.DirectoryLockedError` naming the holder's pid."""
    base = checkpoint_dir_of(config, peer_name)
    if base is None:
        return config, None
    auto = config.train.checkpoint_dir == AUTO
    candidates = (
        [base]
        if not auto
        else [base]
        + [
            base.parent.with_name(f"{base.parent.name}-{n}") / base.name
            for n in range(2, MAX_AUTO_DIRECTORIES + 1)
        ]
    )
    for candidate in candidates:
        lock = DirectoryLock(candidate)
        try:
            lock.acquire()
        except DirectoryLockedError as error:
            if candidate == candidates[-1]:
                raise
            logger.info("%s; trying the next directory", error)
            continue
        train = config.train.model_copy(update={"checkpoint_dir": str(candidate)})
        return config.model_copy(update={"train": train}), lock
    raise AssertionError("unreachable: the last candidate raises")


class Checkpoints:
    """A trainer's checkpoints in ``train.checkpoint_dir`` (none kept when it is null)."""

    def __init__(self, config: RunConfig, progress: Progress) -> None:
        directory = checkpoint_dir_of(config)
        self.directory = None if directory is None else os.fspath(directory)
        self.every_s = config.train.checkpoint_every_s
        self.config_hash = config.config_hash()
        self.config_yaml = config_yaml(config)
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
            full = {
                **state(),
                "progress": self.progress.checkpoint_state(),
                "config_hash": self.config_hash,
                CONFIG_KEY: self.config_yaml,
            }
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
