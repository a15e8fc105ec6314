"""swarm.network: address validation, listen shortcuts, identity files, DHT start-up errors, rejoining."""

from __future__ import annotations

import functools
import os
import stat

import pytest
from hivemind.p2p import PeerID

from swarm.network import (
    IDENTITY_FILE_MODE,
    AddressError,
    IdentityError,
    NetworkError,
    NetworkOptions,
    ensure_identity,
    expand_listen_options,
    parse_maddr,
    peer_id_of_identity,
    rejoin_initial_peers,
    start_dht,
)
from tests._processes import wait_until

PEER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


@pytest.mark.parametrize(
    "text",
    [
        "garbage",
        "/ip4/999.1.1.1/tcp/1",
        "/ip4/1.2.3.4/tcp/99999",
        "/ip4/1.2.3.4/tcp/1/p2p/notapeer",
        "",
        "  ",
    ],
)
def test_malformed_address_is_quoted(text: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_maddr(text, what="initial peer")
    assert repr(text) in str(info.value)


def test_initial_peer_needs_peer_id() -> None:
    with pytest.raises(AddressError, match="no /p2p/"):
        parse_maddr("/ip4/1.2.3.4/tcp/31337", what="initial peer", require_peer_id=True)
    maddr = parse_maddr(f"/ip4/1.2.3.4/tcp/31337/p2p/{PEER}", require_peer_id=True)
    assert maddr.value_for_protocol("p2p") == PEER


def test_port_and_public_ip_expand_like_petals() -> None:
    options = expand_listen_options(host_maddrs=[], announce_maddrs=[], port=31337, public_ip="203.0.113.7")
    assert options.host_maddrs == ["/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31337"]
    assert options.announce_maddrs == ["/ip4/203.0.113.7/tcp/31337"]
    v6 = expand_listen_options(host_maddrs=[], announce_maddrs=[], port=1, public_ip="2001:db8::1")
    assert v6.announce_maddrs == ["/ip6/2001:db8::1/tcp/1"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"port": 1, "host_maddrs_given": True}, "--port or --host-maddrs"),
        ({"port": 1, "public_ip": "1.2.3.4", "announce_maddrs_given": True}, "--public-ip or --announce"),
        ({"public_ip": "1.2.3.4"}, "needs --port"),
        ({"port": 70000}, "out of range"),
        ({"port": 1, "public_ip": "not-an-ip"}, "'not-an-ip'"),
    ],
)
def test_shortcut_misuse_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(AddressError, match=message):
        expand_listen_options(host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], **kwargs)


def test_bad_host_address_from_config_is_refused() -> None:
    with pytest.raises(AddressError, match="'/ip4/localhost/tcp/1'"):
        NetworkOptions.from_user_input(
            initial_peers=[], host_maddrs=["/ip4/localhost/tcp/1"], announce_maddrs=[]
        )


def test_identity_created_private_and_reused(tmp_path) -> None:
    path = tmp_path / "keys" / "peer.key"
    os.umask(0o022)
    ensure_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == IDENTITY_FILE_MODE
    first = peer_id_of_identity(path)
    ensure_identity(path)
    assert peer_id_of_identity(path) == first
    other = tmp_path / "other.key"
    ensure_identity(other)
    assert peer_id_of_identity(other) != first


def test_corrupt_identity_is_reported(tmp_path) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(b"\x00not a key")
    with pytest.raises(IdentityError, match=r"bad\.key"):
        ensure_identity(path)


def test_same_identity_file_gives_same_peer_id_on_the_network(tmp_path) -> None:
    path = ensure_identity(tmp_path / "id.key")
    peer_ids = []
    for _ in range(2):
        dht = start_dht(NetworkOptions(identity_path=str(path)), path)
        try:
            peer_ids.append(dht.peer_id.to_base58())
        finally:
            dht.shutdown()
    assert peer_ids == [peer_id_of_identity(path)] * 2


