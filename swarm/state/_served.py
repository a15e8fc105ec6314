"""ServedState: a published state, its canonical frames kept in a spool file outside the Python heap.

A donor serves the same frames to every joiner, so it encodes them once, when it publishes: tensor
by tensor into an unnamed temporary file, hashing each frame as it is written. Serving reads one
frame back by its offset (``os.pread``). Memory: one tensor's bf16 encoding while publishing, one
frame per stream while serving, and about 100 bytes per frame (its hash and offset) while published;
never a copy of the model. Disk: the frames, 2 bytes per value (anchor and momentum: 4 bytes per
parameter of the model), in :func:`default_spool_dir` unless told where: not ``/tmp``, which is
often a tmpfs (memory).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import IO, Any

import torch

from swarm.compression import DecodeLimits, FrameError, TensorStreamDecoder
from swarm.state._snapshot import (
    DEFAULT_CHUNK_BYTES,
    StateSnapshot,
    build_snapshot,
    canonical_frames,
    canonical_meta,
    check_chunk_bytes,
    state_digest,
)
from swarm.state._transfer_protocol import MAX_FRAMES

_DISK_TMP = "/var/tmp"


@dataclass(frozen=True, eq=False)
class ServedState:
    """A published state: meta, the sha256 of each canonical frame and its place in ``spool``, an
    unnamed temporary file holding the frames. Build with :func:`spool_state`.

    :meth:`frame` may be called from any thread (``os.pread`` has no shared file position). Whoever
    holds it closes it (:meth:`close`, or use it as a context manager); a :class:`StateServer` closes
    the states published on it once nothing serves them any more.
    """

    meta: dict[str, Any]
    chunk_bytes: int
    hashes: tuple[bytes, ...]
    offsets: tuple[int, ...] = field(repr=False)
    """Where each frame starts in ``spool``, then where the last one ends."""
    spool: IO[bytes] = field(repr=False, compare=False)
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.hashes) + 1:
            raise ValueError("a served state needs one offset per frame and the end")
        digest = state_digest(canonical_meta(self.meta), self.chunk_bytes, self.hashes)
        object.__setattr__(self, "digest", digest)

    @property
    def frame_count(self) -> int:
        return len(self.hashes)

    @property
    def nbytes(self) -> int:
        """Bytes of all frames: what a joiner downloads, and what the spool file holds."""
        return self.offsets[-1]

    def frame(self, index: int) -> bytes:
        """Canonical frame ``index``, read from the spool and checked against its hash (a frame the
        disk changed is never sent: OSError). ValueError once closed."""
        start, end = self.offsets[index], self.offsets[index + 1]
        data = os.pread(self.spool.fileno(), end - start, start)
        if hashlib.sha256(data).digest() != self.hashes[index]:
            raise OSError(f"frame {index} of the spooled state {self.digest[:12]} no longer matches its hash")
        return data

    def decode(self, limits: DecodeLimits = DecodeLimits()) -> StateSnapshot:
        """The decoded state (float32 CPU tensors), read frame by frame; FrameError if it does not decode."""
        decoder = TensorStreamDecoder(limits=limits)
        for index in range(self.frame_count):
            decoder.feed(self.frame(index))
        snapshot = build_snapshot(decoder.finish(), self.meta, self.chunk_bytes)
        if snapshot.digest != self.digest:
            raise FrameError(f"the spooled state {self.digest[:12]} decodes to another digest")
        return snapshot

    @property
    def closed(self) -> bool:
        return self.spool.closed

    def close(self) -> None:
        """Free the spool file (its space goes back to the disk at once). Idempotent."""
        self.spool.close()

    def __enter__(self) -> ServedState:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def default_spool_dir() -> str:
    """Where a state is spooled when no directory is given: ``$TMPDIR`` when set (the user's choice),
    else ``/var/tmp`` (kept on disk across reboots, so not a tmpfs in practice) when it is writable,
    else the system's temporary directory. ``/tmp`` is a tmpfs on many distributions, where each
    spooled state would take its size in memory."""
    chosen = os.environ.get("TMPDIR")
    if chosen and os.path.isdir(chosen):
        return chosen
    if os.path.isdir(_DISK_TMP) and os.access(_DISK_TMP, os.W_OK | os.X_OK):
        return _DISK_TMP
    return tempfile.gettempdir()


def spool_state(
    tensors: Mapping[str, torch.Tensor],
    meta: Mapping[str, Any],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    spool_dir: str | None = None,
) -> ServedState:
    """Encode ``tensors`` (on any device; read one at a time, never copied whole) into their canonical
    frames in a new spool file in ``spool_dir`` (default: :func:`default_spool_dir`; it should be on a
    disk, not in memory), hashing each frame as it is written.

    The file has no name: it is created unlinked (``O_TMPFILE``) or unlinked at once, so nothing is
    left behind, even after SIGKILL. Raises ValueError (NaN/Inf or a value beyond bf16's range, meta
    that is not plain JSON, ``chunk_bytes`` out of range, more frames than a header can list) or
    OSError (the disk); then no file is left open.
    """
    meta_json = canonical_meta(meta)
    check_chunk_bytes(chunk_bytes)
    spool = tempfile.TemporaryFile(dir=spool_dir or default_spool_dir())  # noqa: SIM115 (the ServedState owns it)
    try:
        hashes: list[bytes] = []
        offsets = [0]
        for frame in canonical_frames(tensors, chunk_bytes):
            if len(hashes) == MAX_FRAMES:
                raise ValueError(f"the state needs more than {MAX_FRAMES} frames: raise chunk_bytes")
            spool.write(frame)
            hashes.append(hashlib.sha256(frame).digest())
            offsets.append(offsets[-1] + len(frame))
        spool.flush()
        return ServedState(json.loads(meta_json), chunk_bytes, tuple(hashes), tuple(offsets), spool)
    except BaseException:
        spool.close()
        raise
