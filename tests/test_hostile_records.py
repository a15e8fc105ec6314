"""Fake trainer records cannot end a run (issue 28, finding 3): the ledger credits a stranger's claim
only as far as honest peers bound it, and no DHT node keeps a record that expires far in the future."""

from __future__ import annotations

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm import NetworkOptions, NodeInfo, PeerRecord, SwarmNode
from swarm.membership import MAX_RECORD_AHEAD_S, list_members, record_key
from swarm.network import peer_id_of
from swarm.trainer import SwarmLedger
from tests._processes import wait_until

RATE = 100  # samples per second of an honest peer
HUGE = 10**15


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _honest(t: int) -> list[tuple[str, int]]:
    return [(f"honest-{i}", RATE * t) for i in range(3)]


def test_as_many_fake_records_as_trainers_do_not_end_the_run() -> None:
    clock = _Clock()
    ledger = SwarmLedger(clock=clock)
    fakes = [(f"fake-{i}", HUGE) for i in range(4)]  # us and 3 honest peers: 4 trainers, 4 fakes
    for t in range(1, 31):
        clock.now = float(t)
        total = ledger.observe([*_honest(t), *fakes], own_samples=RATE * t)
    honest = 3 * RATE * 30
    assert total <= 2 * honest  # each fake was credited an honest count at most, and never grew
    assert max(ledger.credited(f"fake-{i}") for i in range(4)) <= RATE


def test_fresh_identities_claiming_huge_counts_bring_in_nothing_at_once() -> None:
    clock = _Clock()
    ledger = SwarmLedger(clock=clock)  # its first look lasts settle_s = 30 s
    for t in range(1, 41):
        clock.now = float(t)
        before = ledger.observe(_honest(t), own_samples=RATE * t)
    # then 50 new keys every second, each claiming 1e15 (a record costs one RSA key)
    for t in range(41, 46):
        clock.now = float(t)
        sybils = [(f"sybil-{t}-{i}", HUGE) for i in range(50)]
        total = ledger.observe([*_honest(t), *sybils], own_samples=RATE * t)
    assert total < before + 3 * RATE * 5 + 50 * 5 * 8 * RATE * 5  # at most rate_slack x an honest rate each
    assert total < HUGE / 10**6


HOUR = 3600
SYBILS = 5  # with us and 3 honest peers, 5 of the 9 records we see


def _sybil_claims(strategy: str, t: int, ledger: SwarmLedger) -> list[tuple[str, int]]:
    """What a majority of Sybil records claims at second ``t``: a huge count from our first look on,
    fresh keys after it whose counts grow fast, or a ratchet (each claims 16 times what it
    was credited, up to the most a record may claim, so that a median of their rates lifts itself)."""
    names = [f"sybil-{i}" for i in range(SYBILS)]
    if strategy == "first-look":
        return [(name, 10**15 + 10**9 * t) for name in names]
    if strategy == "late":
        return [(name, 10**9 * (t - 40)) for name in names] if t > 40 else []
    return [(name, min(2**63 - 1, 16 * max(ledger.credited(name), RATE))) for name in names]


@pytest.mark.parametrize("strategy", ["first-look", "late", "ratchet"])
def test_a_majority_of_sybil_records_gains_at_most_rate_slack_times_our_own_rate(strategy: str) -> None:
    """Old finding 3 (issue 41): Sybils that are most of the records set both medians, so each was
    credited whatever it claimed (the finding: 7e16 samples in an hour; a ratchet's claims compound
    to 2^63 - 1 each). Our own count and rate cap them: each live record is credited at most our count
    at first sight, then 8x our rate while we watch it."""
    clock = _Clock()
    ledger = SwarmLedger(clock=clock)  # rate_slack 8
    for t in range(1, HOUR + 1, 5):
        clock.now = float(t)
        total = ledger.observe([*_honest(t), *_sybil_claims(strategy, t, ledger)], own_samples=RATE * t)
    per_sybil = RATE * 1 + 8 * RATE * HOUR  # our count at first sight, then 8x our rate for an hour
    assert max(ledger.credited(f"sybil-{i}") for i in range(SYBILS)) <= per_sybil
    assert total <= 3 * RATE * HOUR + SYBILS * per_sybil < 10**8


def test_an_honest_majority_still_counts_every_honest_peer_in_full() -> None:
    """The cap is our own rate: honest peers as fast as we are lose nothing to it."""
    clock = _Clock()
    ledger = SwarmLedger(clock=clock)
    for t in range(1, HOUR + 1, 5):
        clock.now = float(t)
        total = ledger.observe([*_honest(t), ("liar", 10**12 * t)], own_samples=RATE * t)
    assert all(ledger.credited(f"honest-{i}") == RATE * (HOUR - 4) for i in range(3))
    assert total <= 3 * RATE * HOUR + RATE + 8 * RATE * HOUR


def _signed_record(key: RSAPrivateKey, samples: int) -> tuple[bytes, dict, RSASignatureValidator]:
    signer = RSASignatureValidator(key)
    record = PeerRecord(
        peer_id=peer_id_of(key.get_public_key()),
        protocol_version=1,
        package_version="x",
        config_hash="ab",
        role="trainer",
        samples_total=samples,
    )
    return signer.local_public_key, record.dict(), signer


def _listed(node: SwarmNode, run: str) -> set[int]:
    return {m.record.samples_total for m in list_members(node.dht, run, timeout_s=5)}


@pytest.mark.parametrize("ahead_s", [MAX_RECORD_AHEAD_S * 10, 10**9])
def test_a_record_expiring_far_in_the_future_is_refused(ahead_s: float) -> None:
    run = "hostile-expiry"
    with SwarmNode(NetworkOptions(), NodeInfo(run, "ab", "trainer")) as honest:
        key = RSAPrivateKey()
        subkey, value, signer = _signed_record(key, HUGE)
        rogue = hivemind.DHT(
            initial_peers=honest.visible_maddrs(),
            start=True,
            record_validators=[signer],  # signs, but checks nothing itself
        )
        try:
            soon = get_dht_time() + 30
            far = get_dht_time() + ahead_s
            fair_key, fair_value, fair_signer = _signed_record(RSAPrivateKey(), 1)
            rogue.store(record_key(run), value, far, subkey=subkey)  # the honest node refuses it
            # a fair record from another key still gets in, so the refusal is the expiry's
            fair = hivemind.DHT(
                initial_peers=honest.visible_maddrs(), start=True, record_validators=[fair_signer]
            )
            try:
                assert fair.store(record_key(run), fair_value, soon, subkey=fair_key)
                wait_until(lambda: 1 in _listed(honest, run), timeout=20, what="the fair record")
                assert HUGE not in _listed(honest, run)
            finally:
                fair.shutdown()
        finally:
            rogue.shutdown()