def test_unreachable_initial_peer_is_a_clear_error(tmp_path) -> None:
    path = ensure_identity(tmp_path / "id.key")
    options = NetworkOptions(initial_peers=[f"/ip4/127.0.0.1/tcp/9/p2p/{PEER}"], startup_timeout_s=5)
    with pytest.raises(NetworkError, match=r"could not join the swarm through /ip4/127\.0\.0\.1/tcp/9"):
        start_dht(options, path)


async def _table_of(_dht, node) -> set[str]:
    """The peer ids in a DHT node's routing table (run inside the DHT process)."""
    return {peer_id.to_base58() for peer_id in node.protocol.routing_table.peer_id_to_uid}


async def _forget(peer_id: str, _dht, node) -> None:
    """What a partition does to a routing table: hivemind drops a node whose request went unanswered."""
    table = node.protocol.routing_table
    del table[table.get(peer_id=PeerID.from_base58(peer_id))]


def test_a_peer_rejoins_an_initial_peer_both_routing_tables_lost(tmp_path) -> None:
    entry = start_dht(NetworkOptions(), ensure_identity(tmp_path / "entry.key"))
    try:
        maddrs = [str(m) for m in entry.get_visible_maddrs()]
        peer = start_dht(NetworkOptions(initial_peers=maddrs), ensure_identity(tmp_path / "peer.key"))
        try:
            ids = entry.peer_id.to_base58(), peer.peer_id.to_base58()
            assert ids[0] in peer.run_coroutine(_table_of) and ids[1] in entry.run_coroutine(_table_of)
            assert rejoin_initial_peers(peer, maddrs) == 0  # nothing lost: nothing pinged
            peer.run_coroutine(functools.partial(_forget, ids[0]))
            entry.run_coroutine(functools.partial(_forget, ids[1]))
            assert ids[0] not in peer.run_coroutine(_table_of)
            assert ids[1] not in entry.run_coroutine(_table_of)
            assert rejoin_initial_peers(peer, maddrs, return_future=True).result(timeout=30) == 1
            assert ids[0] in peer.run_coroutine(_table_of)  # we know the entry again,
            assert ids[1] in entry.run_coroutine(_table_of)  # and it knows us (from our ping)
        finally:
            peer.shutdown()
    finally:
        entry.shutdown()


def test_a_swarm_node_rejoins_by_itself(monkeypatch) -> None:
    """The wiring: an announcing node pings the initial peers its table lost, without being asked."""
    from swarm import NodeInfo, SwarmNode
    from swarm import _node as node_module

    monkeypatch.setattr(node_module, "REJOIN_EVERY_S", 0.2)
    entry = SwarmNode(NetworkOptions(), NodeInfo("rejoin", "ab12", "bootstrap"), record_interval_s=0.2)
    try:
        maddrs = entry.visible_maddrs()
        peer = SwarmNode(
            NetworkOptions(initial_peers=maddrs), NodeInfo("rejoin", "ab12", "trainer"), record_interval_s=0.2
        )
        try:
            peer.dht.run_coroutine(functools.partial(_forget, entry.peer_id))
            entry.dht.run_coroutine(functools.partial(_forget, peer.peer_id))  # or its stores would remind us
            back = lambda: entry.peer_id in peer.dht.run_coroutine(_table_of)  # noqa: E731
            wait_until(back, 30, "the entry back in the routing table")
        finally:
            peer.close()
    finally:
        entry.close()


def test_a_failed_join_says_whether_something_listens_at_the_address() -> None:
    """A wrong peer id at a live address is not a dead address: the error points at the /p2p/ part."""
    import socket

    from swarm.network._dht import _explain_start_failure

    peer_id = "QmcEPrat8ShnCph8WjkREzt5CPXF2FW3ncoTx7uKNGgg7M"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"
        options = NetworkOptions.from_user_input(initial_peers=[address], host_maddrs=[], announce_maddrs=[])
        live = _explain_start_failure(options, TimeoutError("no answer"))
    assert "something listens at" in live and "/p2p/<peer id>" in live and "no answer" in live
    dead = _explain_start_failure(options, TimeoutError("no answer"))  # the listener is closed now
    assert "is that peer running and reachable?" in dead and "something listens" not in dead
