"""Reachability dial-back (swarm/network/_reachability.py, the asker's side in _reachability_ask.py): the
request's bounds, the checker's refusal to dial what the asker does not announce, and a peer nobody can
dial switching to client mode."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable, Iterator

import pytest

from swarm.network._reachability import (
    MAX_ADDRESSES,
    MESSAGE_MAX_BYTES,
    Kind,
    ReachabilityChecker,
    RequestRefused,
    dial_target,
    handler_name,
    parse_request,
)
from swarm.network._reachability_ask import ask, check_reachability
from swarm.p2p import read_message, write_message
from tests._processes import join_address, swarm_cli, terminate_and_wait, wait_until
from tests.workers.tiny import BACKGROUND, cli_sets, tiny

RUN = "reach-test"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def closed_port() -> int:
    """A loopback TCP port that nothing listens on (bound once, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------- pure functions


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"not json", "malformed"),
        (b"[1, 2]", "not a JSON object"),
        (b"{}", "non-empty list"),
        (json.dumps({"addresses": "/ip4/1.2.3.4/tcp/1"}).encode(), "non-empty list"),
        (json.dumps({"addresses": [7]}).encode(), "not a string"),
        (json.dumps({"addresses": ["/ip4/1.2.3.4/tcp/1" + "0" * 300]}).encode(), "not a string"),
        (
            json.dumps(
                {"addresses": [f"/ip4/10.0.0.1/tcp/{p}" for p in range(1, MAX_ADDRESSES + 2)]}
            ).encode(),
            f"at most {MAX_ADDRESSES}",
        ),
    ],
)
def test_bad_requests_are_refused_with_the_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(RequestRefused, match=reason):
        parse_request(payload)


def test_only_plain_tcp_addresses_are_dial_targets() -> None:
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    assert dial_target(f"/ip4/127.0.0.1/tcp/4001/p2p/{peer}") == ("127.0.0.1", 4001)
    assert dial_target("/ip6/::1/tcp/5") == ("::1", 5)
    for address in ["/ip4/0.0.0.0/tcp/1", "/dns4/example.org/tcp/1", "/ip4/1.2.3.4/udp/5", "garbage"]:
        assert dial_target(address) is None, address
    assert dial_target(f"/ip4/1.2.3.4/tcp/5/p2p/{peer}/p2p-circuit") is None


# ---------------------------------------------------------------------------- the RPC, in process


@pytest.fixture
def pair() -> Iterator[tuple[Callable, object, object]]:
    """Two bare hivemind P2P daemons on one private loop, the second connected to the first:
    (run on the loop, checker's P2P, asker's P2P)."""
    from hivemind.p2p import P2P

    from swarm.p2p import LoopThread

    loop = LoopThread("reach-test")
    made = []

    def run(coro, timeout: float = 60):
        return loop.run(coro, timeout)

    try:
        made.append(run(P2P.create(host_maddrs=[LOOPBACK])))
        maddrs = [str(m) for m in run(made[0].get_visible_maddrs())]
        made.append(run(P2P.create(initial_peers=maddrs, host_maddrs=[LOOPBACK])))
        yield run, made[0], made[1]
    finally:
        for p2p in made:
            run(p2p.shutdown(), 30)
        loop.stop()


