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
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest

REPO = Path(__file__).resolve().parent.parent

heavy_scenario = pytest.mark.xdist_group("heavy-scenarios")
"""Marks a scenario of many CPU-hungry processes (whole swarms). Under ``--dist loadgroup``
(scripts/test.sh) they all run in one xdist worker, so at most one runs at a time, beside lighter
tests: side by side on 2 cores they slowed each other down (churn: 162 s in a full run, 262 s beside
three other scenarios), and a joiner beside two of them did not start within 90 s on CI."""


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
        self.ended = False  # the reader has seen the end of the output (the process exited)
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for_line(self, predicate: Callable[[str], bool], timeout: float, since: int = 0) -> str:
        """Return the first line (old or new, from line number ``since`` on) satisfying ``predicate``;
        fail after ``timeout`` seconds."""
        self.drain()
        for line in self.lines[since:]:
            if predicate(line):
                return line
        deadline = time.monotonic() + timeout
        while True:
            if self.ended:
                raise AssertionError(f"process exited ({self.proc.wait()}) before the line:\n{self.output()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.dump_stacks()
                raise AssertionError(f"no matching line within {timeout}s from {self.args}:\n{self.output()}")
            line = self._take(remaining)
            if line is not None and predicate(line):
                return line

    def _take(self, timeout: float | None) -> str | None:
        """Move the reader's next line into :attr:`lines` and return it, waiting at most ``timeout``
        seconds for it (None: not at all); None if there is none yet or the output ended."""
        try:
            line = self._queue.get_nowait() if timeout is None else self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if line is None:
            self.ended = True
        else:
            self.lines.append(line)
        return line

    def drain(self) -> None:
        """Move every line read so far into :attr:`lines`."""
        while self._take(None) is not None:
            pass

    def mark(self) -> int:
        """The number of lines read so far: pass it as ``since`` to wait for a line printed after now."""
        self.drain()
        return len(self.lines)

    def output(self) -> str:
        self.drain()
        return "\n".join(self.lines)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit and return its status; fail, with its output, after ``timeout``."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            raise AssertionError(f"still running after {timeout}s: {self.args}\n{self.output()}") from None
        # the rest of its output: up to the end of the stream (children that inherited it, such as
        # its DHT worker, may hold it open a moment longer; a bounded wait)
        reader_deadline = time.monotonic() + 5
        while not self.ended and (remaining := reader_deadline - time.monotonic()) > 0:
            if self._take(remaining) is None:
                break
        self.drain()
        return code

    def dump_stacks(self, collect_s: float = 3.0) -> None:
        """Ask every Python process of this child's session that handles SIGUSR1 (``swarm`` programs,
        ``peers._common.enable_stack_dumps``) for its threads' stacks, and collect what they print for
        up to ``collect_s`` seconds: a failing test then shows where a process that did not get on was
        stuck. Others are left alone: SIGUSR1 would kill them before the leak checks look."""
        for proc in session_processes({self.sid}):
            with contextlib.suppress(psutil.Error, OSError):
                if "python" in proc.name().lower() and _catches(proc.pid, signal.SIGUSR1):
                    proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + collect_s
        while not self.ended and (remaining := deadline - time.monotonic()) > 0:
            self._take(remaining)

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill_session(self) -> None:
        """SIGKILL every process left in this child's session (the child, its DHT worker, p2pd)."""
        for proc in session_processes({self.sid}):
            with contextlib.suppress(psutil.Error):
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def stop_training(stop: threading.Event, threads: Sequence[threading.Thread], timeout: float) -> None:
    """Set ``stop``, then give each of the training ``threads`` ``timeout`` seconds to end; fail if one
    has not."""
    stop.set()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), "training did not stop in time"


def session_processes(sids: set[int]) -> list[psutil.Process]:
    """Live (non-zombie) processes whose session id is one of ``sids``."""
    return _live_processes(os.getsid, sids)


def group_processes(pgids: set[int]) -> list[psutil.Process]:
    """Live (non-zombie) processes whose process group id is one of ``pgids``."""
    return _live_processes(os.getpgid, pgids)


def _live_processes(id_of: Callable[[int], int], ids: set[int]) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and id_of(proc.pid) in ids:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def outliving(find: Callable[[], list[psutil.Process]], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` seconds for ``find()`` to come back empty; return what is still there.

    For leak checks after a *graceful* stop: a peer that was asked to stop takes its DHT worker and
    ``p2pd`` down by itself, in order, which takes a moment; whatever is left after the deadline
    outlived the graceful stop.
    """
    deadline = time.monotonic() + timeout
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling the process table; there is nothing to wait on
    return left


def kill_all(processes: list[psutil.Process]) -> None:
    """SIGKILL each of ``processes`` that still runs, and reap the ones that are ours."""
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(processes, timeout=10)


def describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.name()} {' '.join(proc.cmdline())[:200]}"
    except psutil.Error as exc:
        return f"{proc.pid} ({type(exc).__name__})"


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


def join_address(boot: PeerProcess, timeout: float = 120) -> str:
    """Wait for the line a `swarm bootstrap` prints for others to join by; return the multiaddr on it."""
    from peers.bootstrap import JOIN_LINE_PREFIX

    return boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=timeout)[
        len(JOIN_LINE_PREFIX) :
    ]


def terminate_and_wait(process: PeerProcess, timeout: float = 10.0) -> int:
    """SIGTERM a peer and return its exit status, failing if it takes longer than ``timeout``."""
    process.signal(signal.SIGTERM)
    return process.wait(timeout=timeout)


def reap_workers(procs: Sequence[Any], pgids: Iterable[int], deadline: float) -> list[str]:
    """Join multiprocessing workers that were asked to stop, until ``deadline`` (``time.monotonic()``);
    then whatever of their process groups outlived it is killed and returned, described."""
    for proc in procs:
        proc.join(max(0.1, deadline - time.monotonic()))
    groups = set(pgids)
    outlived = outliving(lambda: group_processes(groups), max(0.1, deadline - time.monotonic()))
    described = [describe(p) for p in outlived]
    kill_all(outlived)
    for proc in procs:
        proc.join(10)
    return described
