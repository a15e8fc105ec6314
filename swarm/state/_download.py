"""download_state: a joiner takes a verified state from the organizer's word or from many donors.

A donor's record proves only that it sent what it announced, and records cost one key each, so no
one or two donors are ever copied. The state is either the one a *trusted* donor announces (an
initial peer the user named: the organizer's bootstrap, whose signed record carries the digest of
what it serves), fetched in disjoint parts from every donor that announces that digest; or the
coordinate-wise median (:mod:`swarm.state._merge`) of at least ``min_donors`` distinct states, each
fetched in full from one of its donors. Every frame is checked against the announced digest before
it is used (:mod:`swarm.state._transfer_protocol`), and a donor that takes over a failed donor's
share sends only the frames of it that did not arrive.

Time is bounded the way BitTorrent bounds it (:mod:`swarm.state._schedule`): a donor below the receive
floor (bytes over time windows, whatever its chunk size) is snubbed and its share goes to another
holder of the same digest; the last outstanding shares are asked of an idle holder too (endgame);
each stage has a deadline derived from its state's size and the floor; a median stops once its
``min_donors`` states are in and the others had their grace. Any peer may sign a record announcing
the trusted digest and so be asked for a part, but every byte it sends is verified against that
digest: what it can cost is time, bounded as above. See docs/state-sync.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Required, TypedDict, Unpack

from swarm.compression import DecodeLimits
from swarm.p2p import StreamKey, check_run_id, run_with_replica, swarm_key_of
from swarm.state._merge import median_snapshot, progress_of
from swarm.state._schedule import Budget, Scheduler
from swarm.state._snapshot import StateSnapshot
from swarm.state._transfer_protocol import (
    IO_TIMEOUT_S,
    Assembly,
    FloorSpec,
    Hooks,
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
    min_rate: float
    window_s: float


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
    coordinate-wise median is returned, once every chosen state is in or ``min_donors`` of them are
    and the others had as long again. A donor whose state does not decode or whose progress
    counters are out of range is dropped like one that does not answer.

    ``run_id`` names the handler; ``limits`` (default ``DecodeLimits()``) bound the decoded tensors;
    ``timeout_s`` (default 60) ends a download that went that long without a verified frame;
    ``parallel`` (default 4) bounds the streams at once. The receive floor: after a grace of
    ``window_s`` (default ``IO_TIMEOUT_S``, 20 s), each stream must bring ``min_rate`` bytes per
    second (default ``MIN_RECV_BYTES_PER_S``, 32 KiB/s) over every window of ``window_s``, or its donor
    is dropped; the trusted state, and the median, each fail (the median: stop, if it has
    ``min_donors`` states) past ``3 x window_s`` plus twice their state's bytes at ``min_rate``.
    The result's ``sources`` name the donors it came from, its ``received_bytes`` what they sent.
    In a private swarm (``swarm_key``, by default the key a DHT ``source`` was started with) each
    stream starts with the swarm key handshake.
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
    min_rate: float | None = None
    window_s: float | None = None

    @classmethod
    def of(cls, donors: Iterable[tuple[str, str]], options: DownloadOptions) -> _Plan:
        """The checked plan; StateTransferError when the donors cannot give a state, ValueError for
        options out of range."""
        plan = cls([], **options)
        check_run_id(plan.run_id)
        if plan.parallel < 1 or plan.timeout_s <= 0 or plan.min_donors < 1:
            raise ValueError("parallel and min_donors must be >= 1 and timeout_s > 0")
        if any(value is not None and not value > 0 for value in (plan.min_rate, plan.window_s)):
            raise ValueError("min_rate and window_s must be > 0")
        plan = dataclasses.replace(plan, donors=_valid_donors(donors))
        has_trusted = any(peer in plan.trusted for peer, _ in plan.donors)
        if not has_trusted and len({d for _, d in plan.donors}) < plan.min_donors:
            raise _too_few(plan.donors, plan.min_donors)
        return plan

    async def run(self, p2p: P2P, swarm_key: StreamKey | None) -> StateSnapshot:
        floor = FloorSpec(self.min_rate, self.window_s)
        return await _download(_Context(p2p, handler_name(self.run_id), self.limits, swarm_key, floor), self)


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
    floor: FloorSpec
    on_frame: Callable[[], None] | None = None  # a verified frame arrived: the deadline moves on

    async def fetch(
        self, donor: str, assembly: Assembly, budget: Budget, part: int = 0, parts: int = 1
    ) -> None:
        """What ``assembly`` lacks of part ``part`` of ``parts``, from ``donor``; its verified header
        sizes ``budget``."""
        hooks = Hooks(on_header=budget.on_header, on_frame=self.on_frame)
        await fetch_part(
            self.p2p, self.handler, donor, assembly, part, parts, self.swarm_key, self.floor, hooks
        )


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


def _first_idle(candidates: list[str], failed: set[str], busy: set[str], idle_only: bool) -> str | None:
    """The first of ``candidates`` that has not failed, idle ones first (only idle ones with
    ``idle_only``)."""
    healthy = [peer for peer in candidates if peer not in failed]
    idle = [peer for peer in healthy if peer not in busy]
    pool = idle if idle_only else idle or healthy
    return pool[0] if pool else None


@dataclass
class _Trusted:
    """The trusted state in ``parts`` disjoint parts, from the donors whose signed records announce
    its digest (``group``); a part a donor failed goes to another, which resumes it."""

    ctx: _Context
    group: list[str]
    assembly: Assembly
    budget: Budget
    parts: int
    delivered: list[str] = field(default_factory=list)

    def replacement(self, part: int, failed: set[str], busy: set[str]) -> str | None:
        return _first_idle(self.group, failed, busy, idle_only=False)

    def spare(self, part: int, failed: set[str], busy: set[str]) -> str | None:
        return _first_idle(self.group, failed, busy, idle_only=True)

    def left(self, part: int) -> int:
        return self.assembly.missing(part, self.parts)

    async def attempt(self, part: int, donor: str) -> None:
        await self.ctx.fetch(donor, self.assembly, self.budget, part, self.parts)
        self.delivered.append(donor)


async def _fetch_trusted(ctx: _Context, digest: str, group: list[str], parallel: int) -> StateSnapshot:
    """One state in parts from the donors that announce it (:class:`_Trusted`), within its deadline."""
    parts = min(parallel, len(group))
    stage = _Trusted(ctx, group, Assembly(digest, ctx.limits), Budget(ctx.floor), parts)
    await Scheduler(stage, stage.budget).run([(part, group[part]) for part in range(parts)])
    snapshot = await asyncio.to_thread(stage.assembly.finish)
    progress_of(snapshot.meta)
    sources = tuple(dict.fromkeys(stage.delivered))
    return dataclasses.replace(snapshot, sources=sources, received_bytes=stage.assembly.received_bytes)


@dataclass
class _Median:
    """Full states of distinct digests, one per slot: a slot whose donor failed goes to another holder
    of its digest (which resumes it), then to the next untried digest."""

    ctx: _Context
    groups: dict[str, list[str]]
    slot_digest: dict[int, str]
    untried: list[str]
    budget: Budget
    unusable: set[str] = field(default_factory=set)
    assemblies: dict[str, Assembly] = field(default_factory=dict)
    results: dict[str, tuple[str, StateSnapshot]] = field(default_factory=dict)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def replacement(self, slot: int, failed: set[str], busy: set[str]) -> str | None:
        while True:
            digest = self.slot_digest[slot]
            usable = digest not in self.unusable
            donor = _first_idle(self.groups[digest], failed, busy, False) if usable else None
            if donor is not None or not self.untried:
                return donor
            self.slot_digest[slot] = self.untried.pop(0)

    def spare(self, slot: int, failed: set[str], busy: set[str]) -> str | None:
        digest = self.slot_digest[slot]
        return None if digest in self.unusable else _first_idle(self.groups[digest], failed, busy, True)

    def left(self, slot: int) -> int:
        assembly = self.assemblies.get(self.slot_digest[slot])
        return 0 if assembly is None else assembly.missing(0, 1)

    async def attempt(self, slot: int, donor: str) -> None:
        digest = self.slot_digest[slot]
        assembly = self.assemblies.setdefault(digest, Assembly(digest, self.ctx.limits))
        await self.ctx.fetch(donor, assembly, self.budget)
        async with self.locks.setdefault(digest, asyncio.Lock()):  # endgame: one sibling finishes it
            if digest in self.results:
                return
            if digest in self.unusable:
                raise _DonorFault(f"state {digest[:12]} is unusable")
            try:
                snapshot = await asyncio.to_thread(assembly.finish)
                progress_of(snapshot.meta)
            except StateTransferError as exc:
                self.unusable.add(digest)
                raise _DonorFault(str(exc)) from exc
            self.results[digest] = (donor, snapshot)


async def _fetch_median(
    ctx: _Context, groups: dict[str, list[str]], parallel: int, min_donors: int
) -> StateSnapshot:
    """Full states of distinct digests (chosen at random, :class:`_Median`), each verified against its
    digest, merged by the coordinate-wise median; the stage ends once ``min_donors`` states are
    complete and the others had their grace, or at its deadline."""
    order = random.sample(list(groups), len(groups))
    chosen = max(min(parallel, len(order)), min_donors)
    slot_digest = dict(enumerate(order[:chosen]))
    stage = _Median(ctx, groups, slot_digest, order[chosen:], Budget(ctx.floor, min_donors))
    await Scheduler(stage, stage.budget, quorum=min_donors).run(
        [(slot, groups[digest][0]) for slot, digest in slot_digest.items()]
    )
    states = [s for _, s in stage.results.values()]
    merged = await asyncio.to_thread(median_snapshot, states, min_donors)
    sources = tuple(donor for donor, _ in stage.results.values())
    received = sum(a.received_bytes for a in stage.assemblies.values())
    return dataclasses.replace(merged, sources=sources, received_bytes=received)
