"""download_state: a joiner fetches a verified state from several donors at once.

If two or more donors announce the same digest, that state is fetched in disjoint parts, one donor
per part; otherwise each donor sends its full state and the joiner merges them
(:mod:`swarm.state._merge`). Every frame is checked against the announced digest before it is used
(:mod:`swarm.state._transfer_protocol`). See docs/state-sync.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.compression import DecodeLimits
from swarm.p2p import StreamKey, check_run_id, run_with_replica, swarm_key_of
from swarm.state._merge import mean_snapshot
from swarm.state._transfer_protocol import (
    IO_TIMEOUT_S,
    Assembly,
    StateSnapshot,
    StateTransferError,
    fetch_part,
    handler_name,
    is_digest,
)

if TYPE_CHECKING:
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

    from swarm.network import SwarmKey

logger = logging.getLogger(__name__)


def download_state(
    source: DHT | P2P,
    donors: Sequence[tuple[str, str]],
    *,
    run_id: str,
    limits: DecodeLimits = DecodeLimits(),
    timeout_s: float = 60.0,
    parallel: int = 4,
    swarm_key: SwarmKey | None = None,
) -> StateSnapshot:
    """Download a verified state from ``donors`` = (peer id, announced digest) pairs; blocking.

    ``source`` is a running ``hivemind.DHT`` or ``hivemind.p2p.P2P``: we open our own client to its
    daemon for the download. If two or more donors announce the same digest, the most common one is
    fetched in ``k = min(parallel, donors with it)`` disjoint parts, part i from donor i, a failed
    part going to another donor of the group. Otherwise (every peer's state differs, the usual case
    in a gossip swarm) up to ``parallel`` donors each send their full state, each verified against
    its own digest, and the element-wise mean is returned. In a private swarm (``swarm_key``, by
    default the key a DHT ``source`` was started with) each stream starts with the swarm key handshake.
    Raises StateTransferError.
    """
    check_run_id(run_id)
    if parallel < 1 or timeout_s <= 0:
        raise ValueError("parallel must be >= 1 and timeout_s > 0")
    valid = _valid_donors(donors)
    key = swarm_key if swarm_key is not None else swarm_key_of(source)

    async def download(p2p: P2P) -> StateSnapshot:
        ctx = _Context(p2p, handler_name(run_id), limits, key)
        return await _download(ctx, valid, timeout_s, parallel)

    return run_with_replica(source, download, name=f"state-download-{run_id}", open_timeout_s=IO_TIMEOUT_S)


def _valid_donors(donors: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    unique: dict[str, str] = {}
    for peer, digest in donors:
        if not is_digest(digest):
            logger.warning("ignoring donor %s: announced digest %r is not a sha256 hex digest", peer, digest)
            continue
        unique.setdefault(peer, digest)
    if not unique:
        raise StateTransferError("no donor with a valid announced digest")
    return list(unique.items())


@dataclass(frozen=True)
class _Context:
    p2p: P2P
    handler: str
    limits: DecodeLimits
    swarm_key: StreamKey | None


async def _download(
    ctx: _Context, donors: list[tuple[str, str]], timeout_s: float, parallel: int
) -> StateSnapshot:
    try:
        async with asyncio.timeout(timeout_s):
            digest, count = Counter(d for _, d in donors).most_common(1)[0]
            if count >= 2:
                group = [peer for peer, d in donors if d == digest]
                return await _fetch_shared(ctx, digest, group, parallel)
            return mean_snapshot(await _fetch_each(ctx, donors, parallel))
    except TimeoutError:
        raise StateTransferError(f"state download did not finish within {timeout_s}s") from None


async def _fetch_shared(ctx: _Context, digest: str, group: list[str], parallel: int) -> StateSnapshot:
    """Parts of one state from several donors; a failed part goes to a donor that has not failed."""
    assembly = Assembly(digest, ctx.limits)
    parts = min(parallel, len(group))

    def replacement(part: int, failed: set[str], busy: set[str]) -> str | None:
        healthy = [peer for peer in group if peer not in failed]
        idle = [peer for peer in healthy if peer not in busy]
        candidates = idle or healthy
        return candidates[0] if candidates else None

    async def attempt(part: int, donor: str) -> None:
        await fetch_part(ctx.p2p, ctx.handler, donor, assembly, part, parts, ctx.swarm_key)

    await _assign([(part, group[part]) for part in range(parts)], replacement, attempt)
    return await asyncio.to_thread(assembly.finish)


async def _fetch_each(ctx: _Context, donors: list[tuple[str, str]], parallel: int) -> list[StateSnapshot]:
    """Full states from up to ``parallel`` donors, each verified against its own digest."""
    announced = dict(donors)
    queue = [peer for peer, _ in donors]
    results: list[StateSnapshot] = []

    def replacement(slot: int, failed: set[str], busy: set[str]) -> str | None:
        return queue.pop(0) if queue else None

    async def attempt(slot: int, donor: str) -> None:
        assembly = Assembly(announced[donor], ctx.limits)
        await fetch_part(ctx.p2p, ctx.handler, donor, assembly, 0, 1, ctx.swarm_key)
        results.append(await asyncio.to_thread(assembly.finish))

    first = [(slot, queue.pop(0)) for slot in range(min(parallel, len(queue)))]
    await _assign(first, replacement, attempt, need_all=False)
    return results


async def _assign(
    initial: list[tuple[int, str]],
    replacement: Callable[[int, set[str], set[str]], str | None],
    attempt: Callable[[int, str], Coroutine[Any, Any, None]],
    need_all: bool = True,
) -> None:
    """Run ``attempt(key, donor)`` for each assignment; on a donor's failure hand its key to
    ``replacement(key, failed, busy)``. Without a replacement: raise if ``need_all``, else drop the key
    (and raise only if nothing succeeded). StateTransferError from an attempt is fatal."""
    failures: dict[str, str] = {}
    running: dict[asyncio.Task[None], tuple[int, str]] = {}
    succeeded = 0
    for key, donor in initial:
        running[asyncio.create_task(attempt(key, donor))] = (key, donor)
    try:
        while running:
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                key, donor = running.pop(task)
                reason = _failure(task, donor)
                if reason is None:
                    succeeded += 1
                    continue
                failures[donor] = reason
                spare = replacement(key, set(failures), {d for _, d in running.values()})
                if spare is not None:
                    running[asyncio.create_task(attempt(key, spare))] = (key, spare)
                elif need_all:
                    raise StateTransferError(f"no donor left for part {key}: {_describe(failures)}")
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
    if not succeeded:
        raise StateTransferError(f"every donor failed: {_describe(failures)}")


def _failure(task: asyncio.Task[None], donor: str) -> str | None:
    """None if the attempt succeeded, else why; re-raises fatal errors (StateTransferError)."""
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, StateTransferError):
        raise exc
    reason = "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
    logger.warning("state download from %s failed: %s", donor, reason)
    return reason


def _describe(failures: Mapping[str, str]) -> str:
    return "; ".join(f"donor {peer}: {reason}" for peer, reason in failures.items())
