"""Offer mode (swarm.gossip._offer) and the trainer's use of it, with real p2p daemons in this process:
both sides of an exchange use it, a dialled peer never stops training, a cancelled exchange applies
nothing, and steps are used once."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from swarm.compression import get_codec
from swarm.gossip import GossipAverager, PartnerInfo, SyncOutcome
from swarm.gossip._protocol import PROTOCOL_VERSION
from swarm.learning import OuterOptimizer
from swarm.trainer._live import LiveModel
from swarm.trainer._offers import AnchorOffers, DeltaOffers
from tests._faults import stalling
from tests.workers.gossip_pool import p2pd_pids, wait_no_leak

BATCH = 4


class _Trainer:
    """A LiveModel with fake inner steps (known moves), offering its pseudo-gradient to an averager."""

    def __init__(self, seed: int, width: int = 64) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(width, width)
        self.start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.live = LiveModel(self.model, OuterOptimizer(self.model, lr=1.0, momentum=0.0), BATCH)
        self.offers = DeltaOffers(self.live)
        self.produced = {n: torch.zeros_like(p) for n, p in self.start.items()}
        self._generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        moves = {n: torch.randn(p.shape, generator=self._generator) * 1e-3 for n, p in self.start.items()}
        with self.live.updating(), torch.no_grad():
            for name, param in self.model.named_parameters():
                param.add_(moves[name])
        self.last = {name: -move for name, move in moves.items()}  # a pseudo-gradient has a gradient's sign
        for name, delta in self.last.items():
            self.produced[name] += delta


@pytest.fixture
def pair() -> Iterator[Callable[..., tuple[GossipAverager, GossipAverager]]]:
    """Two averagers in offer mode on their own daemons, each seeing the other as its only partner."""
    from hivemind.p2p import P2P

    before = p2pd_pids()
    made: list[GossipAverager] = []

    def make(first_offers, second_offers, *, codec="fp32", wrap_channel=lambda channel: channel, **options):
        first = GossipAverager(
            run_id="offer", partner_source=list, p2p_factory=P2P.create, offerer=first_offers,
            codec=codec, chunk_bytes=4096, wrap_channel=wrap_channel, **options,
        )  # fmt: skip
        made.append(first)
        maddrs = first._loop.run(first._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        second = GossipAverager(
            run_id="offer", partner_source=list, p2p_factory=connected, offerer=second_offers,
            codec=codec, chunk_bytes=4096, **options,
        )  # fmt: skip
        made.append(second)
        first._partner_source = lambda: [PartnerInfo(second.peer_id, PROTOCOL_VERSION, "")]
        second._partner_source = lambda: [PartnerInfo(first.peer_id, PROTOCOL_VERSION, "")]
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


def test_both_sides_apply_the_pair_mean_and_every_step_counts_once(pair) -> None:
    a, b = _Trainer(0), _Trainer(1)
    for _ in range(5):
        a.step()
    for _ in range(2):  # the dialled peer took fewer steps: it weighs less, in the same units
        b.step()
    first, _ = pair(a.offers, b.offers)
    result = first.sync()
    assert result.outcome is SyncOutcome.OK, result
    _wait(b.live.has_pending, 10, "the dialled side's commit")  # it lands when our final ACK arrives
    a.step()  # progress after the snapshot must survive the update
    true_distance = _distance(a.live.outer.anchor, b.live.outer.anchor)
    for trainer in (a, b):
        assert trainer.live.delta_snapshot() is None, "offered again before the update was applied"
        [update] = trainer.live.apply_pending()
        assert update.kind == "delta"
        # the anchor probes in the handshake estimate how far apart the two models are
        assert update.info["drift"] == pytest.approx(true_distance, rel=0.3)
    mean = {n: (a.produced[n] + b.produced[n] - a.last[n]) / 2 for n in a.start}
    for name, param in a.model.named_parameters():
        # both anchors moved by the pair's mean pseudo-gradient (lr 1, no momentum, fp32: exact) ...
        assert torch.allclose(a.live.outer.anchor[name], a.start[name] - mean[name], atol=1e-6)
        assert torch.allclose(b.live.outer.anchor[name], b.start[name] - mean[name], atol=1e-6)
        # ... so together they moved by every step taken before the snapshots, once
        moved = (a.start[name] - a.live.outer.anchor[name]) + (b.start[name] - b.live.outer.anchor[name])
        assert torch.allclose(moved, a.produced[name] + b.produced[name] - a.last[name], atol=1e-6)
        # and the step taken after the snapshot is still in the model
        assert torch.allclose(param.detach(), a.live.outer.anchor[name] - a.last[name], atol=1e-6)
    assert a.live.steps == 1 and b.live.steps == 0


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[n] - b[n]).pow(2).sum()) for n in a)
    return (diff / sum(float(t.pow(2).sum()) for t in a.values())) ** 0.5


def test_nothing_to_offer_is_skipped_locally_and_busy_for_a_partner(pair) -> None:
    a, b = _Trainer(0), _Trainer(1)
    first, _ = pair(a.offers, b.offers, busy_patience_s=0.2)
    assert first.sync().outcome is SyncOutcome.SKIPPED  # no step yet: nothing to offer, no dial
    assert first.metrics().bytes_sent == 0
    a.step()
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


def _drifted_pair(gap: float) -> tuple[_Trainer, _Trainer]:
    """Two trainers from one seed whose anchors (and models) are ``gap``-per-value noise apart."""
    a, b = _Trainer(0), _Trainer(0)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in b.model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * gap
            param.add_(noise)
            b.live.outer.anchor[name].add_(noise)
    b._generator.manual_seed(1)  # their inner steps differ
    return a, b


@pytest.mark.parametrize("gap", [0.004, 0.02], ids=["close", "clipped"])
def test_a_folded_exchange_applies_the_pseudo_gradient_and_pulls_the_anchors_in_one_handshake(
    pair, gap: float
) -> None:
    """``averaging.anchor_pull: folded``: one exchange carries the int8 anchor beside the pseudo-gradient.
    Both sides apply the pair's mean pseudo-gradient and pull their anchors together (by at most
    ``param_clip_ratio`` when the anchors are far apart), the pair's anchor sum stays exact, and the
    drift is measured exactly (the clip divided out)."""
    a, b = _drifted_pair(gap)
    for _ in range(3):
        a.step()
    for _ in range(2):
        b.step()
    before = [{n: t.clone() for n, t in trainer.live.outer.anchor.items()} for trainer in (a, b)]
    gap_before = _distance(before[0], before[1])
    first, second = pair(
        DeltaOffers(a.live, with_anchor=True), DeltaOffers(b.live, with_anchor=True),
        robust_clip=True, companion_codec="int8", companion_clip_ratio=0.1,
    )  # fmt: skip
    proposals, served = _count(first._handshake, "propose"), _count(second, "_serve_exchange")
    result = first.sync()
    assert result.outcome is SyncOutcome.OK, result
    # the dialled side counts its commit just after queueing the update: wait for both
    committed = lambda: b.live.has_pending() and second.metrics().exchanges_ok == 1  # noqa: E731
    _wait(committed, 10, "the dialled side's commit")
    assert (proposals(), served()) == (1, 1)  # one handshake carried both parts
    assert first.metrics().exchanges_ok == 1 and second.metrics().exchanges_ok == 1
    # on the wire: the fp32 pseudo-gradient and the int8 anchor, once each, plus frame headers and the
    # HELLO (no probe: the anchor itself measures the drift)
    fp32, int8 = get_codec("fp32"), get_codec("int8")
    payload = sum(fp32.payload_nbytes(t.numel()) + int8.payload_nbytes(t.numel()) for t in before[0].values())
    assert payload < result.bytes_sent < payload + 2048
    clipped = first.metrics().exchanges_clipped
    assert clipped == (gap > 0.01)  # the far pair's anchors were cut to param_clip_ratio, the close not
    mean = {n: (a.produced[n] + b.produced[n]) / 2 for n in a.start}
    a.step()  # progress after the snapshot must survive the update
    for trainer in (a, b):
        [update] = trainer.live._pending
        assert update.kind == "delta"
        # the pair's mean pseudo-gradient (fp32 on the wire: exact), and the anchor's exact distance
        assert all(torch.allclose(update.gradient[n], mean[n], atol=1e-6) for n in mean)
        assert update.info["drift"] == pytest.approx(gap_before, rel=0.05)
        trainer.live.apply_pending()
    after = [trainer.live.outer.anchor for trainer in (a, b)]
    for name in before[0]:
        # both applied the mean pseudo-gradient (lr 1), and the pull moved no mass: the pair's sum is
        # what it was less both pseudo-gradients, to float precision despite the int8 anchors
        expected = before[0][name] + before[1][name] - 2 * mean[name]
        assert torch.allclose(after[0][name] + after[1][name], expected, atol=1e-5)
    gap_after = _distance(after[0], after[1])
    if clipped:  # each moved tau / 2 toward the other, tau = 0.1 x the smaller anchor norm
        tau = 0.1 * min(_norm(before[0]), _norm(before[1]))
        assert gap_after == pytest.approx(gap_before - tau / _norm(before[0]), rel=0.05)
    else:
        assert gap_after < 0.1 * gap_before
    for name, param in a.model.named_parameters():
        assert torch.allclose(param.detach(), a.live.outer.anchor[name] - a.last[name], atol=1e-6)
    assert a.live.steps == 1 and b.live.steps == 0


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return sum(float(t.pow(2).sum()) for t in tensors.values()) ** 0.5


def _count(owner: object, method: str) -> Callable[[], int]:
    """Count the calls of ``owner.method`` (a coroutine method) from now on."""
    calls, original = [0], getattr(owner, method)

    async def counted(*args, **kwargs):
        calls[0] += 1
        return await original(*args, **kwargs)

    setattr(owner, method, counted)
    return lambda: calls[0]


def test_an_offer_must_carry_a_companion_part_exactly_when_the_averager_has_a_companion_codec(pair) -> None:
    a, b = _Trainer(0), _Trainer(1)
    a.step()
    b.step()
    with pytest.raises(ValueError, match="offer mode"):  # a companion part only exists in offer mode
        GossipAverager(run_id="offer", partner_source=list, companion_codec="int8")
    first, _ = pair(DeltaOffers(a.live), DeltaOffers(b.live), companion_codec="int8")
    with pytest.raises(ValueError, match="companion part"):
        first.sync()
    assert first.metrics().bytes_sent == 0 and not b.live.has_pending()  # refused before any dial


def test_a_non_finite_anchor_is_never_offered_with_the_pseudo_gradient() -> None:
    a = _Trainer(0)
    a.step()
    folded = DeltaOffers(a.live, with_anchor=True)
    assert folded.offer() is not None
    with torch.no_grad():
        a.live.outer.anchor["weight"][0, 0] = float("inf")
    assert folded.offer() is None
    assert a.live.delta_snapshot() is None  # the pseudo-gradient (anchor - params) is not finite either
