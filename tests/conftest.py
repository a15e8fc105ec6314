"""Shared fixtures: peer processes that are always cleaned up, a leak check for p2p daemons, and the
fuzz tests' error log."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests._processes import PeerProcess, describe, kill_all, outliving, session_processes
from tests.workers.fuzz import ErrorLog

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


GRACEFUL_STOP_S = 60.0
"""How long peers get to stop by themselves at the end of a test: generous, because this is a leak
check, not a timing check (several peers stopping at once on two busy cores take their time)."""


@pytest.fixture
def spawn() -> Iterator[Callable[..., PeerProcess]]:
    """Start peer processes; at the end stop them gracefully and fail if anything of theirs outlives that.

    Whatever the test left running gets SIGTERM (the way a user stops a peer). Then every process in
    their sessions (the peer, its DHT worker, ``p2pd``) must end by itself within
    :data:`GRACEFUL_STOP_S`; a process the test killed must have taken its session down too (a lone
    SIGKILL of a peer leaves its DHT worker to stop ``p2pd``). Only what is still there after that
    is killed, and the test fails naming it.
    """
    started: list[PeerProcess] = []

    def start(args: list[str], **kwargs) -> PeerProcess:
        process = PeerProcess(args, **kwargs)
        started.append(process)
        return process

    yield start
    for process in started:
        if process.proc.poll() is None:
            process.signal(signal.SIGTERM)
    sids = {p.sid for p in started}
    outlived = outliving(lambda: session_processes(sids), GRACEFUL_STOP_S)
    described = [describe(p) for p in outlived]
    kill_all(outlived)
    for process in started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.proc.wait(timeout=10)
    assert not described, f"processes outlived a graceful stop (then killed): {described}"


@pytest.fixture(scope="session", autouse=True)
def swarm_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``SWARM_HOME`` in a temporary directory for the whole session (and every peer process it
    starts): checkpoints default to ``$SWARM_HOME/runs/...``, and tests never write into the real home."""
    home = tmp_path_factory.mktemp("swarm-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SWARM_HOME", str(home))
        yield home


@pytest.fixture(autouse=True)
def no_daemon_leaks() -> Iterator[None]:
    """Every in-process swarm node must have stopped its p2p daemon by the end of the test."""
    yield
    leaked = [p for p in _daemons_below_us() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not leaked, f"p2pd daemons leaked by this test: {[p.pid for p in leaked]}"


@pytest.fixture(scope="module")
def errors() -> Iterator[ErrorLog]:
    """The fuzz tests' record of errors logged under ``swarm`` (any is a bug: hostile input is refused
    with a warning, never an unexpected error)."""
    handler = ErrorLog()
    logger = logging.getLogger("swarm")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
