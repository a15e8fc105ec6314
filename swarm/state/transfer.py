"""Serving and downloading peer state (anchor parameters, outer momentum, progress) between peers.

A donor publishes an immutable :class:`StateSnapshot` on a :class:`StateServer`; a joiner calls
:func:`download_state` with (peer id, announced digest) pairs. See docs/state-sync.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hivemind.p2p import P2P

from swarm._auth import AuthError, authenticate_stream, swarm_key_of
from swarm.compression import DecodeLimits
from swarm.gossip._loop import LoopThread
from swarm.gossip._robust import centered_clip_named
from swarm.gossip._setup import RUN_ID, daemon_maddr
from swarm.state._transfer_protocol import (
    IO_TIMEOUT_S,
    REQUEST_MAX_BYTES,
    Assembly,
    FrameInfo,
    Kind,
    ProtocolError,
    Request,
    StateSnapshot,
    StateTransferError,
    build_snapshot,
    fetch_part,
    handler_name,
    header_json,
    is_digest,
    make_snapshot,
    recv,
    send,
    send_json,
)

if TYPE_CHECKING:
    from swarm.network import SwarmKey

__all__ = [
    "FrameInfo",
    "ServeStats",
    "StateServer",
    "StateSnapshot",
    "StateTransferError",
    "download_state",
    "make_snapshot",
]

logger = logging.getLogger(__name__)

MAX_CONCURRENT_STREAMS = 8
"""A donor serves at most this many requests at once; further ones get ``{"error": "busy"}``."""


# ---------------------------------------------------------------------------- serving


@dataclass
class ServeStats:
    requests: int = 0
    parts_served: int = 0
    frames_sent: int = 0
    refused: int = 0


@dataclass(frozen=True)
class ServerHooks:
    """Test-only: ``before_frame(index)`` runs in a worker thread before each frame is sent (it may
    block); ``corrupt(index, frame)`` replaces the frame's bytes."""

    before_frame: Callable[[int], None] | None = None
    corrupt: Callable[[int, bytes], bytes] | None = None


@dataclass(frozen=True)
class _Published:
    snapshot: StateSnapshot
    hashes_hex: list[str]


