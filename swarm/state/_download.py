"""download_state: a joiner takes a verified state from the organizer's word or from many donors.

A donor's record proves only that it sent what it announced, and records cost one key each, so no
one or two donors are ever copied. The state is either the one a *trusted* donor announces (an
initial peer the user named: the organizer's bootstrap, whose signed record carries the digest of
what it serves), fetched in disjoint parts from every donor that announces that digest; or the
coordinate-wise median (:mod:`swarm.state._merge`) of at least ``min_donors`` distinct states, each
fetched in full from one of its donors. Every frame is checked against the announced digest before
it is used (:mod:`swarm.state._transfer_protocol`), and a donor that takes over a failed donor's
share sends only the frames of it that did not arrive. See docs/state-sync.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Required, TypedDict, Unpack

from swarm.compression import DecodeLimits
from swarm.p2p import StreamKey, check_run_id, run_with_replica, swarm_key_of
from swarm.state._merge import median_snapshot, progress_of
from swarm.state._snapshot import StateSnapshot
from swarm.state._transfer_protocol import (
    IO_TIMEOUT_S,
    Assembly,
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

MIN_DONORS = 3
"""Distinct donor states a merged state needs: with 3, one hostile donor cannot move the median
outside the honest values; with 2 it could set it (their mean), with 1 it is the donor's state."""


class DownloadOptions(TypedDict, total=False):
    """What :func:`download_state` and :func:`fetch_state` take besides the donors: ``run_id``, and
    optionally the others (their defaults and meaning: :func:`download_state`)."""

    run_id: Required[str]
    trusted: Collection[str]
    min_donors: int
    limits: DecodeLimits
    timeout_s: float
    parallel: int


def download_state(
    source: DHT | P2P,
    donors: Sequence[tuple[str, str]],
    *,
    swarm_key: SwarmKey | None = None,
    **options: Unpack[DownloadOptions],
) -> StateSnapshot:
    """Download a verified state from ``donors`` = (peer id, announced digest) pairs; blocking.

    ``source`` is a running ``hivemind.DHT`` or ``hivemind.p2p.P2P``: we open our own client to its
    daemon for the download. If a donor in ``trusted`` (peer ids, default none) announces a state,
    that state is returned as is, fetched in ``k = min(parallel, donors with it)`` disjoint parts, part
    i from donor i; a failed part goes to another donor of the group, which sends only the frames of
    it that have not arrived. Otherwise (or if that fails) the donors' distinct digests count: with
    fewer than ``min_donors`` (default :data:`MIN_DONORS`) nothing is dialled and StateTransferError
    says so (wait for more donors, or take a partner's anchor); else ``max(min(parallel, distinct),
    min_donors)`` distinct states, chosen at random, are each fetched in full (a failed donor replaced
    by another holder of its state, which resumes it, else by another state) and their
    coordinate-wise median is returned. A donor whose state does not decode or whose progress
    counters are out of range is dropped like one that does not answer.

    ``run_id`` names the handler; ``limits`` (default ``DecodeLimits()``) bound the decoded tensors;
    ``timeout_s`` (default 60) ends a download that went that long without a verified frame;
    ``parallel`` (default 4) bounds the streams at once. The result's ``sources`` name the donors it
    came from, its ``received_bytes`` what they sent. In a private swarm (``swarm_key``, by default
    the key a DHT ``source`` was started with) each stream starts with the swarm key handshake.
    Raises StateTransferError.
    """
    plan = _Plan.of(donors, options)  # before opening anything
    key = swarm_key if swarm_key is not None else swarm_key_of(source)
    name = f"state-download-{plan.run_id}"
    return run_with_replica(source, lambda p2p: plan.run(p2p, key), name=name, open_timeout_s=IO_TIMEOUT_S)


async def fetch_state(
    p2p: P2P,
    donors: Sequence[tuple[str, str]],
    *,
    swarm_key: StreamKey | None = None,
    **options: Unpack[DownloadOptions],
) -> StateSnapshot:
    """:func:`download_state` on a running loop, through ``p2p`` (dialled as is; ``swarm_key``: the
    handshake's key, None for none)."""
    return await _Plan.of(donors, options).run(p2p, swarm_key)


@dataclass(frozen=True)
class _Plan:
    """A download's options with their defaults, and the donors with a valid digest (one per peer)."""

    donors: list[tuple[str, str]]
    run_id: str
    trusted: Collection[str] = ()
    min_donors: int = MIN_DONORS
    limits: DecodeLimits = field(default_factory=DecodeLimits)
    timeout_s: float = 60.0
    parallel: int = 4

    @classmethod
    def of(cls, donors: Iterable[tuple[str, str]], options: DownloadOptions) -> _Plan:
        """The checked plan; StateTransferError when the donors cannot give a state, ValueError for
        options out of range."""
        plan = cls([], **options)
        check_run_id(plan.run_id)
        if plan.parallel < 1 or plan.timeout_s <= 0 or plan.min_donors < 1:
            raise ValueError("parallel and min_donors must be >= 1 and timeout_s > 0")
        plan = dataclasses.replace(plan, donors=_valid_donors(donors))
        has_trusted = any(peer in plan.trusted for peer, _ in plan.donors)
        if not has_trusted and len({d for _, d in plan.donors}) < plan.min_donors:
            raise _too_few(plan.donors, plan.min_donors)
        return plan

    async def run(self, p2p: P2P, swarm_key: StreamKey | None) -> StateSnapshot:
        return await _download(_Context(p2p, handler_name(self.run_id), self.limits, swarm_key), self)


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


