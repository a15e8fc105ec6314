"""Unit tests of swarm.gossip's parts: handshake, framing, bans, partner choice, validation, mixing,
and one exchange over an in-memory stream (no p2p daemon). The lone-peer test starts one daemon."""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from scripts._held import gossip_averager
from swarm.compression import ErrorFeedback, get_codec, schema_of
from swarm.gossip import PROTOCOL_VERSION, PartnerInfo, SyncOutcome
from swarm.gossip import _partners as partners_module
from swarm.gossip._exchange import ExchangeSpec, PartnerRejected, run_exchange
from swarm.gossip._failures import FAILURES_TO_BAN, HOLD_S, MAX_HOLD_S
from swarm.gossip._metrics import MetricsRecorder
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import FORGET_AFTER_S, BanList, eligible_partners, pick_order
from swarm.gossip._protocol import Channel, Hello, MsgKind, ProtocolError, handler_name
from swarm.gossip._reputation import Reputation
from swarm.gossip._robust import ClipStats
from swarm.gossip._validation import NormPolicy, ValidationError, schema_hash, validate_received
from tests._channels import channel_pair
from tests._faults import TamperingChannel, stalling
from tests._mixing import mix
from tests.workers.gossip_pool import p2pd_pids, wait_no_leak


def _hello(**overrides: object) -> Hello:
    fields = dict(
        version=PROTOCOL_VERSION,
        run_id="r",
        config_hash="c",
        schema_hash="s",
        codec="int8",
        block_size=64,
        weight=1.0,
    )
    fields.update(overrides)
    return Hello(**fields)


def test_handler_name_is_namespaced() -> None:
    assert handler_name("demo") == f"swarm.gossip.v{PROTOCOL_VERSION}.demo"


def test_hello_roundtrip_and_mismatch() -> None:
    hello = _hello(weight=2.5)
    assert Hello.from_json(hello.to_json()) == hello
    assert hello.mismatch(_hello(weight=7.0)) is None  # weights may differ
    assert "config_hash" in hello.mismatch(_hello(config_hash="other"))
    assert "schema_hash" in hello.mismatch(_hello(schema_hash="x"))
    assert "version" in hello.mismatch(_hello(version=PROTOCOL_VERSION + 1))


@pytest.mark.parametrize(
    "patch",
    [{"weight": float("nan")}, {"weight": -1.0}, {"weight": 0.0}, {"block_size": "64"}, {"version": True}],
)
def test_hello_rejects_bad_fields(patch: dict) -> None:
    obj = _hello().to_json() | patch
    with pytest.raises(ProtocolError):
        Hello.from_json(obj)
    obj = _hello().to_json()
    del obj["schema_hash"]
    with pytest.raises(ProtocolError, match="schema_hash"):
        Hello.from_json(obj)


def test_channel_framing_counts_bytes_and_enforces_limits() -> None:
    async def scenario() -> None:
        a, b = await channel_pair(max_data=100, chunk_timeout_s=2.0)
        await a.send_json(MsgKind.HELLO, {"x": 1})
        await a.send(MsgKind.DATA, b"z" * 100)
        kind, payload = await b.recv()
        assert kind is MsgKind.HELLO and payload == b'{"x":1}'
        assert (await b.recv_expect(MsgKind.DATA))[1] == b"z" * 100
        assert a.bytes_sent == b.bytes_received == 5 + 7 + 5 + 100
        await a.send(MsgKind.DATA, b"z" * 101)
        with pytest.raises(ProtocolError, match="exceeds"):
            await b.recv()
        a2, b2 = await channel_pair(chunk_timeout_s=2.0)
        await a2.send(MsgKind.ACK)
        with pytest.raises(ProtocolError, match="expected END"):
            await b2.recv_expect(MsgKind.END)
        a2._writer.write(b"\x63\x00\x00\x00\x00")
        with pytest.raises(ProtocolError, match="unknown"):
            await b2.recv()
        with pytest.raises(TimeoutError):
            await b2.recv()  # nothing more arrives: the chunk timeout fires
        for ch in (a, b, a2, b2):
            ch.close()

    asyncio.run(scenario())


