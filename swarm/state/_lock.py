"""One live peer per checkpoint directory: an advisory lock file, held for as long as the peer runs.

Two peers writing checkpoints into one directory interleave them, and a later ``--resume`` takes the
other peer's. So a peer takes ``DIR/.lock`` with ``flock(LOCK_EX | LOCK_NB)`` on an open descriptor
before it trains. The kernel drops the lock when the descriptor closes, which it does on *any* exit
(a crash, SIGKILL, the OOM killer), so a lock is never left held by a process that is gone. The file
holds the holder's pid, host and start time, for the error a second peer gets.

The file itself stays behind on release, emptied: removing it would let a third peer lock a new file
under the same name while a second one still waits on the old one. A file that still names a holder
but is not locked was left by a process that died (its pid is in the warning): it is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from swarm._errors import SwarmError

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"
_MAX_HOLDER_BYTES = 256


class DirectoryLockedError(SwarmError):
    """The directory is held by another live process."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(
            f"checkpoint directory {directory} is in use by another peer ({holder}); give each peer "
            "its own train.checkpoint_dir, or stop that peer first"
        )
        self.directory = directory
        self.holder = holder


class DirectoryLock:
    """An exclusive lock on ``directory`` (created if missing) for one process; a context manager.

    :meth:`acquire` raises :class:`DirectoryLockedError` naming the holder while another open
    descriptor (of this process or another) holds it."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory).expanduser()
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None
        self.stale_holder: str | None = None
        """Who the lock file named when it was taken over from a process that had died (else None)."""

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise DirectoryLockedError(self.directory, _read_holder(fd) or "holder unknown") from None
            previous = _read_holder(fd)
            if previous:
                self.stale_holder = previous
                logger.warning(
                    "taking over the lock of %s: it names %s, which no longer holds it (it exited without "
                    "releasing it: killed, or crashed)",
                    self.directory,
                    previous,
                )
            _write_holder(
                fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
            )
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Empty the file and drop the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> DirectoryLock:
        self.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    """The holder the file names (printable text only: the file may have been written by anyone)."""
    try:
        data = os.pread(fd, _MAX_HOLDER_BYTES, 0)
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace").strip()
    return "".join(c if c.isprintable() else "?" for c in text)


def _write_holder(fd: int, holder: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, holder.encode() + b"\n", 0)