@pytest.fixture
def listener() -> Iterator[int]:
    """A loopback TCP port that accepts connections."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield sock.getsockname()[1]


def test_checker_dials_only_what_the_asker_announces(pair, listener: int) -> None:
    _, checker_p2p, asker_p2p = pair
    asker = asker_p2p.peer_id.to_base58()
    open_address = f"/ip4/127.0.0.1/tcp/{listener}/p2p/{asker}"
    closed_address = f"/ip4/127.0.0.1/tcp/{closed_port()}"
    announced = {asker: [open_address, closed_address]}

    async def checker_factory():
        return checker_p2p

    checker = ReachabilityChecker(announced.get, run_id=RUN, p2p_factory=checker_factory, cooldown_s=0)
    try:
        checker_id = checker_p2p.peer_id.to_base58()
        result = check_reachability(asker_p2p, RUN, [checker_id], [open_address, closed_address])
        assert result.status == "direct"
        assert result.reachable == (open_address,) and result.answered_by == (checker_id,)

        only_closed = check_reachability(asker_p2p, RUN, [checker_id], [closed_address])
        assert only_closed.status == "unreachable" and only_closed.reachable == ()

        third_party = "/ip4/127.0.0.1/tcp/22"
        refused = check_reachability(asker_p2p, RUN, [checker_id], [open_address, third_party])
        assert refused.status == "unknown"
        assert "is not announced in the record" in refused.errors[0] and third_party in refused.errors[0]

        announced.clear()  # the asker has no record (yet): nothing is dialled
        unknown = check_reachability(asker_p2p, RUN, [checker_id], [open_address])
        assert unknown.status == "unknown" and "no membership record" in unknown.errors[0]
        assert checker.checks == 2
    finally:
        checker.close()


def test_checker_dials_for_one_asker_at_most_once_per_cooldown(pair, listener: int) -> None:
    _, checker_p2p, asker_p2p = pair
    address = f"/ip4/127.0.0.1/tcp/{listener}"

    async def checker_factory():
        return checker_p2p

    checker = ReachabilityChecker(
        {asker_p2p.peer_id.to_base58(): [address]}.get, run_id=RUN, p2p_factory=checker_factory
    )
    try:
        checker_id = checker_p2p.peer_id.to_base58()
        assert check_reachability(asker_p2p, RUN, [checker_id], [address]).status == "direct"
        again = check_reachability(asker_p2p, RUN, [checker_id], [address])
        assert again.status == "unknown" and "asked too often" in again.errors[0]
        assert checker.checks == 1
    finally:
        checker.close()


def test_checker_refuses_oversized_and_malformed_requests(pair) -> None:
    run, checker_p2p, asker_p2p = pair
    asker = asker_p2p.peer_id.to_base58()
    many = [f"/ip4/127.0.0.1/tcp/{port}" for port in range(1000, 1000 + MAX_ADDRESSES + 1)]

    async def checker_factory():
        return checker_p2p

    checker = ReachabilityChecker({asker: many}.get, run_id=RUN, p2p_factory=checker_factory)
    handler = handler_name(RUN)
    try:
        with pytest.raises(Exception, match=f"at most {MAX_ADDRESSES}"):
            run(ask(asker_p2p, handler, checker.peer_id, many))

        async def raw(kind: Kind, payload: bytes) -> tuple[Kind, bytes]:
            _, reader, writer = await asker_p2p.call_binary_stream_handler(checker_p2p.peer_id, handler)
            try:
                await write_message(writer, kind, payload, 10)
                return await read_message(reader, Kind, lambda kind: MESSAGE_MAX_BYTES, 10)
            finally:
                writer.close()

        kind, payload = run(raw(Kind.REQUEST, b"{not json"))
        assert kind is Kind.ERROR and "malformed" in json.loads(payload)["error"]
        kind, payload = run(raw(Kind.REPLY, b"{}"))
        assert kind is Kind.ERROR and "expected REQUEST" in json.loads(payload)["error"]

        async def oversized() -> bytes:
            _, reader, writer = await asker_p2p.call_binary_stream_handler(checker_p2p.peer_id, handler)
            try:
                writer.write(bytes([Kind.REQUEST]) + (MESSAGE_MAX_BYTES + 1).to_bytes(4, "big"))
                await writer.drain()
                return await asyncio.wait_for(reader.read(), 10)
            finally:
                writer.close()

        assert run(oversized()) == b""  # the header alone is refused: the stream is closed, nothing read
        assert checker.checks == 0
    finally:
        checker.close()


# ---------------------------------------------------------------------------- whole peers


CONFIG = ["--config", "configs/local-tiny.yaml", *cli_sets(tiny(*BACKGROUND))]
RUN_ID = "local-tiny"


def _handlers_served(maddr: str, names: list[str]) -> dict[str, bool]:
    """Which of the stream handlers ``names`` the peer at ``maddr`` (ending in /p2p/<id>) serves: a
    fresh client opens a stream to each (closed at once); "protocols not supported" means none."""
    from hivemind.p2p import P2P, PeerID

    async def probe() -> dict[str, bool]:
        p2p = await P2P.create(initial_peers=[maddr], host_maddrs=[LOOPBACK])
        peer = PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])
        served = {}
        try:
            for name in names:
                try:
                    _, _, writer = await p2p.call_binary_stream_handler(peer, name)
                except Exception as exc:  # hivemind's ControlFailure, raised for any failed open
                    if "protocols not supported" not in str(exc):
                        raise
                    served[name] = False
                else:
                    writer.close()
                    served[name] = True
        finally:
            await p2p.shutdown()
        return served

    return asyncio.run(asyncio.wait_for(probe(), 60))


@pytest.mark.multipeer
def test_undialable_peer_switches_to_client_mode_and_a_dialable_one_is_direct(spawn) -> None:
    from swarm import NodeInfo, SwarmNode
    from swarm.gossip._protocol import handler_name as gossip_handler
    from swarm.network import NetworkOptions
    from swarm.state._transfer_protocol import handler_name as state_handler

    boot = spawn(swarm_cli("bootstrap", *CONFIG))
    maddr = join_address(boot)
    boot.wait_for_line(lambda line: "reachability check skipped (no other peer to ask)" in line, timeout=30)

    # the hidden peer listens on one port and announces another, where nothing listens: nobody who
    # dials what it announces gets through, but the test can still reach its daemon directly
    listen, port = closed_port(), closed_port()
    where = [
        "--host-maddrs",
        f"/ip4/127.0.0.1/tcp/{listen}",
        "--announce-maddrs",
        f"/ip4/127.0.0.1/tcp/{port}",
    ]
    hidden = spawn(swarm_cli("join", "--initial-peers", maddr, *CONFIG, *where))
    normal = spawn(swarm_cli("join", "--initial-peers", maddr, *CONFIG))
    hidden.wait_for_line(lambda line: "now running in client mode" in line, timeout=90)
    normal.wait_for_line(lambda line: "reachability direct" in line, timeout=90)
    advice = hidden.output()
    assert f"no peer could dial this peer back at /ip4/127.0.0.1/tcp/{port}" in advice
    assert f"1) open TCP port {port}" in advice
    assert f"2) pass --public-ip YOUR_PUBLIC_IP --port {port}" in advice
    assert f"3) or pass --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/{port}" in advice

    hidden_id = hidden.wait_for_line(lambda line: " joined run " in line, 5).split()[1]
    normal_id = normal.wait_for_line(lambda line: " joined run " in line, 5).split()[1]
    # a monitor-like observer: validates the signed records, announces nothing
    network = NetworkOptions(initial_peers=[maddr], client_mode=True)
    observer = SwarmNode(network, NodeInfo(RUN_ID, "", "trainer"), announce=False)
    try:
        records = {}

        def both_recorded() -> bool:
            records.update({m.peer_id: m.record for m in observer.members()})
            return (
                hidden_id in records
                and records[hidden_id].reachability == "client"
                and normal_id in records
                and records[normal_id].reachability == "direct"
                and bool(records[normal_id].state_hash)
            )

        wait_until(both_recorded, timeout=30, what="both joiners' records after the check")
        assert records[hidden_id].client_mode and records[hidden_id].addresses == []
        assert not records[normal_id].client_mode and records[normal_id].addresses
        # the client-mode peer offers no state to joiners ...
        assert records[hidden_id].state_hash == "", records[hidden_id]
    finally:
        observer.close()
    # ... and serves nothing at all: its daemon, dialled directly, has no gossip or state handler
    # left, while the dialable peer serves all three
    handlers = [gossip_handler(RUN_ID), gossip_handler(f"{RUN_ID}.params"), state_handler(RUN_ID)]
    assert _handlers_served(f"/ip4/127.0.0.1/tcp/{listen}/p2p/{hidden_id}", handlers) == dict.fromkeys(
        handlers, False
    )
    assert _handlers_served(records[normal_id].addresses[0], handlers) == dict.fromkeys(handlers, True)
    # the client-mode peer still trains and starts exchanges with the dialable one
    hidden.wait_for_line(lambda line: "sync ok with" in line, timeout=90)
    for process in (hidden, normal, boot):
        assert terminate_and_wait(process, timeout=20) == 0, process.output()[-2000:]
