"""A gossip trainer's place in the partner schedule, and the pace its rounds are timed by.

The schedule is dimension exchange over the live trainers in the run's shared hash order
(:func:`~swarm.gossip.hypercube_partner`). Of a scheduled pair, the member earlier in the order dials and
the later waits a moment to be dialled; one of the two pushes the pair's base for the round
(docs/gossip.md, "Nothing waits on the full model"): the earlier in even cycles of ``d`` rounds, the
later in odd ones, so that every trainer pushes about every other round whatever its position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from swarm.gossip import PartnerInfo, consensus_order, hypercube_partner
from swarm.membership import Member

STEP_AVERAGING = 0.1
"""Weight of the newest step in the average step time."""


@dataclass(frozen=True)
class Slot:
    """Our place in one round of the schedule: the partner (None: nobody is scheduled), whether it
    comes before us (it dials, we wait), and whether we push the pair's base."""

    partner: str | None
    waits: bool
    pushes: bool


def slot_of(others: Sequence[str], me: str, salt: str, round_: int) -> Slot:
    """Our :class:`Slot` in round ``round_`` among the dialable live trainers ``others`` and us. Both
    members of a pair compute the same pair, the same dialler and the same pusher."""
    order = consensus_order([*others, me], salt=salt)
    partner = hypercube_partner(order, me, round_)
    if partner is None:
        return Slot(None, False, False)
    waits = order.index(partner) < order.index(me)
    dims = max(1, (len(order) - 1).bit_length())
    later_pushes = (round_ // dims) % 2 == 1
    return Slot(partner, waits, pushes=waits == later_pushes)


class Pace:
    """How long a round takes at the device's recent pace (an average of the steps' wall time), and
    as measured between our own rounds."""

    def __init__(self, steps_per_round: int) -> None:
        self._steps_per_round = steps_per_round
        self._step_s = 0.0
        self._last_step: float | None = None
        self._last_round: float | None = None
        self.round_s = 0.0
        """Seconds between our last two own rounds (0 before the second)."""

    def step(self, now: float) -> None:
        if self._last_step is not None:
            self._step_s += STEP_AVERAGING * (now - self._last_step - self._step_s)
        self._last_step = now

    def stalled(self, seconds: float) -> None:
        """The training thread waited ``seconds`` on an exchange since the last step: that is not the
        device's pace. Counted in, a stall would lengthen the rounds the waits are timed by, the later
        exchanges, and so the next stall."""
        if self._last_step is not None:
            self._last_step += max(0.0, seconds)

    def round(self, now: float) -> None:
        if self._last_round is not None:
            self.round_s = now - self._last_round
        self._last_round = now

    def nominal_round_s(self) -> float:
        """A round of ``steps_per_round`` at the device's pace, or the measured one if shorter. Not the
        measured round alone: rounds stretched by waiting would stretch every wait timed by them (for a
        scheduled partner, between two exchanges served to one partner), and so the rounds, further."""
        at_pace = self._steps_per_round * self._step_s if self._step_s > 0 else self.round_s
        return min(at_pace, self.round_s) if self.round_s > 0 else at_pace


def trainer_partners(members: Sequence[Member]) -> list[PartnerInfo]:
    """The trainers among live ``members``, as the averager weighs partners."""
    return [
        PartnerInfo(
            m.peer_id,
            m.record.protocol_version,
            m.record.config_hash,
            m.record.client_mode,
            leaving=m.record.state == "leaving",
            joining=m.record.state == "joining",
            relayed=m.record.reachability == "relay",
            expires_at=m.expires_at,
        )
        for m in members
        if m.record.role == "trainer"
    ]
