"""The swarm's progress as a trainer counts it: leavers keep their work, liars gain at most a bound."""

from __future__ import annotations

from swarm.trainer import SwarmLedger

RATE = 100  # samples per second of an honest peer


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(ledger: SwarmLedger, clock: _Clock, seconds: int, liar: int | None = None) -> list[int]:
    """Three honest peers and us training at RATE for ``seconds``, plus a liar claiming ``liar`` samples;
    the ledger's total after each second."""
    totals = []
    for t in range(1, seconds + 1):
        clock.now = float(t)
        claims = [(f"honest-{i}", RATE * t) for i in range(3)]
        if liar is not None:
            claims.append(("liar", liar))
        totals.append(ledger.observe(claims, own_samples=RATE * t))
    return totals


def test_honest_peers_are_counted_in_full() -> None:
    clock = _Clock()
    ledger = SwarmLedger(clock=clock)
    assert _run(ledger, clock, 20)[-1] == 3 * RATE * 20


def test_work_of_peers_that_left_is_kept() -> None:
    clock = _Clock()
    ledger = SwarmLedger(clock=clock)
    before = _run(ledger, clock, 10)[-1]
    clock.now = 11.0
    after = ledger.observe([("honest-0", RATE * 11)], own_samples=RATE * 11)  # two left
    assert after >= before and ledger.credited("honest-1") == RATE * 10


def test_a_liar_cannot_end_the_run_or_jump_the_schedule() -> None:
    clock = _Clock()
    ledger = SwarmLedger(rate_slack=8.0, clock=clock)
    totals = _run(ledger, clock, 30, liar=10**9)
    honest = 3 * RATE * 30
    # at first sight it gets the median claim; then at most rate_slack x the median rate
    assert ledger.credited("liar") <= RATE * 1 + 8 * RATE * 29
    assert totals[-1] <= honest + RATE + 8 * RATE * 29 < 10**9 / 100
    # and a newcomer claiming a huge head start after our first look starts from nothing
    clock.now = 31.0
    ledger.observe([*((f"honest-{i}", RATE * 31) for i in range(3)), ("sybil", 10**12)], RATE * 31)
    assert ledger.credited("sybil") == 0


def test_a_minority_of_liars_cannot_raise_the_bounds() -> None:
    clock = _Clock()
    ledger = SwarmLedger(rate_slack=2.0, clock=clock)
    for t in range(1, 31):
        clock.now = float(t)
        claims = [
            ("honest-a", RATE * t),
            ("honest-b", RATE * t),
            ("liar-a", 10**6 * t),
            ("liar-b", 10**6 * t),
        ]
        ledger.observe(claims, own_samples=RATE * t)
    # two liars of five peers (us included): the medians stay honest ones
    assert ledger.credited("honest-a") == RATE * 30
    assert ledger.credited("liar-a") <= RATE + 2 * RATE * 29
