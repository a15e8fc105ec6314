"""Offerers (swarm.gossip._offer) and the trainer's use of it, with real p2p daemons in this process:
both sides of an exchange use it, a dialled peer never stops training, a cancelled exchange applies
nothing, and steps are used once."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from scripts._held import gossip_averager
from swarm.gossip import GossipAverager, PartnerInfo, SyncOutcome
from swarm.gossip._protocol import PROTOCOL_VERSION
from swarm.learning import OuterOptimizer
from swarm.trainer._live import LiveModel
from swarm.trainer._offers import AnchorOffers, ModelOffers
from tests._faults import stalling
from tests.workers.gossip_pool import p2pd_pids, wait_no_leak

BATCH = 4


class _Trainer:
    """A LiveModel with fake inner steps (known moves), offering its model to an averager."""

    def __init__(self, seed: int, width: int = 64) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(width, width)
        self.start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.live = LiveModel(self.model, OuterOptimizer(self.model, lr=1.0, momentum=0.0), BATCH)
        self.offers = ModelOffers(self.live)
        self._generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        moves = {n: torch.randn(p.shape, generator=self._generator) * 1e-3 for n, p in self.start.items()}
        with self.live.updating(), torch.no_grad():
            for name, param in self.model.named_parameters():
                param.add_(moves[name])
        self.last = moves


@pytest.fixture
def pair() -> Iterator[Callable[..., tuple[GossipAverager, GossipAverager]]]:
    """Two averagers on their own daemons, each seeing the other as its only partner."""
    from hivemind.p2p import P2P

    before = p2pd_pids()
    made: list[GossipAverager] = []

    def make(first_offers, second_offers, *, codec="fp32", wrap_channel=lambda channel: channel, **options):
        first = gossip_averager(
            run_id="offer", partner_source=list, p2p_factory=P2P.create, offerer=first_offers,
            codec=codec, chunk_bytes=4096, wrap_channel=wrap_channel, **options,
        )  # fmt: skip
        made.append(first)
        maddrs = first._loop.run(first._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        second = gossip_averager(
            run_id="offer", partner_source=list, p2p_factory=connected, offerer=second_offers,
            codec=codec, chunk_bytes=4096, **options,
        )  # fmt: skip
        made.append(second)
        first.partner_source = lambda: [PartnerInfo(second.peer_id, PROTOCOL_VERSION, "")]
        second.partner_source = lambda: [PartnerInfo(first.peer_id, PROTOCOL_VERSION, "")]
        return first, second

    yield make
    for averager in made:
        averager.close()
    assert not wait_no_leak(before, pgids=[], parent=os.getpid())


def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_both_sides_apply_the_pair_mean_and_keep_the_steps_taken_since(pair) -> None:
    a, b = _Trainer(0), _Trainer(1)
    for _ in range(5):
        a.step()
    for _ in range(2):
        b.step()
    offered = [{n: p.detach().clone() for n, p in t.model.named_parameters()} for t in (a, b)]
    first, _ = pair(a.offers, b.offers)
    result = first.sync()
    assert result.outcome is SyncOutcome.OK, result
    _wait(b.live.has_pending, 10, "the dialled side's commit")  # it lands when our final ACK arrives
    a.step()  # progress after the snapshot must survive the update
    true_distance = _distance(offered[0], offered[1])
    for trainer in (a, b):
        assert trainer.live.model_snapshot() is None, "offered again before the update was applied"
        [update] = trainer.live.apply_pending()
        assert update.kind == "model"
        assert update.info["drift"] == pytest.approx(true_distance, rel=0.01)  # measured by the mix
    for name, param in a.model.named_parameters():
        # both anchors are the pair's mean model (lr 1, no momentum, fp32; offers in bf16 progress) ...
        mean = (offered[0][name] + offered[1][name]) / 2
        assert torch.allclose(a.live.outer.anchor[name], mean, atol=1e-4)
        assert torch.allclose(b.live.outer.anchor[name], mean, atol=1e-4)
        # ... and the step taken after the snapshot is still in the model
        assert torch.allclose(param.detach(), a.live.outer.anchor[name] + a.last[name], atol=1e-4)
    assert a.live.steps == 1 and b.live.steps == 0


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[n] - b[n]).pow(2).sum()) for n in a)
    return (diff / sum(float(t.pow(2).sum()) for t in a.values())) ** 0.5


def test_nothing_to_offer_is_skipped_locally_and_busy_for_a_partner(pair) -> None:
    """A peer that holds no swarm state yet (a joiner whose adoption failed) offers nothing."""
    a, b = _Trainer(0), _Trainer(1)
    first, _ = pair(a.offers, b.offers, busy_patience_s=0.2)
    a.offers.accepting = b.offers.accepting = False
    assert first.sync().outcome is SyncOutcome.SKIPPED  # nothing to offer: no dial
    assert first.metrics().bytes_sent == 0
    a.offers.accepting = True
    refused = first.sync()  # the partner has nothing to offer either: BUSY, nothing committed
    assert refused.outcome is SyncOutcome.BUSY, refused
    assert not a.live.has_pending() and not b.live.has_pending()


def test_a_dialled_peer_trains_through_a_stalled_exchange_and_a_cancelled_one_applies_nothing(pair) -> None:
    a, b = _Trainer(0), _Trainer(1)
    a.step()
    b.step()
    stalled = threading.Event()
    first, second = pair(a.offers, b.offers, wrap_channel=stalling(1, stalled.set))
    results: list = []
    initiator = threading.Thread(target=lambda: results.append(first.sync()))
    initiator.start()
    stop = threading.Event()

    def train() -> None:
        while not stop.is_set():
            b.step()

    trainer = threading.Thread(target=train)
    try:
        assert stalled.wait(20), "the exchange never reached the stall"
        trainer.start()
        at_stall = b.live.steps
        # the exchange B serves is stuck mid-data; B's training must go on regardless
        _wait(lambda: b.live.steps >= at_stall + 50, 20, "the dialled peer's steps during the stall")
        assert initiator.is_alive() and not results, "the exchange ended before the check"
    finally:
        stop.set()
        first.abort()
        initiator.join(10)
        if trainer.is_alive():
            trainer.join(10)
    assert results and results[0].outcome is SyncOutcome.CANCELLED
    second.abort()  # the served side gives up too: neither side applies anything
    anchors = {n: t.clone() for n, t in b.live.outer.anchor.items()}
    assert a.live.apply_pending() == [] and b.live.apply_pending() == []
    assert all(torch.equal(b.live.outer.anchor[n], anchors[n]) for n in anchors)
    assert all(torch.equal(a.live.outer.anchor[n], a.start[n]) for n in a.start)


def test_an_int8_anchor_exchange_pulls_both_anchors_together_and_keeps_their_sum(pair) -> None:
    """``averaging.param_codec: int8``: anchors travel quantized, yet the pair's sum stays exact (the
    mass-conserving mix) and each side ends within the codec's error of the pair's mean."""
    a, b = _Trainer(0), _Trainer(0)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():  # b drifted from a by about 15% of the weights, anchor and model alike
        for name, param in b.model.named_parameters():
            gap = torch.randn(param.shape, generator=generator) * 0.01
            param.add_(gap)
            b.live.outer.anchor[name].add_(gap)
    for trainer in (a, b):
        trainer.step()  # local progress that the pull must leave in the model
    before = [{n: t.clone() for n, t in trainer.live.outer.anchor.items()} for trainer in (a, b)]
    progress = [
        {n: p.detach() - trainer.live.outer.anchor[n] for n, p in trainer.model.named_parameters()}
        for trainer in (a, b)
    ]
    first, _ = pair(AnchorOffers(a.live), AnchorOffers(b.live), codec="int8", robust_clip=False)
    result = first.sync()
    assert result.outcome is SyncOutcome.OK, result
    assert result.bytes_sent < 1.2 * sum(t.numel() for t in before[0].values())  # about a byte a value
    _wait(b.live.has_pending, 10, "the dialled side's commit")
    for trainer in (a, b):
        [update] = trainer.live.apply_pending()
        assert update.kind == "anchor"
    after = [trainer.live.outer.anchor for trainer in (a, b)]
    gap_before = _distance(before[0], before[1])
    assert _distance(after[0], after[1]) < 0.1 * gap_before  # pulled together, not left apart
    for name in before[0]:
        # the pair's sum is what it was: the quantization error moved between the two, nothing was lost
        assert torch.allclose(after[0][name] + after[1][name], before[0][name] + before[1][name], atol=1e-5)
    for trainer, steps in zip((a, b), progress, strict=True):
        for name, param in trainer.model.named_parameters():
            assert torch.allclose(param.detach() - trainer.live.outer.anchor[name], steps[name], atol=1e-6)
