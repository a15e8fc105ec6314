"""Swarm's relay (swarm/p2p/_forward.py) with real daemons on loopback: a relay, a peer that trusts it,
and diallers. The peer and the first dialler listen on no address (``no_listen``), like two peers
behind NAT: each dials out to the relay only, so nothing but the relay connects them. A listening
dialler stands for a public peer, to which the peer connects out (``connect_out``) so that its streams
need no relay."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import secrets
from collections.abc import Iterator

import hivemind
import psutil
import pytest

from swarm.network import SwarmKey, connect_out
from swarm.p2p import (
    RelayedBytes,
    RelayForwarder,
    StreamService,
    dial,
    note_relay_addresses,
    read_message,
    run_with_replica,
    trust_relays,
    write_message,
)
from swarm.p2p._forward import FORWARD_HANDLER

RUN = "relay-test"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
ECHO = "swarm.relay-test.echo"
PAYLOAD = secrets.token_bytes(600 * 1024)
"""Far more than the 128 KiB after which the bundled p2pd's circuit relay resets a connection."""


class Kind(enum.IntEnum):
    DATA = 1


def _limit(kind: Kind) -> int:
    return 2 * len(PAYLOAD)


class Echo(StreamService):
    """Answers one message with its bytes reversed, and remembers who it served."""

    what = "echo"

    def __init__(self, dht: hivemind.DHT, swarm_key: SwarmKey | None) -> None:
        super().__init__(RUN, ECHO, dht=dht, p2p_factory=None, swarm_key=swarm_key, auth_timeout_s=10.0)
        self.served: list[str] = []
        self._start("echo")

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _, payload = await read_message(reader, Kind, _limit, 10.0)
        self.served.append(peer)
        await write_message(writer, Kind.DATA, payload[::-1], 10.0)


def _p2pds() -> set[psutil.Process]:
    return {p for p in psutil.Process().children(recursive=True) if p.name() == "p2pd"}


@pytest.fixture(scope="module")
def dhts() -> Iterator[tuple[hivemind.DHT, hivemind.DHT, hivemind.DHT, hivemind.DHT]]:
    """(dialler behind NAT, relay, peer behind NAT, public dialler); their daemons must end with them."""
    before = _p2pds()
    relay = hivemind.DHT(host_maddrs=[LOOPBACK], start=True)
    maddrs = [str(m) for m in relay.get_visible_maddrs()]
    dialler = hivemind.DHT(initial_peers=maddrs, no_listen=True, start=True)
    peer = hivemind.DHT(initial_peers=maddrs, no_listen=True, start=True)
    public = hivemind.DHT(initial_peers=maddrs, host_maddrs=[LOOPBACK], client_mode=True, start=True)
    ours = _p2pds() - before
    try:
        yield dialler, relay, peer, public
    finally:
        for dht in (dialler, relay, peer, public):
            dht.shutdown()
        _, alive = psutil.wait_procs(ours, timeout=30)
        assert not alive, f"p2pd daemons outlived their DHTs: {alive}"


@pytest.fixture(autouse=True)
def no_daemon_leaks(dhts) -> Iterator[None]:
    """Overrides conftest's check: the module's three daemons outlive each test (``dhts`` checks them)."""
    ours = _p2pds()
    yield
    leaked = _p2pds() - ours
    assert not leaked, f"p2pd daemons leaked by this test: {leaked}"


@pytest.fixture
def book(dhts) -> Iterator[str]:
    """The peer's id, noted as reachable through the relay only, which the peer trusts."""
    _, relay, peer, _ = dhts
    relay_maddr = str(relay.get_visible_maddrs()[0])
    peer_id = peer.peer_id.to_base58()
    note_relay_addresses(peer_id, [f"{relay_maddr}/p2p-circuit/p2p/{peer_id}"])
    trust_relays([relay.peer_id.to_base58()])
    try:
        yield peer_id
    finally:
        note_relay_addresses(peer_id, [])
        trust_relays([])