def test_ban_list_exponential_backoff_and_forgive() -> None:
    now = [0.0]
    bans = BanList(base_s=10, max_s=35, clock=lambda: now[0])
    assert [bans.ban("p", "x") for _ in range(4)] == [10, 20, 35, 35]
    assert bans.is_banned("p") and not bans.is_banned("q")
    now[0] = 34.9
    assert bans.is_banned("p")
    assert bans.reasons() == {"p": "x"}
    now[0] = 35.1
    assert not bans.is_banned("p") and bans.reasons() == {}
    assert bans.ban("p", "again") == 35  # strikes persist until a success forgives them
    assert bans.reasons() == {"p": "again"}  # the latest ban's
    bans.forgive("p")
    assert not bans.is_banned("p") and bans.ban("p", "fresh") == 10
    with pytest.raises(ValueError):
        BanList(base_s=5, max_s=1)


def test_ban_list_forgets_old_offenders_and_stays_bounded(monkeypatch) -> None:
    now = [0.0]
    bans = BanList(base_s=10, max_s=40, clock=lambda: now[0])
    bans.ban("old", "x")
    now[0] = 10 + FORGET_AFTER_S + 1  # its ban ended long ago: its strikes are forgotten at the next ban
    bans.ban("new", "x")
    assert bans.strikes() == {"new": 1}
    monkeypatch.setattr(partners_module, "MAX_TRACKED", 50)
    for i in range(200):  # throwaway identities, banned one after another
        now[0] += 0.01
        bans.ban(f"sybil-{i}", "x")
        bans.suspect(f"sly-{i}", "clipped", limit=3)
    assert len(bans.strikes()) == 50 and len(bans._suspicions) == 50
    assert bans.is_banned("sybil-199") and not bans.is_banned("sybil-0")  # the earliest-ending went first


def _member(peer: str, expires_at: float | None = 100.0, leaving: bool = False) -> PartnerInfo:
    return PartnerInfo(peer, PROTOCOL_VERSION, "cfg", leaving=leaving, expires_at=expires_at)


def test_failures_are_held_until_the_members_show_whether_the_partner_left() -> None:
    now = [0.0]
    options = GossipOptions(ban_base_s=10, ban_max_s=40)
    reputation = Reputation(options, MetricsRecorder(), clock=lambda: now[0])
    peers = ("gone", "leaving", "staying", "died")
    reputation.review([_member(p) for p in peers])  # all four were members
    for peer in peers:
        reputation.failed(peer, f"connection reset by {peer}")
    assert all(reputation.is_banned(p) for p in peers)  # not dialled meanwhile
    assert reputation.reasons()["staying"] == "connection reset by staying"  # the reason, while held
    reputation.review([_member("leaving"), _member("staying"), _member("died")])  # too early to judge
    now[0] = HOLD_S
    reputation.review([_member("leaving", leaving=True), _member("staying"), _member("died")])
    assert not reputation.is_banned("gone") and not reputation.is_banned("leaving")
    assert reputation.is_banned("staying") and reputation.is_banned("died")  # records not refreshed yet
    now[0] += 1
    reputation.review([_member("staying", expires_at=101.0), _member("died")])  # "staying" announced
    assert not reputation.is_banned("staying")  # alive, but one failure is no ban: released
    assert reputation.is_banned("died") and reputation.bans.banned() == {}
    now[0] = MAX_HOLD_S
    reputation.review([_member("staying", expires_at=101.0), _member("died")])  # never refreshed: it died
    assert not reputation.is_banned("died") and reputation.bans.banned() == {}
    reputation.failed("staying", "connection reset again")  # its second failure since a good exchange
    now[0] += HOLD_S
    reputation.review([_member("staying", expires_at=101.0)])
    reputation.review([_member("staying", expires_at=102.0)])
    assert set(reputation.bans.banned()) == {"staying"} and reputation.bans.strikes() == {"staying": 1}
    assert reputation.reasons() == {"staying": "connection reset again"}


def test_a_committed_exchange_forgives_failures_and_a_peer_without_a_record_gets_no_more() -> None:
    now = [0.0]
    reputation = Reputation(
        GossipOptions(ban_base_s=10, ban_max_s=40), MetricsRecorder(), clock=lambda: now[0]
    )
    reputation.review([_member("member")])
    for _ in range(FAILURES_TO_BAN):
        reputation.failed("member", "timed out")
        reputation.failed("stranger", "timed out")  # it dialled us and never had a record
        now[0] += HOLD_S
        reputation.review([_member("member", expires_at=now[0])])
        reputation.review([_member("member", expires_at=now[0] + 1)])
        reputation.committed("member", None)  # a good exchange between its failures
    assert reputation.bans.banned().keys() == {"stranger"}  # judged at once, banned at its second