def _too_few(donors: list[tuple[str, str]], min_donors: int, trusted_failed: str = "") -> StateTransferError:
    """Why no state is taken: too few distinct donors, and no trusted one (or it failed, and why)."""
    distinct = len({d for _, d in donors})
    trust = f"the trusted state failed ({trusted_failed})" if trusted_failed else "none is trusted"
    return StateTransferError(
        f"{len(donors)} donor(s) announce {distinct} distinct state(s) and {trust}: a state needs "
        f"{min_donors} distinct donors or a trusted one (an initial peer); not copying fewer"
    )


@dataclass(frozen=True)
class _Context:
    p2p: P2P
    handler: str
    limits: DecodeLimits
    swarm_key: StreamKey | None
    on_frame: Callable[[], None] | None = None  # a verified frame arrived: the deadline moves on

    async def fetch(self, donor: str, assembly: Assembly, part: int = 0, parts: int = 1) -> None:
        """What ``assembly`` lacks of part ``part`` of ``parts``, from ``donor``."""
        await fetch_part(self.p2p, self.handler, donor, assembly, part, parts, self.swarm_key, self.on_frame)


class _DonorFault(Exception):
    """A donor's announced state is unusable (does not decode, hostile progress): drop that donor."""


async def _download(ctx: _Context, plan: _Plan) -> StateSnapshot:
    groups: dict[str, list[str]] = {}
    for peer, digest in plan.donors:
        groups.setdefault(digest, []).append(peer)
    loop, timeout_s = asyncio.get_running_loop(), plan.timeout_s
    try:
        async with asyncio.timeout(timeout_s) as deadline:  # moved on by every verified frame
            ctx = dataclasses.replace(ctx, on_frame=lambda: deadline.reschedule(loop.time() + timeout_s))
            failed = []
            for digest in dict.fromkeys(d for peer, d in plan.donors if peer in plan.trusted):
                holders = sorted(groups.pop(digest), key=lambda peer: peer not in plan.trusted)
                try:
                    return await _fetch_trusted(ctx, digest, holders, plan.parallel)
                except StateTransferError as exc:
                    logger.warning("the trusted state %s failed: %s", digest[:12], exc)
                    failed.append(str(exc))
            if len(groups) < plan.min_donors:
                others = [(p, d) for d, peers in groups.items() for p in peers]
                raise _too_few(others, plan.min_donors, "; ".join(failed))
            return await _fetch_median(ctx, groups, plan.parallel, plan.min_donors)
    except TimeoutError:
        raise StateTransferError(f"state download made no progress for {timeout_s}s") from None


async def _fetch_trusted(ctx: _Context, digest: str, group: list[str], parallel: int) -> StateSnapshot:
    """One state in parts from the donors that announce it; a failed part goes to a donor that has not
    failed, which resumes it."""
    assembly = Assembly(digest, ctx.limits)
    parts = min(parallel, len(group))
    delivered: list[str] = []

    def replacement(part: int, failed: set[str], busy: set[str]) -> str | None:
        healthy = [peer for peer in group if peer not in failed]
        idle = [peer for peer in healthy if peer not in busy]
        candidates = idle or healthy
        return candidates[0] if candidates else None

    async def attempt(part: int, donor: str) -> None:
        await ctx.fetch(donor, assembly, part, parts)
        delivered.append(donor)

    await _assign([(part, group[part]) for part in range(parts)], replacement, attempt)
    snapshot = await asyncio.to_thread(assembly.finish)
    progress_of(snapshot.meta)
    sources = tuple(dict.fromkeys(delivered))
    return dataclasses.replace(snapshot, sources=sources, received_bytes=assembly.received_bytes)


async def _fetch_median(
    ctx: _Context, groups: dict[str, list[str]], parallel: int, min_donors: int
) -> StateSnapshot:
    """Full states of distinct digests (chosen at random), each verified against its digest, merged by
    the coordinate-wise median; a failed donor is replaced by another holder of its digest (which
    resumes where it stopped), then by the next digest."""
    order = random.sample(list(groups), len(groups))
    untried = order[max(min(parallel, len(order)), min_donors) :]
    slot_digest = dict(enumerate(order[: len(order) - len(untried)]))
    unusable: set[str] = set()
    assemblies: dict[str, Assembly] = {}
    results: dict[str, tuple[str, StateSnapshot]] = {}
    announced = {peer: digest for digest, peers in groups.items() for peer in peers}

    def replacement(slot: int, failed: set[str], busy: set[str]) -> str | None:
        digest = slot_digest[slot]
        while True:
            spare = [p for p in groups[digest] if p not in failed] if digest not in unusable else []
            if spare:
                return spare[0]
            if not untried:
                return None
            digest = slot_digest[slot] = untried.pop(0)

    async def attempt(slot: int, donor: str) -> None:
        digest = announced[donor]
        assembly = assemblies.get(digest) or assemblies.setdefault(digest, Assembly(digest, ctx.limits))
        try:
            await ctx.fetch(donor, assembly)
            snapshot = await asyncio.to_thread(assembly.finish)
            progress_of(snapshot.meta)
        except StateTransferError as exc:
            unusable.add(digest)
            raise _DonorFault(str(exc)) from exc
        results[digest] = (donor, snapshot)

    first = [(slot, groups[digest][0]) for slot, digest in slot_digest.items()]
    await _assign(first, replacement, attempt, need_all=False)
    merged = await asyncio.to_thread(median_snapshot, [s for _, s in results.values()], min_donors)
    sources = tuple(donor for donor, _ in results.values())
    received = sum(a.received_bytes for a in assemblies.values())
    return dataclasses.replace(merged, sources=sources, received_bytes=received)


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
