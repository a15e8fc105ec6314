"""Which donor fetches which part of a download, on BitTorrent's model: reassignment, endgame, deadlines.

A stage of a download (the trusted state in parts, or the median's full states) has keys (a part, a
median slot), each fetched by one donor's stream. A donor that fails (unreachable, refused, bad
frame, below the receive floor: *snubbed*) never gets another key of this stage; its key goes to
another donor that holds the same state, which resumes it.

**Endgame**: every key is assigned from the start, so once one is complete the others are the last
outstanding ones. A key still outstanding after as long again as the first complete one took (at
least one window of the floor) is asked of an idle donor holding its state too, for what is still
missing of it (the key furthest behind first); the first stream to complete it wins and its sibling
is cancelled. Donors of about the same speed finish within that grace and no frame comes twice; one
slow donor costs a joiner about twice the others' time, never its whole share at its own pace.

Every stage has a deadline (:class:`Budget`), derived from its state's size and the receive floor:
a stage that runs out of it fails, and a median stage stops there if it has its quorum of states.
A median stage also stops once its quorum is complete and the others had the same grace: a state
that is slow, though above the floor, and held by one donor cannot hold the join.
"""

from __future__ import annotations

import asyncio
import logging
from asyncio import FIRST_COMPLETED
from collections.abc import Mapping
from typing import Protocol

from swarm.state._transfer_protocol import FloorSpec, Header, StateTransferError

logger = logging.getLogger(__name__)

START_WINDOWS = 3
"""Windows of the receive floor a stage has before its state's size is known: a dial, a busy donor or
two and a header."""


class Budget:
    """The deadline of one stage: :data:`START_WINDOWS` windows of the floor, plus twice the state's
    bytes at the floor's rate once a verified header gave its size (``frames x chunk_bytes``, a bound:
    the whole state from one donor at the floor, once over). A median stage counts the ``quorum``-th
    smallest of its states (the largest while it knows fewer): a minority of huge hostile states does
    not stretch it for long, and the decode limits bound any state's size anyway."""

    def __init__(self, floor: FloorSpec, quorum: int = 1) -> None:
        self.rate, self.window_s = floor.resolved()
        self.quorum = quorum
        self.start = asyncio.get_running_loop().time()
        self.deadline = self.start + START_WINDOWS * self.window_s
        self._sizes: dict[str, int] = {}

    def on_header(self, header: Header) -> None:
        """A verified header: its state's size may set the deadline."""
        self._sizes[header.digest] = len(header.hashes) * header.chunk_bytes
        size = sorted(self._sizes.values())[min(self.quorum, len(self._sizes)) - 1]
        self.deadline = self.start + START_WINDOWS * self.window_s + 2 * size / self.rate

    def describe(self) -> str:
        return f"{self.deadline - self.start:.0f}s (its state's size at {self.rate:.0f} B/s)"


class Stage(Protocol):
    """The keys of one stage and who may fetch them."""

    def replacement(self, key: int, failed: set[str], busy: set[str]) -> str | None:
        """A donor for ``key`` after its stream failed: not failed (idle ones first), or None."""

    def spare(self, key: int, failed: set[str], busy: set[str]) -> str | None:
        """An idle donor that holds ``key``'s state, for the endgame, or None."""

    def left(self, key: int) -> int:
        """Frames ``key`` still lacks: the endgame helps the key furthest behind first."""

    async def attempt(self, key: int, donor: str) -> None:
        """Fetch ``key`` from ``donor``; StateTransferError is fatal to the whole stage."""


