"""Partner choice: which live peers may be dialled, in which order, and who is banned for how long."""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_TRACKED = 4096
"""Peers a ban list remembers at most (bans, strikes, suspicions): beyond it, the earliest-ending go."""
FORGET_AFTER_S = 3600.0
"""A peer's strikes are forgotten this long (or ``ban_max_s``, if longer) after its last ban ended."""


@dataclass(frozen=True)
class PartnerInfo:
    """What the averager needs to know about a potential partner (the lead adapts membership records)."""

    peer_id: str
    protocol_version: int
    config_hash: str
    client_mode: bool = False
    leaving: bool = False
    """Its record says it is shutting down: not dialled, and failures with it are no misbehaviour."""
    joining: bool = False
    """Its record says it is still joining (taking over the swarm's state): not dialled until it has
    joined. It serves nothing of the run's yet, and a dial that fails meanwhile (its handlers are not
    up) would be held against it: then the ban refuses the very exchange it joins with."""
    relayed: bool = False
    """Reachable only through a relay (its record says ``reachability: relay``): dialled, but
    after direct partners are more likely (:func:`pick_order`)."""
    expires_at: float | None = None
    """When its record expires (the DHT's clock; None: unknown). A record refreshed after a failure
    shows the partner alive (:mod:`swarm.gossip._failures`)."""


class BanList:
    """Temporary bans with exponential backoff: the n-th consecutive strike bans for base * 2**(n-1).

    A successful exchange with a peer forgives its strikes. :meth:`suspect` counts softer evidence
    (an exchange that committed but had to be clipped hard): ``limit`` suspicions in a row make one
    strike. ``also`` is another list whose bans this one respects (read only: its strikes and
    forgiveness stay its own), e.g. a trainer's anchor exchange honouring the bans of its
    model exchange. Thread-safe: the serving side (event loop thread) and the initiating
    side (caller's thread) both consult it.
    """

    def __init__(
        self,
        base_s: float,
        max_s: float,
        clock: Callable[[], float] = time.monotonic,
        also: BanList | None = None,
    ) -> None:
        if base_s < 0 or max_s < base_s:
            raise ValueError(f"need 0 <= ban_base_s <= ban_max_s, got {base_s} and {max_s}")
        self._base = base_s
        self._max = max_s
        self._clock = clock
        self._also = also
        self._lock = threading.Lock()
        self._strikes: dict[str, int] = {}
        self._until: dict[str, float] = {}
        self._suspicions: dict[str, int] = {}
        self._reasons: dict[str, str] = {}

    def ban(self, peer_id: str, reason: str) -> float:
        """Ban ``peer_id``; return the ban duration in seconds."""
        with self._lock:
            now = self._clock()
            strikes = self._strikes.get(peer_id, 0) + 1
            self._strikes[peer_id] = strikes
            duration = min(self._max, self._base * 2 ** min(strikes - 1, 62))
            self._until[peer_id] = now + duration
            self._reasons[peer_id] = reason
            self._prune(now)
        logger.warning("banning peer %s for %.1f s (strike %d): %s", peer_id, duration, strikes, reason)
        return duration

    def suspect(self, peer_id: str, reason: str, limit: int) -> float | None:
        """Count one suspicion; at ``limit`` in a row, ban (a strike). Returns the ban duration, if any."""
        with self._lock:
            count = self._suspicions.get(peer_id, 0) + 1
            self._suspicions[peer_id] = 0 if count >= limit else count
            while len(self._suspicions) > MAX_TRACKED:  # the oldest first (dicts keep insertion order)
                del self._suspicions[next(iter(self._suspicions))]
        if count < limit:
            logger.warning("suspicious partner %s (%d/%d before a ban): %s", peer_id, count, limit, reason)
            return None
        return self.ban(peer_id, f"{limit} suspicious exchanges in a row, the last: {reason}")

    def forgive(self, peer_id: str) -> None:
        with self._lock:
            self._forget(peer_id)

    def _prune(self, now: float) -> None:
        """Forget peers whose last ban ended over ``FORGET_AFTER_S`` (or ``max_s``) ago, then the
        earliest-ending beyond ``MAX_TRACKED``: throwaway identities must not grow the list without bound."""
        forget_before = now - max(self._max, FORGET_AFTER_S)
        for peer in [peer for peer, until in self._until.items() if until < forget_before]:
            self._forget(peer)
        if len(self._until) > MAX_TRACKED:
            for peer in sorted(self._until, key=self._until.__getitem__)[: len(self._until) - MAX_TRACKED]:
                self._forget(peer)

    def _forget(self, peer: str) -> None:
        self._until.pop(peer, None)
        self._strikes.pop(peer, None)
        self._suspicions.pop(peer, None)
        self._reasons.pop(peer, None)

    def next_duration(self, peer_id: str) -> float:
        """How long ``peer_id``'s next ban would last."""
        with self._lock:
            strikes = self._strikes.get(peer_id, 0) + 1
        return min(self._max, self._base * 2 ** min(strikes - 1, 62))

    def strikes(self) -> dict[str, int]:
        """Strikes per peer since its last good exchange (bans so far, expired ones included)."""
        with self._lock:
            return dict(self._strikes)

    def is_banned(self, peer_id: str) -> bool:
        with self._lock:
            until = self._until.get(peer_id)
            if until is not None and self._clock() < until:
                return True
        return self._also is not None and self._also.is_banned(peer_id)

    def banned(self) -> dict[str, float]:
        """Currently banned peers and the seconds left on each ban."""
        now = self._clock()
        with self._lock:
            return {peer: until - now for peer, until in self._until.items() if until > now}

    def reasons(self) -> dict[str, str]:
        """Why each currently banned peer was banned (its latest ban)."""
        now = self._clock()
        with self._lock:
            return {peer: self._reasons[peer] for peer, until in self._until.items() if until > now}


