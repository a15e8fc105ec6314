"""The gossip rule keeps one model: model exchanges on the hypercube schedule shrink the peers'
spread geometrically (docs/gossip.md, "The rule"), where pairs whose exchanges move nothing leave it
where it was.

In process and without a network: each peer is a real :class:`LiveModel` with the trainer's offerer
(:class:`ModelOffers`), and an exchange runs the averager's own codec, error feedback and
mass-conserving mix on the two offers, then hands each side the :class:`~swarm.gossip.Committed` the
averager would.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping

import pytest
import torch

from swarm.compression import ErrorFeedback, get_codec
from swarm.gossip import Committed, SyncOutcome, SyncResult, consensus_order, hypercube_partner
from swarm.gossip._protocol import Hello
from swarm.learning import OuterOptimizer
from swarm.trainer._gossip import GossipBackend
from swarm.trainer._live import LiveModel
from swarm.trainer._offers import ModelOffers, partner_round
from tests._mixing import computed, mix

BATCH = 2


class _Inert(ModelOffers):
    """A broken rule for contrast: it exchanges, counts its rounds, and applies nothing."""

    def _committed(self, offer: object, exchange: Committed) -> None:
        self.round += 1


class Peer:
    """One trainer's live model, its offerer and the averager's error-feedback state."""

    def __init__(self, seed: int, rule: str, codec: str = "fp32") -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(16, 8)
        self.name = f"peer-{seed}"
        self.live = LiveModel(self.model, OuterOptimizer(self.model, lr=1.0, momentum=0.0), BATCH)
        self.offers = ModelOffers(self.live) if rule == "model" else _Inert(self.live)
        self.codec = get_codec(codec)
        self.feedback = ErrorFeedback(self.codec) if not self.codec.lossless else None
        self.exchanges = 0

    def idle_step(self) -> None:
        """An inner step with training off: the step counter runs, the parameters stay."""
        with self.live.updating():
            pass

    def sent(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What our frames decode to at the partner (with error feedback, committed at once): values,
        as frames carry them, never the offer's lazily computed tensors."""
        if self.feedback is None:
            return {n: t.clone() for n, t in tensors.items()}
        return {n: self.codec.decode(self.feedback.encode(n, t)).to(t.dtype) for n, t in tensors.items()}


def exchange(a: Peer, b: Peer) -> bool:
    """One committed exchange between ``a`` (initiator) and ``b``, as the averager runs it; False if
    either had nothing to offer (the averager's SKIPPED / BUSY)."""
    offers = [a.offers.offer(), b.offers.offer()]
    if offers[0] is None or offers[1] is None:
        return False
    sent = [a.sent(offers[0].tensors), b.sent(offers[1].tensors)]
    for side, (peer, mine, theirs) in enumerate(((a, 0, 1), (b, 1, 0))):
        mixed = mix(
            offers[mine].tensors, sent[mine], offers[mine].weight, sent[theirs], offers[theirs].weight
        )
        result = SyncResult(SyncOutcome.OK, [b, a][side].name, 0, 0, 0.0, mixed.weight)
        committed = Committed(mixed.tensors, offers[theirs].weight, side == 0, result, offers[theirs].probe)
        peer.offers.settled(offers[mine], committed)
        peer.exchanges += 1
    return True


def schedule_round(peers: list[Peer], rng: random.Random) -> None:
    """Every live peer's round: the scheduled pairs meet (over the shared hash order; a peer's round
    is its offerer's count), then the peers left over meet a random free partner, as the averager
    falls back when the scheduled one is missing or busy. Then every peer applies what landed."""
    order = consensus_order([p.name for p in peers], salt="run")
    by_name = {p.name: p for p in peers}
    free = set(by_name)
    for name in order:
        peer = by_name[name]
        if name not in free:
            continue
        scheduled = hypercube_partner(order, name, getattr(peer.offers, "round", 0))
        if scheduled in free and scheduled != name:
            exchange(peer, by_name[scheduled])
            free -= {name, scheduled}
    rest = sorted(free)
    rng.shuffle(rest)
    for first, second in zip(rest[0::2], rest[1::2], strict=False):
        exchange(by_name[first], by_name[second])
    for peer in peers:
        peer.live.apply_pending()
        peer.idle_step()


def spread(peers: list[Peer]) -> float:
    """RMS distance of the peers' anchors to their mean, relative to the mean's norm."""
    names = list(peers[0].live.outer.anchor)
    mean = {n: sum(p.live.outer.anchor[n] for p in peers) / len(peers) for n in names}
    num = sum(float((p.live.outer.anchor[n] - mean[n]).pow(2).sum()) for p in peers for n in names)
    den = sum(float(mean[n].pow(2).sum()) for n in names)
    return math.sqrt(num / len(peers) / den)