class Scheduler:
    """Runs a stage: every key of ``initial`` from its donor, then reassignment and endgame as above.

    With ``quorum`` None every key must complete (else StateTransferError); with a quorum the stage
    ends once every key is complete or dropped, or at the quorum's grace or the deadline, and fails
    only if no key completed (the caller checks it has enough)."""

    def __init__(self, stage: Stage, budget: Budget, quorum: int | None = None) -> None:
        self._stage, self._budget, self._quorum = stage, budget, quorum
        self._loop = asyncio.get_running_loop()
        self._running: dict[asyncio.Task[None], tuple[int, str]] = {}
        self._failures: dict[str, str] = {}
        self._complete: set[int] = set()
        self._endgame_at = self._quorum_at = float("inf")

    @property
    def complete(self) -> set[int]:
        return set(self._complete)

    async def run(self, initial: list[tuple[int, str]]) -> None:
        keys = {key for key, _ in initial}
        for key, donor in initial:
            self._start(key, donor)
        try:
            while self._running:
                now = self._loop.time()
                end = min(self._budget.deadline, self._quorum_at)
                if now >= end:
                    break
                if now >= self._endgame_at:
                    self._endgame()
                wake = min(end, self._endgame_at) if self._endgame_at > now else end
                done, _ = await asyncio.wait(self._running, timeout=wake - now, return_when=FIRST_COMPLETED)
                for task in done:
                    self._finished(task)
        finally:
            await self._cancel(list(self._running))
        self._check(keys)

    def _check(self, keys: set[int]) -> None:
        if self._quorum is None and self._complete != keys:
            missing = sorted(keys - self._complete)
            raise StateTransferError(
                f"parts {missing} not complete within the deadline of {self._budget.describe()}"
                + (f": {describe(self._failures)}" if self._failures else "")
            )
        if not self._complete:
            why = describe(self._failures) or f"none complete within {self._budget.describe()}"
            raise StateTransferError(f"every donor failed: {why}")

    def _start(self, key: int, donor: str) -> None:
        self._running[asyncio.create_task(self._stage.attempt(key, donor))] = (key, donor)

    def _busy(self) -> set[str]:
        return {donor for _, donor in self._running.values()}

    def _siblings(self, key: int) -> list[asyncio.Task[None]]:
        return [task for task, (k, _) in self._running.items() if k == key]

    def _finished(self, task: asyncio.Task[None]) -> None:
        key, donor = self._running.pop(task)
        if key in self._complete or task.cancelled():
            return  # a sibling won the endgame
        reason = failure(task, donor)
        if reason is None:
            self._completed(key)
            return
        self._failures[donor] = reason
        if self._siblings(key):
            return  # its endgame sibling goes on
        spare = self._stage.replacement(key, set(self._failures), self._busy())
        if spare is not None:
            self._start(key, spare)
        elif self._quorum is None:
            raise StateTransferError(f"no donor left for part {key}: {describe(self._failures)}")

    def _completed(self, key: int) -> None:
        self._complete.add(key)
        for sibling in self._siblings(key):
            sibling.cancel()  # reaped by asyncio.wait like any task: it returns cancelled
        now = self._loop.time()
        grace_until = now + max(self._budget.window_s, now - self._budget.start)
        if len(self._complete) == 1:
            self._endgame_at = grace_until
        if self._quorum is not None and len(self._complete) == self._quorum:
            self._quorum_at = grace_until

    def _endgame(self) -> None:
        """Each outstanding key with one stream, furthest behind first, to an idle holder too."""
        outstanding = {k for k, _ in self._running.values() if k not in self._complete}
        for key in sorted(outstanding, key=self._stage.left, reverse=True):
            if len(self._siblings(key)) > 1:
                continue
            spare = self._stage.spare(key, set(self._failures), self._busy())
            if spare is not None:
                logger.info("endgame: asking %s for the rest of part %d as well", spare, key)
                self._start(key, spare)

    async def _cancel(self, tasks: list[asyncio.Task[None]]) -> None:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            self._running.pop(task, None)


def failure(task: asyncio.Task[None], donor: str) -> str | None:
    """None if the attempt succeeded, else why; re-raises fatal errors (StateTransferError)."""
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, StateTransferError):
        raise exc
    reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
    logger.warning("state download from %s failed: %s", donor, reason)
    return reason


def describe(failures: Mapping[str, str]) -> str:
    return "; ".join(f"donor {peer}: {reason}" for peer, reason in failures.items())
