"""The pieces of relayed reachability that need no network: circuit addresses, the address book dial
forwards through, the byte meter of relayed streams, and what the program prints."""

from __future__ import annotations

import asyncio

from peers._common import reachability_lines
from swarm.membership import MemberView
from swarm.network import NetworkOptions, ReachabilityResult
from swarm.p2p import RelayedBytes, note_relay_addresses, relays_of, split_circuit
from swarm.p2p import _relay as relay_module

BOOT = "/ip4/10.77.0.1/tcp/4100/p2p/12D3KooWBoot"
ME = "12D3KooWMe"


def test_relay_addresses_go_through_each_initial_peer_but_never_through_a_circuit() -> None:
    options = NetworkOptions(initial_peers=[BOOT, f"{BOOT}/p2p-circuit/p2p/12D3KooWOther"])
    assert options.relay_addresses(ME) == [f"{BOOT}/p2p-circuit/p2p/{ME}"]
    assert NetworkOptions().relay_addresses(ME) == []


def test_a_circuit_address_names_its_relay() -> None:
    assert split_circuit(f"{BOOT}/p2p-circuit/p2p/{ME}") == (BOOT, "12D3KooWBoot")
    assert split_circuit(f"{BOOT}/p2p-circuit") == (BOOT, "12D3KooWBoot")
    assert split_circuit("/ip4/10.77.0.1/tcp/4100/p2p-circuit/p2p/x") is None  # which relay?
    assert split_circuit(BOOT) is None


def test_only_circuit_addresses_are_kept_and_an_empty_record_forgets_them() -> None:
    circuit = f"{BOOT}/p2p-circuit/p2p/{ME}"
    note_relay_addresses(ME, ["/ip4/192.168.1.2/tcp/4200", circuit, 7])  # type: ignore[list-item]
    assert relays_of(ME) == ((BOOT, "12D3KooWBoot"),)
    note_relay_addresses(ME, ["/ip4/1.2.3.4/tcp/1"])  # the peer is direct now
    assert relays_of(ME) == ()


def test_the_address_book_is_bounded(monkeypatch) -> None:
    monkeypatch.setattr(relay_module, "MAX_RELAYED_PEERS", 3)
    for i in range(5):
        note_relay_addresses(f"peer{i}", [f"{BOOT}/p2p-circuit/p2p/peer{i}"])
    assert [relays_of(f"peer{i}") != () for i in range(5)] == [False, False, True, True, True]


class _Writer:
    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += bytes(data)

    def writelines(self, chunks) -> None:  # like asyncio's, straight to the transport (not via write)
        self.written += b"".join(chunks)


def test_the_meter_counts_what_passes_both_ways_and_changes_nothing() -> None:
    async def scenario() -> tuple[RelayedBytes, bytes, bytes]:
        meter = RelayedBytes()
        reader, writer = asyncio.StreamReader(), _Writer()
        meter.meter(reader, writer)  # type: ignore[arg-type]
        reader.feed_data(b"a" * 300)
        reader.feed_eof()
        writer.write(b"b" * 40)
        writer.writelines([b"c" * 2, b"d" * 3])
        return meter, await reader.read(), writer.written

    meter, read, written = asyncio.run(scenario())
    assert read == b"a" * 300 and written == b"b" * 40 + b"cc" + b"ddd"  # passed through unchanged
    assert meter.snapshot() == {"sent": 45, "received": 300, "streams": 1}


def test_a_relayed_peer_is_told_what_it_gets_and_how_to_get_more() -> None:
    addresses = ("/ip4/192.168.1.2/tcp/4200",)
    circuit = f"{BOOT}/p2p-circuit/p2p/{ME}"
    relayed = ReachabilityResult("relay", addresses, answered_by=("boot",), relay_addresses=(circuit,))
    lines = reachability_lines(relayed, "join")
    assert f"join: now reachable through relays at {circuit}" in lines[-1]
    assert "1) open TCP port 4200" in "\n".join(lines)
    client = reachability_lines(ReachabilityResult("unreachable", addresses, answered_by=("boot",)), "join")
    assert "now running in client mode" in client[-1] and "--behind-nat" in client[-1]


def test_a_trainer_relays_only_when_asked_and_reachable_itself(monkeypatch, capsys) -> None:
    from types import SimpleNamespace

    from peers import join

    started: list[object] = []
    monkeypatch.setattr(join, "start_relay", lambda node: started.append(node) or node)

    def trainer(client_mode: bool) -> SimpleNamespace:
        return SimpleNamespace(node=SimpleNamespace(client_mode=client_mode))

    def network(relay: bool) -> SimpleNamespace:
        return SimpleNamespace(relay=relay)

    direct = trainer(False)
    assert join._maybe_relay(direct, network(False), "direct") is None
    assert join._maybe_relay(trainer(True), network(True), "unreachable") is None
    assert join._maybe_relay(trainer(False), network(True), "relay") is None
    assert "not directly reachable: not relaying" in capsys.readouterr().out
    assert join._maybe_relay(direct, network(True), "direct") is direct.node
    assert started == [direct.node]


class _Pending:
    def __init__(self, done: bool) -> None:
        self._done = done

    def done(self) -> bool:
        return self._done


def test_a_relayed_node_connects_out_to_direct_members_only_one_batch_at_a_time(monkeypatch) -> None:
    from types import SimpleNamespace

    from swarm import _node

    asked: list[dict[str, list[str]]] = []

    def fake_connect_out(dht, peers, *, return_future=False):
        asked.append(dict(peers))
        return _Pending(done=False)

    monkeypatch.setattr(_node, "connect_out", fake_connect_out)

    def member(peer_id: str, reachability: str, client_mode: bool = False) -> SimpleNamespace:
        addresses = [f"/ip4/10.77.0.9/tcp/4200/p2p/{peer_id}"]
        record = SimpleNamespace(reachability=reachability, client_mode=client_mode, addresses=addresses)
        return SimpleNamespace(peer_id=peer_id, record=record, expires_at=float("inf"))

    node = _node.SwarmNode.__new__(_node.SwarmNode)
    node.dht, node._connecting = None, None
    node._view = MemberView(1)
    members = [
        member("direct1", "direct"),
        member("relayed", "relay"),
        member("client", "client", client_mode=True),
        member("unknown", "unknown"),
        member("direct2", "direct"),
    ]
    node._view.update({0: members}, now=0.0)
    node._connect_out()
    assert asked == [{p: [f"/ip4/10.77.0.9/tcp/4200/p2p/{p}"] for p in ("direct1", "direct2")}]
    node._connect_out()  # the first batch is still out: no second one
    assert len(asked) == 1
    node._connecting = _Pending(done=True)
    node._connect_out()
    assert len(asked) == 2