def _echo_through(dialler: hivemind.DHT, peer_id: str, swarm_key: SwarmKey | None) -> bytes:
    async def work(p2p) -> bytes:
        reader, writer = await dial(p2p, peer_id, ECHO, swarm_key, 10.0)
        try:
            await write_message(writer, Kind.DATA, PAYLOAD, 10.0)
            return (await read_message(reader, Kind, _limit, 10.0))[1]
        finally:
            writer.close()

    return run_with_replica(dialler, work, name="dialler", open_timeout_s=30, timeout_s=60)


@pytest.mark.parametrize("private", [False, True], ids=["public", "private"])
def test_a_stream_far_larger_than_a_circuit_allows_crosses_the_relay(dhts, book, private: bool) -> None:
    dialler, relay, peer, _ = dhts
    key = SwarmKey(secrets.token_hex(32).encode()) if private else None
    carried = RelayedBytes()
    with RelayForwarder(RUN, dht=relay, swarm_key=key, counter=carried), Echo(peer, key) as echo:
        assert _echo_through(dialler, book, key) == PAYLOAD[::-1]
    assert echo.served == [dialler.peer_id.to_base58()]  # the relay said who dialled, and was believed
    counts = carried.snapshot()
    assert counts["streams"] == 1
    assert len(PAYLOAD) < counts["sent"] < len(PAYLOAD) + 4096  # the request, its handshake and frames
    assert len(PAYLOAD) < counts["received"] < len(PAYLOAD) + 4096


def test_a_peer_serves_forwarded_streams_only_from_relays_it_trusts(dhts, book, caplog) -> None:
    dialler, relay, peer, _ = dhts
    trust_relays([])
    refused = pytest.raises((ConnectionError, asyncio.IncompleteReadError))
    warnings = caplog.at_level(logging.WARNING)
    with RelayForwarder(RUN, dht=relay, swarm_key=None), Echo(peer, None) as echo, warnings, refused:
        _echo_through(dialler, book, None)
    assert echo.served == []
    assert "is not one of our relays" in caplog.text


def test_the_relay_forwards_only_to_peers_connected_to_it(dhts) -> None:
    dialler, relay, _, _ = dhts
    stranger = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"
    note_relay_addresses(stranger, [f"{relay.get_visible_maddrs()[0]}/p2p-circuit/p2p/{stranger}"])
    try:
        refused = pytest.raises(ConnectionError, match="is not connected to this relay")
        with RelayForwarder(RUN, dht=relay, swarm_key=None), refused:
            _echo_through(dialler, stranger, None)
    finally:
        note_relay_addresses(stranger, [])


def test_garbage_sent_to_the_relay_is_refused_and_it_goes_on_forwarding(dhts, book) -> None:
    dialler, relay, peer, _ = dhts
    relay_id = relay.peer_id

    async def garbage(p2p) -> bytes:
        _, reader, writer = await p2p.call_binary_stream_handler(relay_id, FORWARD_HANDLER)
        writer.write(b"\x71\xff\xff\xff\xff" + b"x" * 64)  # a FORWARD claiming 4 GiB
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        try:
            return await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()

    with RelayForwarder(RUN, dht=relay, swarm_key=None), Echo(peer, None) as echo:
        assert run_with_replica(dialler, garbage, name="garbage", open_timeout_s=30, timeout_s=30) == b""
        assert _echo_through(dialler, book, None) == PAYLOAD[::-1]
    assert len(echo.served) == 1


def test_a_peer_behind_nat_that_connected_out_is_dialled_directly(dhts, book) -> None:
    _, relay, peer, public = dhts
    carried = RelayedBytes()
    addresses = {public.peer_id.to_base58(): [str(m) for m in public.get_visible_maddrs()]}
    with RelayForwarder(RUN, dht=relay, swarm_key=None, counter=carried), Echo(peer, None) as echo:
        assert connect_out(peer, addresses) == 1
        assert _echo_through(public, book, None) == PAYLOAD[::-1]
    assert echo.served == [public.peer_id.to_base58()]
    assert carried.snapshot() == {"sent": 0, "received": 0, "streams": 0}  # not a byte through the relay
