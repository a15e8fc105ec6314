"""Shared bases (swarm.gossip._bases): a base pushed early lets the round's exchange send only what the
round changed, with real p2p daemons in this process. The exchange through a base still gives the
pair's mean and keeps the pair's sum; without a common base it sends whole tensors; a base far from a
model commits nothing and blames nobody; a broken HELLO is refused."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from scripts._held import gossip_averager
from swarm.compression import get_codec
from swarm.gossip import GossipAverager, Offer, PartnerInfo, SyncOutcome
from swarm.gossip._bases import MAX_BASES, BaseStore
from swarm.gossip._protocol import PROTOCOL_VERSION, Hello, ProtocolError
from tests.workers.gossip_pool import p2pd_pids, wait_no_leak

SIZE = 4096


class _Fixed:
    """Offers the same tensors every time and keeps what each committed exchange mixed."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.mixes: list[dict[str, torch.Tensor]] = []

    def offer(self) -> Offer:
        return Offer(tensors=self.tensors, weight=1.0)

    def settled(self, offer, exchange) -> None:
        if exchange is not None:
            self.mixes.append({name: t.clone() for name, t in exchange.mixed.items()})


def _model(seed: int, anchor: dict[str, torch.Tensor], step: float = 1e-2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: a + step * torch.randn(a.shape, generator=generator) for n, a in anchor.items()}


@pytest.fixture
def anchor() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {"w": torch.randn(SIZE, generator=generator), "b": torch.randn(64, generator=generator)}


