"""Failures held against partners until their records say whether they are still here.

A failed exchange (a cut stream, a deadline, a refused handshake) is no proof of misbehaviour: the
partner may have been killed, be leaving, or be slow under load. So a failure through the partner's
fault is *held*: the partner is not dialled meanwhile, and once ``HOLD_S`` has passed the held failure
is judged against a fresh read of the members (:meth:`HeldFailures.review`):

- a partner that left the list, or whose record says ``leaving``, is dropped without a verdict;
- a listed partner is judged only once its record was refreshed after the hold began (its
  ``expires_at`` moved on): then it is alive, and the failure counts. A record that is never
  refreshed belongs to a peer that died, and the failure is dropped after ``MAX_HOLD_S``;
- a peer that was never listed (a dialler with no record) is judged at once: it gets no more than a
  member would;
- a counted failure bans only when it is the partner's ``FAILURES_TO_BAN``-th since its last
  committed exchange: one broken stream under load costs the partner its hold, not a ban.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from swarm.gossip._partners import MAX_TRACKED, PartnerInfo

HOLD_S = 5.0
"""A failure is judged this long after it happened at the earliest: time for a leaving partner's record
to say so."""
MAX_HOLD_S = 60.0
"""A held failure whose partner's record was not refreshed for this long is dropped: the partner died."""
FAILURES_TO_BAN = 2
"""Failures since the partner's last committed exchange that make a ban."""


@dataclass
class _Held:
    reason: str
    at: float
    seen_expiry: float | None = None
    """The partner's record expiry at the first review after ``HOLD_S``: judged once it moves on."""


class HeldFailures:
    """The failures held per partner, and how many each has had since its last good exchange.
    Thread-safe; every table is bounded to ``MAX_TRACKED`` peers (the oldest entry forgotten first)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._listed: dict[str, None] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def hold(self, peer: str, reason: str) -> None:
        """A failure through ``peer``'s fault; a second one while the first is held adds nothing."""
        with self._lock:
            if peer in self._held:
                return
            self._held[peer] = _Held(reason, self._clock())
            _bump(self._counts, peer, self._counts.get(peer, 0) + 1)

    def holds(self, peer: str) -> bool:
        with self._lock:
            return peer in self._held

    def drop(self, peer: str) -> None:
        """Forget what is held against ``peer`` (a ban made it moot)."""
        with self._lock:
            self._held.pop(peer, None)

    def cleared(self, peer: str) -> None:
        """An exchange with ``peer`` committed: its failures so far are forgiven."""
        with self._lock:
            self._counts.pop(peer, None)

    def reasons(self) -> dict[str, str]:
        with self._lock:
            return {peer: held.reason for peer, held in self._held.items()}

    def review(self, partners: Sequence[PartnerInfo]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
        """Judge the held failures against ``partners`` (a fresh read of the members). Returns the
        ``(peer, reason)`` pairs to ban, and those dropped with why (module docstring)."""
        now = self._clock()
        listed = {info.peer_id: info for info in partners}
        to_ban, dropped = [], []
        with self._lock:
            for peer in listed:
                _bump(self._listed, peer, None)
            for peer, held in list(self._held.items()):
                if now - held.at < HOLD_S:
                    continue
                verdict = self._verdict(peer, held, listed.get(peer), now)
                if verdict is None:
                    continue
                del self._held[peer]
                if verdict == "counts" and self._counts.get(peer, 0) >= FAILURES_TO_BAN:
                    to_ban.append((peer, held.reason))
                elif verdict != "counts":
                    dropped.append((peer, f"{held.reason} ({verdict})"))
        return to_ban, dropped

    def _verdict(self, peer: str, held: _Held, info: PartnerInfo | None, now: float) -> str | None:
        """ "counts", or why the failure is dropped, or None to keep holding it."""
        if info is None:
            return "it left the run" if peer in self._listed else "counts"
        if info.leaving:
            return "it is leaving the run"
        if info.expires_at is None:
            return "counts"
        if held.seen_expiry is None:
            held.seen_expiry = info.expires_at
        elif info.expires_at > held.seen_expiry:
            return "counts"
        if now - held.at >= MAX_HOLD_S:
            return "its record was never refreshed: it died"
        return None


def _bump(table: dict, peer: str, value: object) -> None:
    """Set ``table[peer]`` as its newest entry, keeping at most ``MAX_TRACKED`` entries."""
    table.pop(peer, None)
    table[peer] = value
    while len(table) > MAX_TRACKED:
        del table[next(iter(table))]
