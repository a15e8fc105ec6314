"""Reputation: which partners an averager trusts, and the verdicts that change it.

The rules (docs/gossip.md, "Never a stall" and "Malicious partners"), on top of a :class:`BanList`:

- bad data (invalid tensors: NaN, another schema, an implausible norm; a broken protocol) bans its
  sender at once (:meth:`Reputation.misbehaved`), whoever it is: a peer without a record, or one
  whose record says ``leaving``, included. Leaving explains a cut stream, never bad data;
- any other exchange or handshake that failed through the partner's fault is *held* (the partner is not
  dialled meanwhile) until the members say whether the partner is still here
  (:mod:`swarm.gossip._failures`): a partner that left, says it is leaving, or whose record is never
  refreshed again (it died) is not banned; one that is alive, or that never had a record, is banned
  (exponential backoff) at its second failure since its last committed exchange. Leaving a run, or one
  broken stream under load, is not misbehaving;
- BUSY costs nothing; a REJECT saying that it banned *us* does not ban it back: that is no evidence
  against it (perhaps the failure was ours), and banning back would keep the pair apart long after
  its ban on us expired;
- every committed exchange the robust clip judged (per stated sample, ``swarm.gossip._robust``) is
  evidence for or against the partner (:mod:`swarm.gossip._suspicion`): hard clips that accumulate
  and decay slowly, and a median excess over the last few exchanges; either bans it. One clean
  exchange never wipes the record, and the strikes (the ban backoff) are forgiven only once the
  evidence is back to ordinary;
- an exchange without a clip at all forgives the partner;
- one the clip did not judge (a joiner's weight) changes nothing.

The robust clip blames relative to our own recent norms, so they are kept here too: our progress norms
(which no partner moves) and how far each partner's mix moved us. A partner is judged against the
moves the *others* made (:meth:`Reputation.norm_reference`), so it never widens its own radius.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Sequence

from swarm.gossip._failures import HeldFailures
from swarm.gossip._handshake import BANNED_REASON, Reply
from swarm.gossip._metrics import MetricsRecorder
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import BanList, PartnerInfo
from swarm.gossip._protocol import MsgKind
from swarm.gossip._robust import ClipStats
from swarm.gossip._suspicion import Suspicions, Verdict

logger = logging.getLogger(__name__)

REFERENCE_WINDOW = 8
"""Recent exchanges whose norms make the reference a partner is judged against."""


class Reputation:
    """Bans, strikes and forgiveness for one averager; counts its verdicts in ``metrics``.

    ``also`` is another averager's ban list that this one honours (read only), e.g. a trainer's
    anchor exchange honouring the bans of its model exchange. Thread-safe as the ban
    list is, except :meth:`committed`, which runs under the averager's exchange lock.
    """

    def __init__(
        self,
        options: GossipOptions,
        metrics: MetricsRecorder,
        also: BanList | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bans = BanList(options.ban_base_s, options.ban_max_s, also=also)
        self._clip_strikes = options.clip_strikes
        self._metrics = metrics
        self._own_norms: collections.deque[tuple[str, float, float]] = collections.deque(
            maxlen=REFERENCE_WINDOW
        )  # (partner, our progress norm, how far its mix moved us)
        self._held = HeldFailures(clock)
        self._suspicions = Suspicions(float(options.clip_strikes))

    def is_banned(self, peer: str) -> bool:
        """Banned, or a failure of its is held: either way, not a partner for now."""
        return self._held.holds(peer) or self.bans.is_banned(peer)

    def banned(self) -> dict[str, float]:
        """Banned peers and the seconds left on each ban; held ones with the ban they would get."""
        banned = self.bans.banned()
        held = self._held.reasons()
        return {**{peer: self.bans.next_duration(peer) for peer in held}, **banned}

    def review(self, partners: Sequence[PartnerInfo]) -> None:
        """Judge the failures held against a fresh read of the members (:mod:`swarm.gossip._failures`)."""
        to_ban, dropped = self._held.review(partners)
        for peer, reason in to_ban:
            self.bans.ban(peer, reason)
        for peer, reason in dropped:
            logger.info("not banning %s: %s", peer, reason)

    def reasons(self) -> dict[str, str]:
        """Why each peer of :meth:`banned` is excluded: its ban's reason, or the failure held against it."""
        return {**self._held.reasons(), **self.bans.reasons()}

    def norm_reference(self, partner: str | None = None) -> float:
        """What the robust clip blames ``partner`` relative to (``swarm.gossip._robust``): the largest
        of our recent progress norms, and of how far recent mixes with *other* partners moved us. A
        partner's own pushes never widen its radius."""
        own = max((norm for _, norm, _ in self._own_norms), default=0.0)
        moved = max((step for peer, _, step in self._own_norms if peer != partner), default=0.0)
        return max(own, moved)

    def failed(self, peer: str, reason: str) -> None:
        """An exchange with ``peer`` failed through its fault: hold it toward a ban (see :meth:`review`)."""
        self._held.hold(peer, reason)

    def misbehaved(self, peer: str, reason: str) -> None:
        """``peer`` sent bad data: ban it now, whatever its record says (module docstring)."""
        self._held.drop(peer)
        self.bans.ban(peer, reason)

    def answered(self, peer: str, reply: Reply) -> None:
        """``peer`` did not accept our HELLO: judge the answer (or the failure) and count it."""
        if reply.kind is MsgKind.BUSY:
            self._metrics.count("busy")
            return
        if reply.kind is None:
            self.failed(peer, f"dial/handshake failed: {reply.reason}")
        elif reply.reason != BANNED_REASON:
            self.failed(peer, f"refused the handshake: {reply.reason}")
        self._metrics.count("failed")

    def suspicion(self, peer: str) -> float:
        """``peer``'s hard clips' worth now (0: none); a ban comes at ``clip_strikes``."""
        return self._suspicions.hard_count(peer)

    def committed(self, peer: str, clip: ClipStats | None) -> None:
        """An exchange with ``peer`` committed: judge it by its clip (module docstring). No blame
        before we know our own usual norm: a first, tiny warm-up update looks like a victim.
        """
        knows_own_norm = bool(self._own_norms)
        self._held.cleared(peer)
        if clip is None:
            self.bans.forgive(peer)
            return
        if clip.judged:
            self._own_norms.append((peer, clip.own_norm, clip.moved))
        if clip.clipped:
            self._metrics.count("clipped")
        if not clip.judged:
            return
        if clip.hard and knows_own_norm:
            self._metrics.count("suspect")
            excess = clip.excess
            logger.warning("suspicious partner %s: its update was %.3gx our plausible radius", peer, excess)
        verdict, why = self._suspicions.judge(peer, clip.excess, clip.hard, blame=knows_own_norm)
        logger.debug("judged %s: excess %.3g, hard %s, %s", peer, clip.excess, clip.hard, verdict.value)
        if verdict is Verdict.BAN:
            last = f"its update was {clip.excess:.3g}x our plausible radius (clipped to {clip.scale:.3g})"
            self.bans.ban(peer, f"suspicious exchanges: {why}; the last: {last}")
        elif verdict is Verdict.FORGIVE:
            self.bans.forgive(peer)