def test_only_ordinary_exchanges_wear_a_suspicion_down() -> None:
    """A scaling attacker's update is sometimes cut only softly (early in its round) or not judged (a
    small weight): those exchanges must not wipe its suspicions, or two hard cuts never come in a row.
    An honest peer's rare hard cut is forgotten after a few ordinary exchanges (not after one: that
    would forgive an attacker alternating hard and clean ones, tests/test_hostile_gossip.py)."""
    reputation = Reputation(GossipOptions(clip_strikes=2), MetricsRecorder())
    clean = ClipStats(scale=1.0, excess=0.2, hard=False, own_norm=1.0)
    soft = ClipStats(scale=0.5, excess=4.0, hard=False, own_norm=1.0)
    unjudged = ClipStats(scale=1.0, excess=0.0, hard=False, own_norm=1.0, judged=False)
    hard = ClipStats(scale=0.01, excess=50.0, hard=True, own_norm=1.0)
    reputation.committed("warmup", clean)  # blame starts once our own norm is known
    for between in (soft, unjudged):
        reputation.committed("attacker", hard)
        reputation.committed("attacker", between)
        reputation.committed("attacker", hard)
        assert reputation.is_banned("attacker"), between
        reputation.bans.forgive("attacker")
    reputation.committed("honest", hard)
    for _ in range(7):
        reputation.committed("honest", clean)
    reputation.committed("honest", hard)
    assert not reputation.is_banned("honest")  # the ordinary exchanges in between wore the first down


def test_eligible_partners_filters_and_random_order() -> None:
    bans = BanList(10, 100)
    bans.ban("banned", "test")
    candidates = [
        PartnerInfo("me", PROTOCOL_VERSION, "cfg"),
        PartnerInfo("good1", PROTOCOL_VERSION, "cfg"),
        PartnerInfo("good1", PROTOCOL_VERSION, "cfg"),
        PartnerInfo("good2", PROTOCOL_VERSION, "cfg"),
        PartnerInfo("client", PROTOCOL_VERSION, "cfg", client_mode=True),
        PartnerInfo("old", PROTOCOL_VERSION + 1, "cfg"),
        PartnerInfo("othercfg", PROTOCOL_VERSION, "zzz"),
        PartnerInfo("banned", PROTOCOL_VERSION, "cfg"),
        PartnerInfo("leaving", PROTOCOL_VERSION, "cfg", leaving=True),
        PartnerInfo("joining", PROTOCOL_VERSION, "cfg", joining=True),
    ]
    eligible = eligible_partners(
        candidates, self_id="me", protocol_version=PROTOCOL_VERSION, config_hash="cfg", banned=bans.is_banned
    )
    assert [p.peer_id for p in eligible] == ["good1", "good2"]
    rules = dict(self_id="me", protocol_version=PROTOCOL_VERSION, config_hash="cfg", banned=bans.is_banned)
    # never the last partner again while there is another, but the last one rather than nobody
    assert [p.peer_id for p in eligible_partners(candidates, **rules, last_partner="good1")] == ["good2"]
    assert [p.peer_id for p in eligible_partners(candidates[:2], **rules, last_partner="good1")] == ["good1"]
    import random

    orders = {tuple(p.peer_id for p in pick_order(eligible, random.Random(s), 4)) for s in range(20)}
    assert orders == {("good1", "good2"), ("good2", "good1")}
    assert len(pick_order(eligible, random.Random(0), 1)) == 1


def test_schema_hash_is_order_and_layout_sensitive() -> None:
    a = {"w": torch.zeros(2, 3), "b": torch.zeros(3)}
    b = {"b": torch.zeros(3), "w": torch.zeros(2, 3)}
    assert schema_hash(schema_of(a)) != schema_hash(schema_of(b))
    assert schema_hash(schema_of(a)) == schema_hash(schema_of({"w": torch.ones(2, 3), "b": torch.ones(3)}))
    assert schema_hash(schema_of(a)) != schema_hash(schema_of({"w": torch.zeros(3, 2), "b": torch.zeros(3)}))