def spreads(peers: list[Peer], rounds: int, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    for peer in peers:
        peer.idle_step()
    history = [spread(peers)]
    for _ in range(rounds):
        schedule_round(peers, rng)
        history.append(spread(peers))
    return history


def shrinks_geometrically(history: list[float], per_round: float, floor: float = 1e-6) -> bool:
    """Each round ends at most ``per_round`` times the spread it started from (or below ``floor``)."""
    return all(after <= max(per_round * before, floor) for before, after in itertools.pairwise(history))


@pytest.mark.parametrize("count", [4, 8])
def test_model_exchanges_shrink_the_spread_geometrically(count: int) -> None:
    peers = [Peer(seed, "model") for seed in range(count)]
    history = spreads(peers, rounds=3 * int(math.log2(count)))
    assert history[0] > 0.5  # independently initialised models: far apart
    assert shrinks_geometrically(history, per_round=0.75)
    # dimension exchange averages N = 2^d models exactly in d rounds
    assert history[int(math.log2(count))] < 1e-5
    assert all(peer.exchanges == len(history) - 1 for peer in peers)  # one exchange a round each


@pytest.mark.parametrize("count", [4, 8])
def test_pairs_whose_exchanges_move_nothing_fail_the_same_test(count: int) -> None:
    peers = [Peer(seed, "inert") for seed in range(count)]
    history = spreads(peers, rounds=3 * int(math.log2(count)))
    assert all(peer.exchanges == len(history) - 1 for peer in peers)  # they did exchange, every round
    assert not shrinks_geometrically(history, per_round=0.75)
    assert history[-1] == pytest.approx(history[0], rel=1e-5)  # the anchors' gaps stay what they were


def test_a_peer_leaving_mid_schedule_does_not_stall_it() -> None:
    peers = [Peer(seed, "model") for seed in range(8)]
    rng = random.Random(1)
    for peer in peers:
        peer.idle_step()
    schedule_round(peers, rng)
    del peers[3]  # gone: 7 left, not a power of two, and the schedule's positions all shift
    before = spread(peers)
    history = [before]
    for _ in range(12):
        counts = [peer.exchanges for peer in peers]
        schedule_round(peers, rng)
        history.append(spread(peers))
        stalled = [p for p, c in zip(peers, counts, strict=True) if p.exchanges == c]
        assert len(stalled) <= 1  # with 7 peers one sits out a round at most
    assert history[-1] < 1e-3 * before
    assert history[-1] < history[len(history) // 2] < before  # it keeps shrinking


def test_int8_with_error_feedback_keeps_the_pair_mean_within_the_codec_error() -> None:
    a, b = Peer(0, "model", codec="int8"), Peer(1, "model", codec="int8")
    for round_ in range(6):
        for peer, seed in ((a, round_), (b, 100 + round_)):  # a real step of each, so the models move
            moves = {
                n: torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)) * 0.01
                for n, p in peer.model.named_parameters()
            }
            with peer.live.updating(), torch.no_grad():
                for n, p in peer.model.named_parameters():
                    p.add_(moves[n])
        before = [{n: p.detach().clone() for n, p in peer.model.named_parameters()} for peer in (a, b)]
        assert exchange(a, b)
        a.live.apply_pending()
        b.live.apply_pending()
        params = [dict(peer.model.named_parameters()) for peer in (a, b)]
        for name in before[0]:
            exact = (before[0][name] + before[1][name]) / 2
            ours = a.live.outer.anchor[name]
            # the mix subtracts each side's own quantized value, and what the offer left out (its
            # progress is kept in bfloat16) stays in each side's parameters: the pair's sum is exact ...
            assert torch.allclose(params[0][name] + params[1][name], 2 * exact, atol=1e-6)
            # ... and each side is off by at most one int8 step of the larger model (error feedback
            # carries at most half a step over), where fp32 would be exact
            step = max(float(t.abs().max()) for t in (before[0][name], before[1][name])) / 127
            assert float((ours - exact).abs().max()) <= step
        assert a.live.outer.anchor["weight"].ne(b.live.outer.anchor["weight"]).any()  # lossy indeed