def eligible_partners(
    candidates: Sequence[PartnerInfo],
    *,
    self_id: str,
    protocol_version: int,
    config_hash: str,
    banned: Callable[[str], bool],
    last_partner: str | None = None,
) -> list[PartnerInfo]:
    """Candidates we may dial: not ourselves, dialable, joined, staying, compatible, not banned; no
    duplicates.

    Never ``last_partner`` again when there is a choice: with back-to-back syncs the two peers that
    just finished are the only idle ones, and would pair up forever.
    """
    seen: set[str] = set()
    result = []
    for info in candidates:
        if info.peer_id in seen or info.peer_id == self_id:
            continue
        if info.client_mode or info.leaving or info.joining:
            continue
        if info.protocol_version != protocol_version or info.config_hash != config_hash:
            continue
        if banned(info.peer_id):
            continue
        seen.add(info.peer_id)
        result.append(info)
    if len(result) > 1:
        result = [info for info in result if info.peer_id != last_partner]
    return result


DIRECT_PREFERENCE = 4.0
"""How much likelier a direct partner is than a relayed one to come first in :func:`pick_order`."""


def pick_order(
    partners: Sequence[PartnerInfo], rng: random.Random, max_attempts: int, first: str | None = None
) -> list[PartnerInfo]:
    """A random order of at most ``max_attempts`` distinct partners to try, weighted towards direct ones.

    Each partner draws the key ``u ** (1 / weight)`` (u uniform in (0, 1]; weight 1 for relayed
    partners, :data:`DIRECT_PREFERENCE` for direct ones) and the largest keys go first: a weighted
    sample without replacement. Among partners of one kind every order is equally likely, and a
    relayed partner is never left out, only tried later on average: its traffic costs the relay's
    bandwidth and crosses two links instead of one. ``first`` (a scheduled partner's id) goes first
    when it is among ``partners``.
    """
    keyed = [(1.0 - rng.random()) ** (1.0 / (1.0 if p.relayed else DIRECT_PREFERENCE)) for p in partners]
    order = sorted(range(len(partners)), key=keyed.__getitem__, reverse=True)
    ranked = [partners[i] for i in order]
    ranked.sort(key=lambda p: p.peer_id != first)  # stable: the scheduled partner first, the rest as drawn
    return ranked[:max_attempts]


def consensus_order(peer_ids: Sequence[str], salt: str = "") -> list[str]:
    """The live members in the order every peer computes alike: by ``sha256(salt + peer_id)`` (the run
    id as salt, so that the order is not the same in every run), duplicates dropped."""
    unique = set(peer_ids)
    return sorted(unique, key=lambda peer: hashlib.sha256((salt + peer).encode()).hexdigest())


def hypercube_partner(order: Sequence[str], me: str, round_: int) -> str | None:
    """Our scheduled partner in dimension exchange: in round ``r`` the member at position ``i`` of the
    shared ``order`` meets the one at ``i XOR 2^(r mod d)``, ``d = ceil(log2 N)``.

    For N a power of two, d rounds of it average the N models exactly (each round halves the
    dimensions left to agree on). None when we are not in ``order``, are alone, or the position does not
    exist (N not a power of two): the caller falls back to a random partner then, as it does when the
    scheduled one is busy or gone.
    """
    if me not in order or len(order) < 2:
        return None
    dims = (len(order) - 1).bit_length()
    index = list(order).index(me) ^ (1 << (round_ % dims))
    return order[index] if index < len(order) else None
