"""The asking side: dial a peer's handler and prove the swarm key, and one-shot replicas for blocking calls.

:func:`dial` is how every initiator opens a stream (gossip's HELLO, a state request, a reachability
check). :func:`run_with_replica` is how a blocking call (a state download, a reachability check) talks
to the network from any thread: it opens its own replica of the daemon on a temporary loop thread,
runs one coroutine with it, and shuts both down.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from swarm.p2p._auth import StreamKey, authenticate_dialled
from swarm.p2p._forward import open_via_relays
from swarm.p2p._loop import LoopThread
from swarm.p2p._relay import RELAYED, relays_of
from swarm.p2p._setup import replicate, source_maddr

if TYPE_CHECKING:
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

T = TypeVar("T")


async def dial(
    p2p: P2P, peer: str, handler: str, swarm_key: StreamKey | None, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a stream to ``handler`` on ``peer`` and, in a private swarm, run the swarm key handshake.

    A peer known to be reachable only through relays (:func:`~swarm.p2p._relay.note_relay_addresses`)
    is reached through one of them (:mod:`swarm.p2p._forward`), unless it has connected to us; such a
    stream's bytes are counted in ``RELAYED``.

    Each step is bounded by ``timeout`` seconds. If the handshake fails (:class:`AuthError`) the stream
    is closed before the error propagates; otherwise closing it is the caller's job.
    """
    reader, writer = await _open(p2p, peer, handler, swarm_key, timeout)
    await authenticate_dialled(p2p, reader, writer, swarm_key, handler, peer, timeout)
    return reader, writer


async def _open(
    p2p: P2P, peer: str, handler: str, swarm_key: StreamKey | None, timeout: float
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to ``peer``: directly, unless it is reachable only through relays and has not connected
    to us (a peer behind NAT connects out to direct members, :func:`swarm.network.connect_out`)."""
    from hivemind.p2p import PeerID

    relayed = bool(relays_of(peer))
    if not relayed or await _connected(p2p, peer):
        try:
            _, reader, writer = await asyncio.wait_for(
                p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler), timeout
            )
            return reader, writer
        except Exception:
            if not relayed:
                raise
    reader, writer = await open_via_relays(p2p, peer, handler, swarm_key, timeout)
    RELAYED.meter(reader, writer)
    return reader, writer


async def _connected(p2p: P2P, peer: str) -> bool:
    return any(info.peer_id.to_base58() == peer for info in await p2p.list_peers())


def run_with_replica(
    source: DHT | P2P,
    work: Callable[[P2P], Awaitable[T]],
    *,
    name: str,
    open_timeout_s: float,
    timeout_s: float | None = None,
) -> T:
    """Run ``work(p2p)`` with a replica of ``source``'s daemon on a temporary loop thread; blocking.

    ``source`` is a running ``hivemind.DHT`` or ``hivemind.p2p.P2P``. Opening the replica is bounded by
    ``open_timeout_s``, the whole call by ``timeout_s`` (None: no bound). The replica and the loop
    thread (named ``name``) are shut down whatever happens.
    """
    maddr = source_maddr(source)
    loop = LoopThread(name=name)
    try:
        return loop.run(_with_replica(maddr, work, open_timeout_s), timeout=timeout_s)
    finally:
        loop.stop()


async def _with_replica(maddr: Any, work: Callable[[P2P], Awaitable[T]], open_timeout_s: float) -> T:
    p2p = await asyncio.wait_for(replicate(maddr), open_timeout_s)
    try:
        return await work(p2p)
    finally:
        with contextlib.suppress(Exception):
            await p2p.shutdown()