def test_a_late_exchange_applies_once_and_keeps_local_progress() -> None:
    a, b = Peer(0, "model"), Peer(1, "model")
    a.idle_step()
    offers = [a.offers.offer(), b.offers.offer()]
    models = [dict(offer.tensors) for offer in offers]
    later = {n: torch.full_like(p, 0.25) for n, p in a.model.named_parameters()}
    with a.live.updating(), torch.no_grad():  # a trains on while the exchange runs
        for n, p in a.model.named_parameters():
            p.add_(later[n])
    mean = {n: (models[0][n] + models[1][n]) / 2 for n in models[0]}
    result = SyncResult(SyncOutcome.OK, b.name, 0, 0, 0.0, 1.0)
    committed = Committed(computed(mean, mean), 1.0, True, result, offers[1].probe)
    a.offers.settled(offers[0], committed)
    assert a.offers.offer() is None  # nothing new to give while the result waits
    assert len(a.live.apply_pending()) == 1
    assert a.live.apply_pending() == []  # applied once
    for n, p in a.model.named_parameters():
        assert torch.allclose(a.live.outer.anchor[n], mean[n], atol=1e-6)  # lr 1: the pair's mean
        assert torch.allclose(p.detach(), mean[n] + later[n], atol=1e-6)  # plus what it trained since
    assert a.live.steps == 1  # the step taken meanwhile starts the next round
    assert a.offers.round == 1


def test_the_schedule_is_a_perfect_matching_that_degrades_gracefully() -> None:
    order = consensus_order([f"peer-{i}" for i in range(8)] + ["peer-0"], salt="run")
    assert len(order) == 8 and consensus_order(list(reversed(order)), salt="run") == order
    for round_ in range(3):
        partners = {me: hypercube_partner(order, me, round_) for me in order}
        assert all(partners[partners[me]] == me != partners[me] for me in order)
    seven = order[:7]  # N not a power of two: the position without a partner gets None (a random one)
    assert [hypercube_partner(seven, me, 0) is None for me in seven].count(True) == 1
    assert (
        hypercube_partner(order, "stranger", 0) is None and hypercube_partner(order[:1], order[0], 0) is None
    )


def test_a_partner_round_is_believed_only_when_it_is_a_sane_count() -> None:
    assert partner_round((41.0,)) == 41
    for probe in ((), (1.5,), (-1.0,), (1e300,), (float("nan"),), (1.0, 2.0)):
        assert partner_round(probe) == 0


def test_an_older_protocol_version_is_refused_with_a_clear_message() -> None:
    fields = dict(run_id="r", config_hash="c", schema_hash="s", codec="int8", block_size=64, weight=1.0)
    ours = Hello(version=4, **fields)
    reason = ours.mismatch(Hello(version=3, **fields))
    assert reason is not None and "protocol version 3 is not spoken here" in reason


class _Record:
    role, protocol_version, config_hash = "trainer", 4, "cfg"
    client_mode, state, reachability = False, "training", "direct"


class _Member:
    def __init__(self, peer_id: str) -> None:
        self.peer_id, self.record, self.expires_at = peer_id, _Record(), 0.0


class _Node:
    def __init__(self, me: str, everyone: list[str]) -> None:
        self.peer_id, self._everyone = me, everyone

    def recent_members(self) -> list[_Member]:  # no members(): a round never reads the DHT
        return [_Member(peer) for peer in self._everyone]


def _backend(me: str, everyone: list[str], round_: int) -> GossipBackend:
    """The gossip backend's schedule state, without its network (only what the schedule reads)."""
    backend = GossipBackend.__new__(GossipBackend)
    backend._node, backend._run_id, backend._models = _Node(me, everyone), "run", True
    backend._context = type("Context", (), {"group": None})()
    model = torch.nn.Linear(1, 1)
    backend._model_offers = ModelOffers(LiveModel(model, OuterOptimizer(model, lr=1.0, momentum=0.0), 1))
    backend._model_offers.round = round_
    return backend


@pytest.mark.parametrize("count", [4, 6])
def test_of_each_scheduled_pair_exactly_one_trainer_dials(count: int) -> None:
    everyone = [f"peer-{i}" for i in range(count)]
    for round_ in range(3):
        backends = {me: _backend(me, everyone, round_) for me in everyone}
        waits = {me: backend._schedule_says_wait() for me, backend in backends.items()}
        scheduled = {me: backend._scheduled for me, backend in backends.items()}
        for me, partner in scheduled.items():
            if partner is None:  # N not a power of two: no scheduled partner, so it dials a random one
                assert not waits[me] and count & (count - 1)
                continue
            assert scheduled[partner] == me  # mutual
            assert waits[me] != waits[partner]  # one dials, the other waits to be dialled


def test_a_model_offer_states_our_progress_since_the_anchor() -> None:
    """What a partner's model is judged against (``Offer.blame_norm``): our own measured progress,
    ``||params - anchor||``, zero before any step and after an exchange that left nothing pending."""
    peer = Peer(5, "model")
    offer = peer.offers.offer()
    assert offer is not None and offer.blame_norm == 0.0
    peer.offers.settled(offer, None)
    with peer.live.updating():
        peer.model.weight.data.add_(0.5)
    offer = peer.offers.offer()
    assert offer is not None
    assert offer.blame_norm == pytest.approx(0.5 * math.sqrt(peer.model.weight.numel()), rel=1e-5)
