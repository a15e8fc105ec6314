"""Finding 11 of issue 28: reachability dial-backs go only to the ip the asker connects from, and fresh
peer ids buy no more checks (per-source-ip and global budgets next to the per-asker cooldown)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from swarm.network._reachability import (
    CheckLimits,
    ReachabilityChecker,
    RequestRefused,
    dialable_from,
    handler_name,
    source_ip,
)
from swarm.network._reachability_ask import ask, check_reachability
from tests.test_reachability import RUN, pair  # noqa: F401  (the two-daemon fixture)


def test_only_the_connecting_ip_is_dialled() -> None:
    assert dialable_from("/ip4/203.0.113.7/tcp/4001", "203.0.113.7") == ("203.0.113.7", 4001)
    for hidden in ("/ip4/127.0.0.1/tcp/22", "/ip4/192.168.1.1/tcp/80", "/ip4/10.0.0.5/tcp/6379"):
        assert dialable_from(hidden, "203.0.113.7") is None
    assert dialable_from("/ip4/198.51.100.1/tcp/80", "203.0.113.7") is None  # someone else's host
    assert dialable_from("/ip4/127.0.0.1/tcp/4001", "127.0.0.1") == ("127.0.0.1", 4001)  # local swarms
    assert dialable_from("/ip4/127.0.0.1/tcp/4001", None) is None


def test_source_ip_is_the_direct_remote_address() -> None:
    assert source_ip("/ip4/203.0.113.7/tcp/51234") == "203.0.113.7"
    assert source_ip("/ip6/::ffff:203.0.113.7/tcp/51234") == "203.0.113.7"
    assert source_ip("/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit") is None
    assert source_ip(None) is None and source_ip("garbage") is None


def test_fresh_peer_ids_do_not_buy_more_checks() -> None:
    limits = CheckLimits(cooldown_s=30, window_s=60, per_source=3, total=5)
    for n in range(3):
        limits.admit(f"sybil{n}", "203.0.113.7", now=0.0)
    with pytest.raises(RequestRefused, match=r"from 203\.0\.113\.7"):
        limits.admit("sybil-fresh", "203.0.113.7", now=1.0)
    limits.admit("other", "198.51.100.1", now=1.0)
    with pytest.raises(RequestRefused, match="asked too often"):
        limits.admit("other", "198.51.100.1", now=2.0)  # the per-asker cooldown still holds
    limits.admit("third", "192.0.2.1", now=2.0)
    with pytest.raises(RequestRefused, match="busy"):
        limits.admit("fourth", "192.0.2.2", now=3.0)  # the global budget
    limits.admit("sybil-fresh", "203.0.113.7", now=61.0)  # budgets refill after the window


@pytest.fixture
def second_loopback_listener() -> Iterator[int]:
    """A port that accepts connections on 127.0.0.2, a loopback ip the asker does not connect from."""
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.2", 0))
        except OSError:
            pytest.skip("127.0.0.2 is not a loopback address here")
        sock.listen(8)
        yield sock.getsockname()[1]


def test_checker_does_not_dial_a_port_on_another_ip_than_the_askers(pair, second_loopback_listener) -> None:  # noqa: F811
    run, checker_p2p, asker_p2p = pair
    asker = asker_p2p.peer_id.to_base58()
    hidden = f"/ip4/127.0.0.2/tcp/{second_loopback_listener}"

    async def checker_factory():
        return checker_p2p

    checker = ReachabilityChecker(
        {asker: [hidden]}.get, run_id=RUN, p2p_factory=checker_factory, cooldown_s=0
    )
    try:
        checker_id = checker_p2p.peer_id.to_base58()
        result = check_reachability(asker_p2p, RUN, [checker_id], [hidden])
        assert result.answered_by == (checker_id,) and result.reachable == ()
        reply = run(ask(asker_p2p, handler_name(RUN), checker_id, [hidden]))
        assert reply["not_dialled"] == [hidden] and reply["reachable"] == []
    finally:
        checker.close()
