"""Trust under load, at the averager (issue 41): what a partner costs us when it is busy, refuses us,
comes back too often, or states a joiner's weight; with real p2p daemons in this process.

* A partner that told us it banned us is not dialled again until its ban could have ended, and a
  failed sync makes the next one back off: peers calling ``sync`` in a loop never storm.
* A partner is served at most once per ``serve_interval_s``, whatever its record.
* An exchange whose partner states a joiner's weight hands our tensors over and commits nothing here:
  no weight change, no generation moved, no verdict.
* A partner's stated weight moves an anchor pull at most as far as an honest anchor's would.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator

import pytest
import torch

from scripts._held import gossip_averager
from swarm.gossip import Committed, GossipAverager, PartnerInfo, SyncOutcome, SyncResult
from swarm.gossip._backoff import Backoff
from swarm.gossip._protocol import PROTOCOL_VERSION
from swarm.trainer._offers import anchor_pull
from tests._mixing import computed
from tests.workers.gossip_pool import p2pd_pids, wait_no_leak

Pair = Callable[..., tuple[GossipAverager, GossipAverager]]


@pytest.fixture
def pair() -> Iterator[Pair]:
    """Two averagers with registered tensors on their own daemons, each the other's only partner."""
    from hivemind.p2p import P2P

    before = p2pd_pids()
    made: list[GossipAverager] = []

    def make(**options: object) -> tuple[GossipAverager, GossipAverager]:
        first = gossip_averager(
            run_id="trust", partner_source=list, p2p_factory=P2P.create, codec="fp32", **options
        )
        made.append(first)
        maddrs = first._loop.run(first._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        second = gossip_averager(
            run_id="trust", partner_source=list, p2p_factory=connected, codec="fp32", **options
        )
        made.append(second)
        first.partner_source = lambda: [PartnerInfo(second.peer_id, PROTOCOL_VERSION, "")]
        second.partner_source = lambda: [PartnerInfo(first.peer_id, PROTOCOL_VERSION, "")]
        first.set_tensors([torch.zeros(256)], weight=1.0)
        second.set_tensors([torch.ones(256)], weight=1.0)
        return first, second

    yield make
    for averager in made:
        averager.close()
    assert not wait_no_leak(before, pgids=[], parent=os.getpid())


def test_a_partner_that_banned_us_is_not_dialled_again_and_a_failed_sync_backs_off(pair: Pair) -> None:
    first, second = pair(
        ban_base_s=600.0, busy_patience_s=0.2, retry_backoff_s=0.05, max_retry_backoff_s=0.05
    )
    first._reputation.bans.ban(second.peer_id, "a test's ban")
    refused = second.sync()
    assert refused.outcome is SyncOutcome.FAILED and "REJECT" in refused.reason, refused
    assert second._backoff.failures == 1 and second._backoff.remaining() > 0  # the next sync waits first
    dialled = second.metrics().exchanges_rejected + second.metrics().exchanges_failed
    again = second.sync()  # its ban on us lasts: no second handshake, nothing against it either
    assert again.outcome is SyncOutcome.NO_PARTNER, again
    assert second.metrics().exchanges_rejected + second.metrics().exchanges_failed == dialled
    assert second.banned_peers() == {}  # a partner that banned us is not banned back
    assert second._backoff.failures == 1  # finding no partner dialled nobody: no more backoff


def test_backoff_doubles_after_failures_and_resets_on_a_commit() -> None:
    now = [0.0]
    backoff = Backoff(0.1, 1.0, random.Random(0), clock=lambda: now[0])
    waits = []
    for outcome in [SyncOutcome.FAILED, SyncOutcome.FAILED, SyncOutcome.REJECTED, SyncOutcome.FAILED]:
        backoff.after(outcome)
        waits.append(backoff.remaining())
    assert all(low / 2 <= w <= low for w, low in zip(waits, (0.1, 0.2, 0.4, 0.8), strict=True)), waits
    for _ in range(10):
        backoff.after(SyncOutcome.FAILED)
    assert backoff.remaining() <= 1.0  # capped
    backoff.after(SyncOutcome.BUSY)  # waited inside the sync already: no change
    backoff.after(SyncOutcome.NO_PARTNER)  # dialled nobody
    backoff.after(SyncOutcome.CANCELLED)
    backoff.after(SyncOutcome.FAILED, "not committed: another exchange committed first")  # our own race
    assert backoff.failures == 14
    backoff.after(SyncOutcome.OK)
    assert backoff.remaining() == 0 and backoff.failures == 0


def test_a_partner_is_served_at_most_once_per_interval(pair: Pair) -> None:
    first, second = pair(busy_patience_s=0.2, retry_backoff_s=0.0)
    first.serve_interval_s = 3600.0
    assert second.sync().outcome is SyncOutcome.OK
    again = second.sync()
    assert again.outcome is SyncOutcome.BUSY, again  # served this round already
    assert first.metrics().exchanges_ok == 1
    first.serve_interval_s = 0.0
    assert second.sync().outcome is SyncOutcome.OK


def test_a_joiners_weight_takes_our_tensors_and_commits_nothing_here(pair: Pair) -> None:
    first, second = pair(busy_patience_s=0.2)
    ours = first.held.tensors["0"].clone()
    generation = first._gate.generation()
    second.set_tensors([torch.ones(256)], weight=1e-9)  # a joiner taking over its partner's state
    result = second.sync()
    assert result.outcome is SyncOutcome.OK, result
    assert torch.allclose(second.held.tensors["0"], ours)  # the joiner holds our tensors
    assert torch.equal(first.held.tensors["0"], ours)  # and nothing moved here
    assert first.weight == 1.0  # a commit would have made it the pair's mean weight, about 0.5
    assert first._gate.generation() == generation  # an exchange of ours in flight could still commit
    assert first.metrics().exchanges_ok == 0
    second.set_tensors([torch.ones(256)], weight=1e-9)
    reverse = first.sync()  # and a responder stating a joiner's weight gives us nothing either
    assert reverse.outcome is SyncOutcome.FAILED and "joiner's weight" in reverse.reason, reverse
    assert first.weight == 1.0 and torch.equal(first.held.tensors["0"], ours)


def test_an_anchor_pull_counts_a_partners_claimed_weight_at_most_as_an_honest_anchors() -> None:
    ours = {"x": torch.zeros(8)}
    theirs = torch.ones(8)
    for claimed in (1.0, 1e29):
        share = claimed / (1.0 + claimed)
        mixed = _committed({"x": share * theirs}, claimed)  # the mix made at the partner's claim
        shift, _ = anchor_pull(ours, 1.0, mixed)
        assert torch.allclose(shift["x"], 0.5 * theirs), claimed  # the pair's mean, never past it
    joiner = anchor_pull(ours, 1e-9, _committed({"x": theirs * (1 / (1 + 1e-9))}, 1.0))[0]
    assert torch.allclose(joiner["x"], theirs)  # a joiner still takes its partner's anchor over


def _committed(mixed: dict[str, torch.Tensor], partner_weight: float) -> Committed:
    result = SyncResult(SyncOutcome.OK, "partner", 0, 0, 0.0, 1.0)
    return Committed(computed(mixed, mixed), partner_weight, True, result)
