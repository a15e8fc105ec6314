"""Atomic, verified local checkpoints.

A checkpoint file is a fixed header followed by a ``torch.save`` payload::

    magic "SWARMCKP" (8 bytes) | format version (u32) | payload length (u64) | sha256 of payload (32 bytes)

Saving writes a hidden temporary file in the checkpoint directory, fsyncs it, renames it over its
final name and fsyncs the directory, so after a crash a checkpoint is either whole or absent (and a
leftover temporary file never looks like a checkpoint). A temporary file left by a writer that died
(SIGKILL, power loss) is removed by the next save into the same directory.

Loading trusts nothing: it checks the magic, version, length and checksum *before* handing the
payload to ``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers and
never runs pickled code.

The state is a plain dict; peers store ``model``, ``inner_optimizer``, ``outer_optimizer``,
``progress``, ``config_hash`` and ``config`` (the resolved run config as YAML text, so that the
checkpoint alone rebuilds its model; older checkpoints lack it) in it, and a checkpoint of another
config hash is refused.

A directory is written by one live peer at a time: :class:`DirectoryLock` (``_lock.py``).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import struct
from pathlib import Path
from typing import Any

import torch

from swarm._errors import SwarmError
from swarm.state._lock import LOCK_FILE, DirectoryLock, DirectoryLockedError

__all__ = [
    "CONFIG_KEY",
    "FORMAT_VERSION",
    "LOCK_FILE",
    "MAX_STEP",
    "CheckpointError",
    "DirectoryLock",
    "DirectoryLockedError",
    "checkpoint_path",
    "list_checkpoints",
    "load_latest_checkpoint",
    "read_checkpoint",
    "remove_stale_temporaries",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

MAGIC = b"SWARMCKP"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")
HEADER_SIZE = _HEADER.size
CONFIG_KEY = "config"
"""The key of the resolved run config (YAML text) in a trainer's checkpoint state."""
MAX_STEP = 10**18 - 1
"""The largest step a checkpoint is named by (18 digits). Names are zero-padded to 12 digits and
listed with up to 18, so every file the writer can produce is listed, and so pruned."""
_NAME = re.compile(r"^ckpt-(\d{12,18})\.pt$")
_TEMPORARY = re.compile(r"^\.ckpt-\d{12,18}\.pt\.(\d+)\.tmp$")


class CheckpointError(SwarmError):
    """A checkpoint cannot be used: corrupt, or from a different run config."""


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of ``step`` goes; ValueError unless ``0 <= step <= MAX_STEP``."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ValueError(f"a checkpoint step must be an integer in [0, {MAX_STEP}], got {step!r:.40}")
    return Path(directory) / f"ckpt-{step:012d}.pt"


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of the files named like checkpoints, newest first (temporary files excluded)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and p.is_file()]
    return sorted(found, reverse=True)


def remove_stale_temporaries(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files of writers that are gone; return what was removed.

    A writer killed mid-save leaves ``.ckpt-<step>.pt.<pid>.tmp`` behind. The file of a process
    that still runs (another writer, or this one) is left alone: it may be mid-write.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    removed = []
    for path in root.iterdir():
        match = _TEMPORARY.match(path.name)
        if match is None or _process_alive(int(match.group(1))):
            continue
        path.unlink(missing_ok=True)
        removed.append(path)
    if removed:
        logger.info("removed %d temporary file(s) of interrupted checkpoint writes in %s", len(removed), root)
    return removed


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: str | os.PathLike[str], state: dict[str, Any], step: int, keep: int = 3
) -> Path:
    """Write ``state`` atomically as the checkpoint of ``step``; keep only the newest ``keep`` ones.

    ``step`` must be an integer in ``[0, MAX_STEP]`` (ValueError): every name written is one that
    :func:`list_checkpoints` lists, so none escapes pruning."""
    if keep < 1:
        raise ValueError(f"need keep >= 1, got keep={keep}")
    root = Path(directory)
    final = checkpoint_path(root, step)
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(root)
    temporary = root / f".{final.name}.{os.getpid()}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(bytes(HEADER_SIZE))  # the header needs the payload's length and digest: last
            payload = _HashingWriter(handle)
            torch.save(state, payload)  # streamed to the file: no in-memory copy of a model-sized state
            handle.seek(0)
            handle.write(_HEADER.pack(MAGIC, FORMAT_VERSION, payload.length, payload.sha256.digest()))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(root)
    logger.info("checkpoint of step %d saved to %s (%d bytes)", step, final, payload.length + HEADER_SIZE)
    for _, old in list_checkpoints(root)[keep:]:
        old.unlink(missing_ok=True)
    return final


