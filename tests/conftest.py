"""Shared fixtures: peer processes that are always cleaned up, and a leak check for p2p daemons."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import psutil
import pytest

from tests._processes import PeerProcess, session_processes

_PR_SET_CHILD_SUBREAPER = 36


def pytest_configure(config: pytest.Config) -> None:
    """Become a subreaper so orphaned daemons re-parent to pytest and stay visible to the leak checks."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1)


def _daemons_below_us() -> list[psutil.Process]:
    children = psutil.Process().children(recursive=True)
    return [p for p in children if _name(p) == "p2pd"]


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


@pytest.fixture
def spawn() -> Iterator[Callable[..., PeerProcess]]:
    """Start peer processes; at the end kill what is left and assert nothing of theirs survives."""
    started: list[PeerProcess] = []

    def start(args: list[str], **kwargs) -> PeerProcess:
        process = PeerProcess(args, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill_session()
    # a process SIGKILLed a moment ago may still be on its way out: give the kernel a bounded moment
    _, leftovers = psutil.wait_procs(session_processes({p.sid for p in started}), timeout=10)
    assert not leftovers, f"processes outlived the test: {[_describe(p) for p in leftovers]}"


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {proc.status()} {proc.cmdline()}"
    except psutil.Error as exc:
        return f"{proc.pid} ({exc})"


@pytest.fixture(autouse=True)
def no_daemon_leaks() -> Iterator[None]:
    """Every in-process swarm node must have stopped its p2p daemon by the end of the test."""
    yield
    leaked = [p for p in _daemons_below_us() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leaked, f"p2pd daemons leaked by this test: {[p.pid for p in leaked]}"