def test_validate_received() -> None:
    policy = NormPolicy(max_norm_ratio=100.0, norm_floor=1.0)
    local = {"w": torch.randn(100, 10), "b": torch.zeros(10)}
    validate_received({"w": torch.randn(100, 10), "b": torch.randn(10)}, local, policy)
    cases = {
        "NaN": {"w": torch.full((100, 10), float("nan")), "b": torch.zeros(10)},
        "Inf": {"w": torch.randn(100, 10), "b": torch.full((10,), float("inf"))},
        "shape": {"w": torch.randn(10, 100), "b": torch.zeros(10)},
        "dtype": {"w": torch.randn(100, 10).double(), "b": torch.zeros(10)},
        "names": {"w": torch.randn(100, 10)},
        "norm": {"w": torch.randn(100, 10) * 1000, "b": torch.zeros(10)},
    }
    for why, received in cases.items():
        with pytest.raises(ValidationError) as info:
            validate_received(received, local, policy)
        assert why.lower() in str(info.value).lower() or why in ("Inf", "names"), (why, info.value)
    # the all-zero bias borrows the model's RMS as its floor: a typical-size bias passes, a huge one not
    validate_received({"w": local["w"].clone(), "b": torch.randn(10) * 50}, local, policy)
    with pytest.raises(ValidationError, match="'b' norm"):
        validate_received({"w": local["w"].clone(), "b": torch.randn(10) * 500}, local, policy)


def test_validate_received_all_zero_local_uses_absolute_floor() -> None:
    policy = NormPolicy(max_norm_ratio=100.0, norm_floor=1.0)
    local = {"x": torch.zeros(10_000)}
    validate_received({"x": torch.full((10_000,), 0.5)}, local, policy)  # L2 = 50 <= 100 * 1.0
    with pytest.raises(ValidationError):
        validate_received({"x": torch.full((10_000,), 2.0)}, local, policy)  # L2 = 200


def test_mix_is_weighted_and_conserves_mass() -> None:
    x, y = torch.randn(1000), torch.randn(1000)
    out = mix({"t": x}, {"t": x}, 1.0, {"t": y}, 3.0)
    assert out.weight == 2.0
    torch.testing.assert_close(out.tensors["t"], (x + 3 * y) / 4)
    back = mix({"t": y}, {"t": y}, 3.0, {"t": x}, 1.0)
    mass_before = 1.0 * x.double() + 3.0 * y.double()
    mass_after = out.weight * out.tensors["t"].double() + back.weight * back.tensors["t"].double()
    assert float((mass_after - mass_before).norm() / mass_before.norm()) < 1e-7


def test_mix_conserves_mass_exactly_with_quantized_values() -> None:
    codec = get_codec("int8")
    x, y = torch.randn(4096), torch.randn(4096) * 3
    qx, qy = codec.roundtrip(x), codec.roundtrip(y)  # what each side's frames decode to
    a = mix({"t": x}, {"t": qx}, 1.0, {"t": qy}, 4.0)
    b = mix({"t": y}, {"t": qy}, 4.0, {"t": qx}, 1.0)
    mass_before = 1.0 * x.double() + 4.0 * y.double()
    mass_after = a.weight * a.tensors["t"].double() + b.weight * b.tensors["t"].double()
    assert float((mass_after - mass_before).norm() / mass_before.norm()) < 1e-7
    target = mass_before / 5.0
    assert float((a.tensors["t"].double() - target).norm() / target.norm()) < 0.02  # noise, not bias


CHUNK = 16384


async def _exchange_pair(
    codec: str,
    left: dict,
    right: dict,
    weights: tuple[float, float],
    wrap: Callable[[Channel], Any] | None = None,
) -> tuple[object, object, ErrorFeedback | None]:
    a, b = await channel_pair(chunk_timeout_s=2.0)
    c = get_codec(codec)
    policy = NormPolicy()
    ef = ErrorFeedback(c) if codec != "fp32" else None
    spec = ExchangeSpec(codec=c, chunk_bytes=CHUNK, policy=policy)
    results = await asyncio.gather(
        run_exchange(a if wrap is None else wrap(a), left, weights, spec, ef),
        run_exchange(b, right, weights[::-1], spec, None),
        return_exceptions=True,
    )
    a.close()
    b.close()
    return results[0], results[1], ef


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_exchange_over_memory_stream(codec: str) -> None:
    left = {"w": torch.randn(64, 100), "b": torch.randn(7)}
    right = {"w": torch.randn(64, 100), "b": torch.randn(7)}
    before = {k: v.clone() for k, v in left.items()}
    mixed_a, mixed_b, ef = asyncio.run(_exchange_pair(codec, left, right, (1.0, 3.0)))
    assert mixed_a.weight == mixed_b.weight == 2.0
    tol = 0 if codec == "fp32" else 0.05
    for name in left:
        assert torch.equal(left[name], before[name])  # run_exchange never touches the caller's tensors
        expected = (left[name] + 3 * right[name]) / 4
        assert float((mixed_a.tensors[name] - expected).abs().max()) <= tol + 1e-6
        mass_before = 1.0 * left[name].double() + 3.0 * right[name].double()
        mass_after = 2.0 * (mixed_a.tensors[name].double() + mixed_b.tensors[name].double())
        assert float((mass_after - mass_before).norm() / mass_before.norm()) < 1e-7
    values = dict(mixed_a.tensors)  # computed from ``left`` as it is now: read before committing
    taken = {name: mixed_a.tensors.take(name) for name in left}  # what an offerer reads, folding
    assert all(torch.equal(taken[name], values[name]) for name in left)
    if ef is not None:  # taking each tensor folded what the int8 frames left out into the residual
        sent = ef.codec.decode(ef.codec.encode(before["w"]))
        torch.testing.assert_close(ef.residual("w"), before["w"] - sent)