class StateServer:
    """Serves the latest published snapshot on ``swarm.state.v{PROTOCOL_VERSION}.{run_id}``.

    Give ``dht`` (a running ``hivemind.DHT``: we open our own client to its daemon) or ``p2p_factory``
    (an async callable returning a P2P dedicated to this server). A request pins the snapshot it
    started on: a ``publish`` during a download never mixes two states into one stream. In a private
    swarm (``swarm_key``, by default the key ``dht`` was started with) a client must pass the swarm key
    handshake before its request is read.
    """

    def __init__(
        self,
        dht: object | None = None,
        run_id: str = "",
        *,
        p2p_factory: Callable[[], Awaitable[P2P]] | None = None,
        swarm_key: SwarmKey | None = None,
        _hooks: ServerHooks | None = None,
    ) -> None:
        if not RUN_ID.match(run_id):
            raise ValueError(f"run_id must match {RUN_ID.pattern}, got {run_id!r}")
        if (dht is None) == (p2p_factory is None):
            raise ValueError("give exactly one of dht or p2p_factory")
        self._handler = handler_name(run_id)
        self._hooks = _hooks
        self._swarm_key = swarm_key if swarm_key is not None else swarm_key_of(dht)
        self._lock = threading.Lock()
        self._published: _Published | None = None
        self._stats = ServeStats()
        self._active = 0
        self._closed = False
        maddr = daemon_maddr(dht) if dht is not None else None
        self._loop = LoopThread(name=f"state-{run_id}")
        try:
            self._p2p: P2P = self._loop.run(self._open(maddr, p2p_factory), timeout=60)
        except BaseException:
            self._loop.stop()
            raise

    async def _open(self, maddr: object, factory: Callable[[], Awaitable[P2P]] | None) -> P2P:
        p2p = await P2P.replicate(maddr) if factory is None else await factory()
        self.peer_id: str = p2p.peer_id.to_base58()  # before serving: the handshake names both peers
        try:
            await p2p.add_binary_stream_handler(self._handler, self._serve)
        except BaseException:
            await p2p.shutdown()
            raise
        return p2p

    def publish(self, snapshot: StateSnapshot) -> None:
        """Serve ``snapshot`` from now on (atomically replaces the previous one)."""
        if not snapshot.frames:
            snapshot = build_snapshot(snapshot.tensors, snapshot.meta, snapshot.chunk_bytes)
        published = _Published(snapshot, [f.sha256.hex() for f in snapshot.frames])
        with self._lock:
            self._published = published

    @property
    def digest(self) -> str | None:
        with self._lock:
            return None if self._published is None else self._published.snapshot.digest

    def stats(self) -> ServeStats:
        with self._lock:
            return ServeStats(**vars(self._stats))

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, delta in deltas.items():
                setattr(self._stats, key, getattr(self._stats, key) + delta)

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = info.peer_id.to_base58()
        self._active += 1  # only touched on the loop thread
        try:
            await self._answer(peer, reader, writer)
        except AuthError as exc:
            logger.warning("refused state request from %s: %s", peer, exc)
        except (ProtocolError, ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            logger.info("state request from %s failed: %s: %s", peer, type(exc).__name__, exc)
        except Exception:
            logger.exception("serving state to %s failed unexpectedly", peer)
        finally:
            self._active -= 1
            writer.close()

    async def _answer(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._swarm_key is not None:
            await authenticate_stream(
                reader,
                writer,
                key=self._swarm_key,
                initiator=False,
                protocol=self._handler,
                local_peer=self.peer_id,
                remote_peer=peer,
                timeout=IO_TIMEOUT_S,
            )
        kind, payload = await recv(reader, REQUEST_MAX_BYTES, IO_TIMEOUT_S)
        if kind is not Kind.REQUEST:
            raise ProtocolError(f"expected REQUEST, got {kind.name}")
        request = Request.parse(payload)
        self._count(requests=1)
        with self._lock:
            published = self._published
        error = None
        if published is None or published.snapshot.digest != request.digest:
            error = {
                "error": "digest mismatch",
                "digest": None if published is None else published.snapshot.digest,
            }
        elif self._active > MAX_CONCURRENT_STREAMS:
            error = {"error": "busy"}
        if error is not None:
            self._count(refused=1)
            await send_json(writer, Kind.ERROR, error, IO_TIMEOUT_S)
            return
        sent = await self._send_part(writer, published, request)
        logger.info(
            "served part %d/%d of %s (%d frames) to %s",
            request.part,
            request.parts,
            request.digest[:12],
            sent,
            peer,
        )

    async def _send_part(self, writer: asyncio.StreamWriter, published: _Published, request: Request) -> int:
        snapshot = published.snapshot
        indices = request.indices(len(snapshot.frames))
        header = header_json(snapshot, published.hashes_hex, len(indices))
        await send_json(writer, Kind.HEADER, header, IO_TIMEOUT_S)
        for index in indices:
            data = await asyncio.to_thread(self._frame, snapshot, index)
            await send(writer, Kind.FRAME, data, IO_TIMEOUT_S)
            self._count(frames_sent=1)
        self._count(parts_served=1)
        return len(indices)

    def _frame(self, snapshot: StateSnapshot, index: int) -> bytes:
        hooks = self._hooks
        if hooks is not None and hooks.before_frame is not None:
            hooks.before_frame(index)
        data = snapshot.frame(index)
        if hooks is not None and hooks.corrupt is not None:
            data = hooks.corrupt(index, data)
        return data

    def close(self) -> None:
        """Stop serving and shut our P2P client down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._loop.run(self._close_p2p(), timeout=30)
        self._loop.stop()

    async def _close_p2p(self) -> None:
        with contextlib.suppress(Exception):
            await self._p2p.remove_binary_stream_handler(self._handler)
        await self._p2p.shutdown()

    def __enter__(self) -> StateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------- downloading


def download_state(
    source: object,
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
    if not RUN_ID.match(run_id):
        raise ValueError(f"run_id must match {RUN_ID.pattern}, got {run_id!r}")
    if parallel < 1 or timeout_s <= 0:
        raise ValueError("parallel must be >= 1 and timeout_s > 0")
    valid = _valid_donors(donors)
    maddr = source.daemon_listen_maddr if isinstance(source, P2P) else daemon_maddr(source)
    swarm_key = swarm_key if swarm_key is not None else swarm_key_of(source)
    loop = LoopThread(name=f"state-download-{run_id}")
    try:
        return loop.run(_download(maddr, handler_name(run_id), valid, limits, timeout_s, parallel, swarm_key))
    finally:
        loop.stop()


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
    swarm_key: SwarmKey | None


async def _download(
    maddr: Any,
    handler: str,
    donors: list[tuple[str, str]],
    limits: DecodeLimits,
    timeout_s: float,
    parallel: int,
    swarm_key: SwarmKey | None,
) -> StateSnapshot:
    p2p = await asyncio.wait_for(P2P.replicate(maddr), IO_TIMEOUT_S)
    ctx = _Context(p2p, handler, limits, swarm_key)
    try:
        async with asyncio.timeout(timeout_s):
            digest, count = Counter(d for _, d in donors).most_common(1)[0]
            if count >= 2:
                group = [peer for peer, d in donors if d == digest]
                return await _fetch_shared(ctx, digest, group, parallel)
            return _mean_snapshot(await _fetch_each(ctx, donors, parallel))
    except TimeoutError:
        raise StateTransferError(f"state download did not finish within {timeout_s}s") from None
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()


async def _fetch_shared(ctx: _Context, digest: str, group: list[str], parallel: int) -> StateSnapshot:
    """Parts of one state from several donors; a failed part goes to a donor that has not failed."""
    assembly = Assembly(digest, ctx.limits)
    parts = min(parallel, len(group))

    def replacement(part: int, failed: set[str], busy: set[str]) -> str | None:
        healthy = [peer for peer in group if peer not in failed]
        idle = [peer for peer in healthy if peer not in busy]
        return (idle or healthy or [None])[0]

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
    attempt: Callable[[int, str], Awaitable[None]],
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


def _mean_snapshot(snapshots: list[StateSnapshot]) -> StateSnapshot:
    """Robust mean (CenteredClip, per tensor) of the donors' states that share the most common schema.

    Why a mean: in a gossip swarm every peer's state differs slightly from the swarm mean (drift is
    bounded, not zero) and the deviations of different peers are largely independent, so the mean of
    several peers is closer to the swarm mean than any one of them. Why clipped: each donor proves
    only that it sent the state it announced, not that the state is honest; with three or more donors
    CenteredClip bounds what a minority of them can move the result (with two it is the plain mean).
    """
    schemas = [tuple((n, tuple(t.shape)) for n, t in s.tensors.items()) for s in snapshots]
    common = Counter(schemas).most_common(1)[0][0]
    used = [s for s, schema in zip(snapshots, schemas, strict=True) if schema == common]
    if len(used) < len(snapshots):
        logger.warning("ignoring %d donor state(s) with another tensor schema", len(snapshots) - len(used))
    if len(used) == 1:
        return used[0]
    tensors = centered_clip_named([s.tensors for s in used])
    return build_snapshot(tensors, _merge_meta([s.meta for s in used]), used[0].chunk_bytes)


def _merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers (round, step, samples_total, ...): the maximum; anything else: the first donor's."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for meta in metas for k in meta):
        values = [meta[key] for meta in metas if key in meta]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        merged[key] = max(values) if numeric else values[0]
    return merged
