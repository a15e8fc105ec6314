"""Test helpers for peers in separate processes: spawn, read their output with deadlines, clean up.

Every process starts in its own session, so that the whole tree it creates (DHT worker, ``p2pd``)
can be found and killed afterwards, and leaks can be detected by session id.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent


class PeerProcess:
    """A child process whose stdout+stderr lines are collected by a reader thread."""

    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO):
        self.args = args
        self.proc = subprocess.Popen(
            args,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.sid = self.proc.pid
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """Return the first line (old or new) satisfying ``predicate``; fail after ``timeout`` seconds."""
        for line in self.lines:
            if predicate(line):
                return line
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no matching line within {timeout}s from {self.args}:\n{self.output()}")
            try:
                line = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process exited ({self.proc.wait()}) before the line:\n{self.output()}")
            self.lines.append(line)
            if predicate(line):
                return line

    def drain(self) -> None:
        """Move every line read so far into :attr:`lines`."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return
            if line is not None:
                self.lines.append(line)

    def output(self) -> str:
        self.drain()
        return "\n".join(self.lines)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        reader_deadline = time.monotonic() + 5
        while self.proc.stdout and not self.proc.stdout.closed and time.monotonic() < reader_deadline:
            self.drain()
            if self._queue.empty():
                break
        self.drain()
        return code

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill_session(self) -> None:
        """SIGKILL every process left in this child's session (the child, its DHT worker, p2pd)."""
        for proc in session_processes({self.sid}):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def session_processes(sids: set[int]) -> list[psutil.Process]:
    """Live (non-zombie) processes whose session id is one of ``sids``."""
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) in sids:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def wait_until(condition: Callable[[], bool], timeout: float, what: str, period: float = 0.2) -> float:
    """Poll ``condition`` until true; return the seconds it took, or fail naming ``what``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(period)
    return time.monotonic() - start


def swarm_cli(*args: str) -> list[str]:
    """The argv for running the ``swarm`` CLI with this interpreter."""
    return [sys.executable, "-m", "peers.cli", *args]


def terminate_and_wait(process: PeerProcess, timeout: float = 10.0) -> int:
    """SIGTERM a peer and return its exit status, failing if it takes longer than ``timeout``."""
    process.signal(signal.SIGTERM)
    return process.wait(timeout=timeout)
