"""The partner schedule's slots (swarm/trainer/_schedule.py): both members of a pair agree on the pair,
on who dials and on who pushes the base; pushes are shared out whatever a member's position; and the
round the waits are timed by follows the device, not rounds stretched by waiting."""

from __future__ import annotations

import pytest

from swarm.trainer._schedule import Pace, slot_of


@pytest.mark.parametrize("n", [2, 4, 5, 8])
def test_both_members_of_a_pair_agree_on_the_pair_the_dialler_and_the_pusher(n: int) -> None:
    peers = [f"peer{i}" for i in range(n)]
    dims = (n - 1).bit_length()
    for round_ in range(4 * dims):
        slots = {p: slot_of([q for q in peers if q != p], p, "run", round_) for p in peers}
        for peer, slot in slots.items():
            if slot.partner is None:
                assert not slot.pushes and not slot.waits
                continue
            other = slots[slot.partner]
            assert other.partner == peer  # a pair, seen from both sides
            assert slot.waits != other.waits  # exactly one dials
            assert slot.pushes != other.pushes  # exactly one pushes


def test_every_member_pushes_about_every_other_round_whatever_its_position() -> None:
    peers = [f"peer{i}" for i in range(8)]
    for peer in peers:
        others = [q for q in peers if q != peer]
        pushed = sum(slot_of(others, peer, "run", r).pushes for r in range(6))  # two cycles of d = 3
        assert pushed == 3, (peer, pushed)  # the earliest member would push every round, the last never


def test_the_round_follows_the_device_pace_not_rounds_stretched_by_waiting() -> None:
    pace = Pace(steps_per_round=5)
    clock = 0.0
    for _ in range(50):  # steps of 0.1 s
        clock += 0.1
        pace.step(clock)
    pace.round(clock)
    pace.round(clock + 3.0)  # a round stretched to 3 s by waiting on a partner
    assert pace.round_s == pytest.approx(3.0)
    assert pace.nominal_round_s() == pytest.approx(0.5, rel=0.05)
    for step in range(50):  # the same steps, every tenth after the training thread stalled 2 s on an exchange
        stall = 2.0 if step % 10 == 9 else 0.0
        pace.stalled(stall)
        clock += stall + 0.1
        pace.step(clock)
    assert pace.nominal_round_s() == pytest.approx(0.5, rel=0.05)  # counted in: about 1.4 s
    short = Pace(steps_per_round=5)
    short.round(0.0)
    short.round(0.2)  # measured rounds shorter than the pace implies (none timed yet) count as they are
    assert short.nominal_round_s() == pytest.approx(0.2)