def test_exchange_rejects_tampered_data_on_both_sides() -> None:
    left = {"w": torch.randn(64, 100)}
    right = {"w": torch.randn(64, 100)}
    tamperers: list[TamperingChannel] = []

    def wrap(channel: Channel) -> TamperingChannel:
        tamper = TamperingChannel(channel, lambda named: [(n, t * 1000) for n, t in named], get_codec("fp32"))
        tamperers.append(tamper)
        return tamper

    res_a, res_b, _ = asyncio.run(_exchange_pair("fp32", left, right, (1.0, 1.0), wrap))
    assert [t.tampered for t in tamperers] == [1]
    assert isinstance(res_b, ValidationError) and "norm" in str(res_b)
    assert isinstance(res_a, PartnerRejected)


def test_averager_parameter_checks() -> None:
    with pytest.raises(ValueError, match="run_id"):
        gossip_averager(run_id="bad id!", partner_source=list, p2p_factory=lambda: None)
    with pytest.raises(ValueError, match="exactly one"):
        gossip_averager(run_id="ok", partner_source=list)


def test_lone_peer_returns_no_partner_immediately() -> None:
    from hivemind.p2p import P2P

    before = p2pd_pids()
    with gossip_averager(
        run_id="lone", partner_source=list, p2p_factory=P2P.create, codec="fp32", busy_patience_s=60.0
    ) as averager:
        me = PartnerInfo(averager.peer_id, PROTOCOL_VERSION, "")
        asked: list[int] = []

        def only_me() -> list[PartnerInfo]:
            asked.append(1)
            return [me]  # only ourselves: still nobody to dial

        dials: list[str] = []
        real_propose = averager._handshake.propose

        async def propose(p2p, peer_id, *args, **kwargs):
            dials.append(peer_id)
            return await real_propose(p2p, peer_id, *args, **kwargs)

        averager.partner_source = only_me
        averager._handshake.propose = propose
        x = torch.randn(1000)
        snapshot = x.clone()
        result = averager.sync([x], weight=2.0)
        # "at once" as work done, not seconds: the partner list was read once, nobody was dialled,
        # no byte moved, and no busy back-off ran (its patience is a minute)
        assert len(asked) == 1 and dials == [], (asked, dials)
        assert (result.bytes_sent, result.bytes_received) == (0, 0)
        assert result.outcome is SyncOutcome.NO_PARTNER and result.partner is None
        assert averager.weight == 2.0 and torch.equal(x, snapshot)
        metrics = averager.metrics()
        assert metrics.no_partner == 1 and metrics.exchanges_failed == metrics.exchanges_busy == 0
        assert not math.isnan(metrics.mean_latency_s)
    assert not wait_no_leak(before, pgids=[], parent=os.getpid())


