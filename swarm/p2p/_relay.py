"""Streams through libp2p circuit relays: where to dial a relayed peer, and how many bytes such streams carry.

A peer behind NAT that reserved a slot on a relay is reachable at ``<relay maddr>/p2p-circuit/p2p/<id>``.
The bundled p2pd does not advertise that address itself (neither its ``identify`` answer nor the
addresses other daemons learn from the libp2p DHT list it), so a daemon asked to open a stream to the
peer by id alone tries its private addresses and fails. The circuit addresses are in the peer's
membership record: :func:`note_relay_addresses` keeps them (``SwarmNode`` does, for every member it
reads) and :func:`dial` connects through them before opening the stream.

:data:`RELAYED` counts the stream bytes (what the swarm protocols write and read, without libp2p's
framing and encryption) of every stream whose connection is relayed: the daemon tells each side the
remote address of the connection a stream runs on, and a relayed one contains ``/p2p-circuit``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

MAX_RELAYED_PEERS = 4096
"""Peers whose circuit addresses are kept at most (the oldest go first)."""


class _Routes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_peer: dict[str, tuple[str, ...]] = {}

    def note(self, peer_id: str, addresses: Sequence[str]) -> None:
        circuits = tuple(a for a in addresses if isinstance(a, str) and "/p2p-circuit" in a)
        with self._lock:
            self._by_peer.pop(peer_id, None)
            if circuits:
                self._by_peer[peer_id] = circuits
            while len(self._by_peer) > MAX_RELAYED_PEERS:
                del self._by_peer[next(iter(self._by_peer))]

    def get(self, peer_id: str) -> tuple[str, ...]:
        with self._lock:
            return self._by_peer.get(peer_id, ())


_ROUTES = _Routes()


def note_relay_addresses(peer_id: str, addresses: Sequence[str]) -> None:
    """Remember ``peer_id``'s ``/p2p-circuit`` addresses (from its record); none listed forgets it."""
    _ROUTES.note(peer_id, addresses)


def relay_addresses_of(peer_id: str) -> tuple[str, ...]:
    return _ROUTES.get(peer_id)


async def connect_via_relay(p2p: Any, peer_id: str, timeout: float) -> None:
    """If ``peer_id`` is only reachable through relays, have the daemon connect to it through them.

    A no-op for other peers, and cheap when a connection exists already. Failures are left to the
    stream that follows: it fails with the daemon's own reason.
    """
    circuits = relay_addresses_of(peer_id)
    if not circuits:
        return
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    try:
        addresses = [Multiaddr(a) for a in circuits]
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer_id), addresses), timeout)
    except Exception:  # the stream open reports why the peer cannot be reached
        return


class RelayedBytes:
    """Process-wide counts of stream bytes sent and received over relayed connections (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.streams = 0

    def add(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"sent": self.sent, "received": self.received, "streams": self.streams}

    def meter(self, remote_maddr: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Count this stream's bytes from now on if its connection is relayed; return whether it is.

        Counts at the stream's two ends in this process: what the peer's data callback feeds the
        reader, and what is written to the writer.
        """
        if "/p2p-circuit" not in str(remote_maddr):
            return False
        with self._lock:
            self.streams += 1
        feed, write, writelines = reader.feed_data, writer.write, writer.writelines

        def counted_feed(data: Any) -> None:
            self.add(received=len(data))
            feed(data)

        def counted_write(data: Any) -> None:
            self.add(sent=len(data))
            write(data)

        def counted_writelines(chunks: Any) -> None:
            chunks = list(chunks)
            self.add(sent=sum(len(c) for c in chunks))
            writelines(chunks)

        reader.feed_data = counted_feed  # type: ignore[method-assign]
        writer.write = counted_write  # type: ignore[method-assign]
        writer.writelines = counted_writelines  # type: ignore[method-assign,assignment]
        return True


RELAYED = RelayedBytes()
"""Every relayed stream of this process, whichever service opened or served it."""