class _HashingWriter:
    """A write-only file object that passes bytes on to ``handle`` while hashing and counting them."""

    def __init__(self, handle: io.BufferedWriter) -> None:
        self._handle = handle
        self.sha256 = hashlib.sha256()
        self.length = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.length += memoryview(data).nbytes
        return self._handle.write(data)

    def flush(self) -> None:
        self._handle.flush()


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Verify and load one checkpoint file; :class:`CheckpointError` names what is wrong with it.

    The payload is hashed in pieces, then loaded straight from the file: host memory holds the loaded
    state once, never the file's bytes beside it. (The file is not changed in place by anyone: a
    checkpoint is written under another name and renamed.)"""
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        header = handle.read(HEADER_SIZE)
        if len(header) < HEADER_SIZE:
            raise CheckpointError(f"{len(header)} bytes, shorter than the {HEADER_SIZE}-byte header")
        magic, version, length, digest = _HEADER.unpack(header)
        if magic != MAGIC:
            raise CheckpointError(f"bad magic {magic!r}, not a swarm checkpoint")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"format version {version}, this program reads {FORMAT_VERSION}")
        if size - HEADER_SIZE != length:
            raise CheckpointError(f"payload is {size - HEADER_SIZE} bytes, header says {length} (truncated?)")
        if _sha256_of(handle, length) != digest:
            raise CheckpointError("payload checksum mismatch (corrupted)")
        payload = io.BufferedReader(_Window(handle, HEADER_SIZE, length), buffer_size=1 << 20)
        try:
            state = torch.load(payload, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(f"payload does not load: {error}") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"payload is a {type(state).__name__}, not a dict")
    return state


def _sha256_of(handle: io.BufferedReader, length: int, piece: int = 8 << 20) -> bytes:
    """The sha256 of the next ``length`` bytes of ``handle``, read ``piece`` bytes at a time."""
    digest = hashlib.sha256()
    left = length
    while left:
        data = handle.read(min(piece, left))
        if not data:
            break
        digest.update(data)
        left -= len(data)
    return digest.digest()


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of a file from ``start``: what ``torch.load``
    reads the payload through, without the header in front of it."""

    def __init__(self, handle: io.BufferedReader, start: int, length: int) -> None:
        super().__init__()
        self._handle, self._start, self._length, self._position = handle, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        count = max(0, min(len(buffer), self._length - self._position))
        if not count:
            return 0
        self._handle.seek(self._start + self._position)
        read = self._handle.readinto(memoryview(buffer)[:count])
        self._position += read
        return read


def load_latest_checkpoint(
    directory: str | os.PathLike[str], *, config_hash: str | None = None
) -> tuple[dict[str, Any], Path] | None:
    """The newest valid checkpoint in ``directory`` as ``(state, path)``, or None when there is none.

    Invalid files are skipped with a warning naming the file and the reason. When ``config_hash`` is
    given, a valid checkpoint whose ``state["config_hash"]`` differs raises :class:`CheckpointError`:
    resuming another run's state would be silently wrong.
    """
    for _, path in list_checkpoints(directory):
        try:
            state = read_checkpoint(path)
        except (CheckpointError, OSError) as error:
            logger.warning("skipping checkpoint %s: %s", path, error)
            continue
        if config_hash is not None and state.get("config_hash") != config_hash:
            raise CheckpointError(
                f"checkpoint {path} belongs to config hash {state.get('config_hash')!r}, this run is "
                f"{config_hash!r}; use another train.checkpoint_dir or the original config"
            )
        return state, path
    return None