def test_repeated_syncs_and_serving_in_process() -> None:
    """Two averagers in this process (each with its own daemon): A syncs again and again, B serves."""
    from hivemind.p2p import P2P

    before = p2pd_pids()
    first = gossip_averager(run_id="bg", partner_source=list, p2p_factory=P2P.create, codec="int8")
    try:
        maddrs = first._loop.run(first._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        with gossip_averager(run_id="bg", partner_source=list, p2p_factory=connected, codec="int8") as second:
            x, y = torch.randn(5000), torch.randn(5000)
            target = (x + y) / 2
            second.set_tensors({"v": y})
            first.partner_source = lambda: [PartnerInfo(second.peer_id, PROTOCOL_VERSION, "")]
            results = [first.sync({"v": x})]
            deadline = time.monotonic() + 20
            while first.metrics().exchanges_ok < 3 and time.monotonic() < deadline:
                results.append(first.sync())
            assert first.metrics().exchanges_ok >= 3, results
            # the server counts an exchange when the initiator's final ACK arrives, a moment after
            # the initiator counted it: wait (bounded) for the two counts to meet
            deadline = time.monotonic() + 10
            while (
                second.metrics().exchanges_ok < first.metrics().exchanges_ok and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert second.metrics().exchanges_ok == first.metrics().exchanges_ok
            assert any(r.ok and r.partner == second.peer_id for r in results)
            with first.paused(), second.paused():
                assert float((x - target).norm() / target.norm()) < 0.05
                assert float((y - target).norm() / target.norm()) < 0.05
                assert abs(first.weight - 1.0) < 1e-12 and abs(second.weight - 1.0) < 1e-12
    finally:
        first.close()
        first.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        first.sync([torch.zeros(3)])
    assert not wait_no_leak(before, pgids=[], parent=os.getpid())


def test_abort_cancels_a_stalled_exchange_without_commit_and_refuses_partners() -> None:
    """Shutdown path: abort() ends a sync stuck on a stalled exchange at once, nothing commits on either
    side, and from then on the aborted averager answers BUSY to partners."""
    from hivemind.p2p import P2P

    before = p2pd_pids()
    stalled = threading.Event()
    # timeouts far beyond the test's deadlines: the stalled exchange can only end by the abort
    patient = dict(exchange_timeout_s=3600.0, chunk_timeout_s=3600.0)
    first = gossip_averager(
        run_id="abort",
        partner_source=list,
        p2p_factory=P2P.create,
        codec="fp32",
        chunk_bytes=4096,
        wrap_channel=stalling(1, stalled.set),
        **patient,
    )
    try:
        maddrs = first._loop.run(first._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        with gossip_averager(
            run_id="abort",
            partner_source=list,
            p2p_factory=connected,
            codec="fp32",
            busy_patience_s=0.2,
            **patient,
        ) as second:
            x, y = torch.randn(5000), torch.randn(5000)
            x0, y0 = x.clone(), y.clone()
            second.set_tensors([y])
            first.partner_source = lambda: [PartnerInfo(second.peer_id, PROTOCOL_VERSION, "")]
            results: list = []
            worker = threading.Thread(target=lambda: results.append(first.sync([x])))
            worker.start()
            assert stalled.wait(20), "the exchange never reached the stall"
            first.abort()
            worker.join(60)  # a deadline for a hang: with hour-long timeouts only the abort ends it
            assert not worker.is_alive(), "abort() did not end the stalled sync"
            assert results[0].outcome is SyncOutcome.CANCELLED
            assert first.sync([x]).outcome is SyncOutcome.CANCELLED  # and so is every later one
            with first.paused(), second.paused():
                assert torch.equal(x, x0) and torch.equal(y, y0)
            # ``second`` banned ``first`` for the broken exchange; a fresh partner gets BUSY
            with gossip_averager(
                run_id="abort", partner_source=list, p2p_factory=connected, codec="fp32", busy_patience_s=0.2
            ) as third:
                z = torch.randn(5000)
                z0 = z.clone()
                third.partner_source = lambda: [PartnerInfo(first.peer_id, PROTOCOL_VERSION, "")]
                refused = third.sync([z])
                assert refused.outcome is SyncOutcome.BUSY and torch.equal(z, z0), refused
    finally:
        first.close()
    assert not wait_no_leak(before, pgids=[], parent=os.getpid())


def test_pick_order_prefers_direct_partners_but_keeps_relayed_ones() -> None:
    import random

    from swarm.gossip._partners import DIRECT_PREFERENCE, PartnerInfo

    direct, relayed = PartnerInfo("direct", 1, "c"), PartnerInfo("relayed", 1, "c", relayed=True)
    firsts = [pick_order([relayed, direct], random.Random(seed), 2) for seed in range(2000)]
    assert all({p.peer_id for p in order} == {"direct", "relayed"} for order in firsts)
    share = sum(order[0] is direct for order in firsts) / len(firsts)
    expected = DIRECT_PREFERENCE / (DIRECT_PREFERENCE + 1)  # 0.8: a weighted draw, not 0.5 nor 1
    assert abs(share - expected) < 0.05, share