@pytest.fixture
def pair() -> Iterator[Callable[..., tuple[GossipAverager, GossipAverager]]]:
    """Two averagers on their own daemons, each the other's only partner."""
    from hivemind.p2p import P2P

    before = p2pd_pids()
    made: list[GossipAverager] = []

    def make(first_offers, second_offers, **options):
        settings = {"codec": "int8", "delta_codec": "int4", "chunk_bytes": 4096, **options}
        first = gossip_averager(
            run_id="bases", partner_source=list, p2p_factory=P2P.create, offerer=first_offers, **settings
        )
        made.append(first)
        maddrs = first._loop.run(first._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        second = gossip_averager(
            run_id="bases", partner_source=list, p2p_factory=connected, offerer=second_offers, **settings
        )
        made.append(second)
        first.partner_source = lambda: [PartnerInfo(second.peer_id, PROTOCOL_VERSION, "")]
        second.partner_source = lambda: [PartnerInfo(first.peer_id, PROTOCOL_VERSION, "")]
        for averager, offers in ((first, first_offers), (second, second_offers)):
            averager.expect_schema({n: (tuple(t.shape), t.dtype) for n, t in offers.tensors.items()})
        return first, second

    yield make
    for averager in made:
        averager.close()
    assert not wait_no_leak(before, pgids=[], parent=os.getpid())


def _wait_mix(offers: _Fixed, count: int) -> None:
    import time

    deadline = time.monotonic() + 15
    while len(offers.mixes) < count:
        assert time.monotonic() < deadline, "the dialled side never committed"
        time.sleep(0.02)


def test_an_exchange_through_a_pushed_base_gives_the_pair_mean_with_half_the_bytes(pair, anchor) -> None:
    a, b = _Fixed(_model(1, anchor)), _Fixed(_model(2, anchor))
    first, second = pair(a, b)
    whole = first.sync()  # no base yet: whole tensors, int8
    assert whole.outcome is SyncOutcome.OK, whole
    _wait_mix(b, 1)
    assert first.push_base(second.peer_id, anchor)
    assert second._bases.get(first.peer_id).base_id == first._bases.get(second.peer_id).base_id
    through = first.sync()
    assert through.outcome is SyncOutcome.OK, through
    _wait_mix(b, 2)
    assert first.metrics().exchanges_relative == second.metrics().exchanges_relative == 1
    assert first.metrics().bases_pushed == 1
    n_params = sum(t.numel() for t in anchor.values())
    assert 1.0 * n_params < first.metrics().base_bytes_sent < 1.2 * n_params  # the anchor, int8
    assert second.metrics().base_bytes_sent == 0
    # int4 relative to the base against int8 whole: about half the bytes each way
    assert through.bytes_sent < 0.6 * whole.bytes_sent and through.bytes_received < 0.6 * whole.bytes_received
    mean = {n: (a.tensors[n] + b.tensors[n]) / 2 for n in anchor}
    gap = max(float((a.tensors[n] - b.tensors[n]).abs().max()) for n in anchor)
    for mixes in (a.mixes, b.mixes):
        for name in anchor:
            # the pair's mean, up to int4 on a difference of about the gap: far closer than the base is
            error = float((mixes[1][name] - mean[name]).abs().max())
            assert error < gap / 4, (name, error, gap)
            # and the two sides' results add up to the pair's sum (each subtracts what the other added)
            total = a.mixes[1][name] + b.mixes[1][name]
            assert torch.allclose(total, a.tensors[name] + b.tensors[name], atol=1e-5)


def test_an_exchange_through_a_base_rounds_only_the_change(pair, anchor) -> None:
    """Sent relative to a base in int4, a model arrives closer to exact than whole in int8 would: what
    the codec rounds is the round's change, not the whole value."""
    a, b = _Fixed(_model(3, anchor)), _Fixed(_model(4, anchor))
    first, second = pair(a, b)
    assert second.push_base(first.peer_id, anchor)  # either side may push
    assert first.sync().outcome is SyncOutcome.OK
    _wait_mix(b, 1)
    int8 = get_codec("int8", block_size=64)
    for name in anchor:
        mean = (a.tensors[name] + b.tensors[name]) / 2
        # each side's result is off by half of each model's rounding: the whole-int8 rounding's half
        whole = float((int8.decode(int8.encode(a.tensors[name])) - a.tensors[name]).norm())
        relative = float((a.mixes[0][name] - mean).norm())
        assert relative < whole / 4, (name, relative, whole)


def test_without_a_common_base_the_exchange_sends_whole_tensors(pair, anchor) -> None:
    a, b = _Fixed(_model(5, anchor)), _Fixed(_model(6, anchor))
    first, second = pair(a, b)
    assert first.push_base(second.peer_id, anchor)
    second._bases.drop(first.peer_id)  # the partner lost it (evicted, restarted)
    result = first.sync()
    assert result.outcome is SyncOutcome.OK, result
    _wait_mix(b, 1)
    assert first.metrics().exchanges_relative == second.metrics().exchanges_relative == 0
    for name in anchor:
        total = a.mixes[0][name] + b.mixes[0][name]
        assert torch.allclose(total, a.tensors[name] + b.tensors[name], atol=1e-5)


def test_a_base_far_from_the_models_commits_nothing_and_blames_nobody(pair, anchor) -> None:
    a, b = _Fixed(_model(7, anchor)), _Fixed(_model(8, anchor))
    first, second = pair(a, b)
    far = {n: t * 1e4 for n, t in anchor.items()}  # finite, so it is taken; useless as a base
    assert second.push_base(first.peer_id, far)
    result = first.sync()
    assert result.outcome is SyncOutcome.FAILED and "far from our model" in result.reason, result
    assert not a.mixes and not b.mixes
    assert not first.banned_peers() and not second.banned_peers()
    assert first._bases.get(second.peer_id) is None  # dropped: the next exchange sends whole tensors
    again = first.sync()
    assert again.outcome is SyncOutcome.OK, again
    assert first.metrics().exchanges_relative == 0


def test_a_base_store_keeps_one_base_per_partner_and_at_most_a_few() -> None:
    store = BaseStore()
    bases = [object() for _ in range(MAX_BASES + 2)]
    for i, base in enumerate(bases):
        store.put(f"peer{i}", base)  # type: ignore[arg-type]
    kept = [store.get(f"peer{i}") for i in range(len(bases))]
    assert kept[: len(bases) - MAX_BASES] == [None] * 2 and kept[-MAX_BASES:] == bases[-MAX_BASES:]
    store.put("peer9", bases[0])  # type: ignore[arg-type]
    store.put("peer9", bases[1])  # type: ignore[arg-type]
    assert store.get("peer9") is bases[1]


@pytest.mark.parametrize(
    ("field", "value"),
    [("base", "not-hex"), ("base", "ABCDEF0123456789"), ("base", 5), ("push", "yes"), ("push", 1)],
)
def test_a_hello_with_a_malformed_base_or_push_is_refused(field, value) -> None:
    body = Hello(PROTOCOL_VERSION, "r", "c", "s", "int8", 64, 1.0).to_json()
    body[field] = value
    with pytest.raises(ProtocolError, match=field):
        Hello.from_json(body)


def test_an_exchange_waits_for_the_partner_s_base_still_crossing(pair, anchor) -> None:
    """Proposing while the partner's base push to us is in flight would send whole models: the
    proposal waits for the push (up to base_wait_s), then goes relative to the base it brought."""
    import asyncio
    import threading

    a, b = _Fixed(_model(9, anchor)), _Fixed(_model(10, anchor))
    first, second = pair(a, b)
    assert second.push_base(first.peer_id, anchor)
    base = first._bases.get(second.peer_id)
    first._bases.drop(second.peer_id)  # as if its frames were still crossing ...
    crossing = asyncio.Event()
    first._incoming_bases[second.peer_id] = crossing  # ... in a push the handler has not finished
    first.base_wait_s = 30.0
    results = []
    syncing = threading.Thread(target=lambda: results.append(first.sync()))
    syncing.start()
    syncing.join(timeout=1.0)
    assert syncing.is_alive() and not b.mixes, "proposed before the base it was waiting for landed"

    def landed() -> None:
        first._bases.put(second.peer_id, base)
        crossing.set()

    first._loop.loop.call_soon_threadsafe(landed)
    syncing.join(timeout=30)
    assert results and results[0].outcome is SyncOutcome.OK, results
    assert first.metrics().exchanges_relative == 1
