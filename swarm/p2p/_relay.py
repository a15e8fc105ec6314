"""Who is reachable only through a relay, which relays a peer behind NAT trusts, and relayed byte counts.

A peer behind NAT announces ``<relay maddr>/p2p-circuit/p2p/<its id>`` for each of its relays (its
initial peers) instead of addresses nobody can dial. :func:`note_relay_addresses` keeps those
addresses from the membership records (``SwarmNode`` does, for every member it reads);
:func:`relays_of` gives :func:`swarm.p2p.dial` the relays to forward through
(:mod:`swarm.p2p._forward`). :func:`trust_relays` names the peers whose forwarded streams this process
serves: only they may say who a forwarded stream comes from.

:data:`RELAYED` counts the stream bytes (what the swarm protocols write and read, without libp2p's
framing and encryption) of every forwarded stream that starts or ends in this process;
:data:`FORWARDED` counts what a relay carried for others.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Sequence
from typing import Any

MAX_RELAYED_PEERS = 4096
"""Peers whose circuit addresses are kept at most (the oldest go first)."""

CIRCUIT = "/p2p-circuit"


def split_circuit(address: str) -> tuple[str, str] | None:
    """``(relay maddr with its /p2p/ id, relay peer id)`` of a circuit address, or None if it is not one."""
    relay_maddr, sep, _ = address.partition(CIRCUIT)
    if not sep or "/p2p/" not in relay_maddr:
        return None
    relay_id = relay_maddr.rsplit("/p2p/", 1)[1]
    return (relay_maddr, relay_id) if relay_id and "/" not in relay_id else None


class _Routes:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_peer: dict[str, tuple[tuple[str, str], ...]] = {}
        self._trusted: frozenset[str] = frozenset()

    def note(self, peer_id: str, addresses: Sequence[Any]) -> None:
        relays = tuple(r for a in addresses if isinstance(a, str) and (r := split_circuit(a)) is not None)
        with self._lock:
            self._by_peer.pop(peer_id, None)
            if relays:
                self._by_peer[peer_id] = relays
            while len(self._by_peer) > MAX_RELAYED_PEERS:
                del self._by_peer[next(iter(self._by_peer))]

    def get(self, peer_id: str) -> tuple[tuple[str, str], ...]:
        with self._lock:
            return self._by_peer.get(peer_id, ())

    def trust(self, peer_ids: Iterable[str]) -> None:
        with self._lock:
            self._trusted = frozenset(peer_ids)

    def trusted(self, peer_id: str) -> bool:
        return peer_id in self._trusted


_ROUTES = _Routes()


def note_relay_addresses(peer_id: str, addresses: Sequence[Any]) -> None:
    """Remember ``peer_id``'s circuit addresses (from its record); a record without any forgets it."""
    _ROUTES.note(peer_id, addresses)


def relays_of(peer_id: str) -> tuple[tuple[str, str], ...]:
    """``(relay maddr, relay peer id)`` pairs through which ``peer_id`` said it can be reached."""
    return _ROUTES.get(peer_id)


def trust_relays(peer_ids: Iterable[str]) -> None:
    """Serve forwarded streams from these peers (replacing any earlier set); an empty set serves none."""
    _ROUTES.trust(peer_ids)


def is_trusted_relay(peer_id: str) -> bool:
    return _ROUTES.trusted(peer_id)


class RelayedBytes:
    """Process-wide counts of stream bytes sent and received over relays (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0
        self.streams = 0

    def add(self, sent: int = 0, received: int = 0, streams: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
            self.streams += streams

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {"sent": self.sent, "received": self.received, "streams": self.streams}

    def meter(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Count this stream's bytes from now on, at its two ends in this process: what the daemon
        feeds the reader, and what is written to the writer."""
        self.add(streams=1)
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


RELAYED = RelayedBytes()
"""Every forwarded stream of this process that it opened or served (not those it forwarded)."""

FORWARDED = RelayedBytes()
"""What this process carried as a relay: ``sent`` is what it passed on to the peers behind NAT,
``received`` what it passed back to the peers that dialled them, ``streams`` the streams forwarded."""
