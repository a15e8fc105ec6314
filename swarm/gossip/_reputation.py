"""Reputation: which partners an averager trusts, and the verdicts that change it.

The rules (docs/gossip.md, "Never a stall" and "Malicious partners"), on top of a :class:`BanList`:

- bad data (invalid tensors: NaN, another schema, an implausible norm; a broken protocol) bans its
  sender at once (:meth:`Reputation.misbehaved`), whoever it is: a peer without a record, or one
  whose record says ``leaving``, included. Leaving explains a cut stream, never bad data;
- any other exchange or handshake that failed through the partner's fault bans it (exponential backoff),
  unless the partner was leaving: such a failure is *held* (the partner is not dialled meanwhile)
  until the next read of the members, then becomes a ban if the partner is still listed and not
  ``leaving``, and is dropped otherwise. Leaving a run is not misbehaving;
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

The robust clip blames relative to our own recent norms, so they are kept here too.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from swarm.gossip._handshake import BANNED_REASON, Reply
from swarm.gossip._metrics import MetricsRecorder
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import BanList, PartnerInfo
from swarm.gossip._protocol import MsgKind
from swarm.gossip._robust import ClipStats
from swarm.gossip._suspicion import Suspicions, Verdict

logger = logging.getLogger(__name__)

HOLD_S = 5.0
"""A failure is judged this long after it happened at the earliest: time for a leaving partner's record
to say so."""


class Reputation:
    """Bans, strikes and forgiveness for one averager; counts its verdicts in ``metrics``.

    ``also`` is another averager's ban list that this one honours (read only), e.g. a trainer's
    parameter exchange honouring the bans of its pseudo-gradient exchange. Thread-safe as the ban
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
        self._own_norms: collections.deque[float] = collections.deque(maxlen=8)
        self._held: dict[str, tuple[str, float]] = {}  # peer: (failure, when), judged by review()
        self._suspicions = Suspicions(float(options.clip_strikes))
        self._clock = clock
        self._lock = threading.Lock()

    def is_banned(self, peer: str) -> bool:
        """Banned, or a failure of its is held: either way, not a partner for now."""
        with self._lock:
            if peer in self._held:
                return True
        return self.bans.is_banned(peer)

    def banned(self) -> dict[str, float]:
        """Banned peers and the seconds left on each ban; held ones with the ban they would get."""
        banned = self.bans.banned()
        with self._lock:
            held = list(self._held)
        return {**{peer: self.bans.next_duration(peer) for peer in held}, **banned}

    def review(self, partners: Sequence[PartnerInfo]) -> None:
        """Judge the failures held for ``HOLD_S`` against a fresh read of the members: a partner still
        listed, and not leaving, is banned; one that left (or says it is leaving) is not."""
        now = self._clock()
        with self._lock:
            held = {peer: reason for peer, (reason, at) in self._held.items() if now - at >= HOLD_S}
            for peer in held:
                del self._held[peer]
        staying = {info.peer_id for info in partners if not info.leaving}
        for peer, reason in held.items():
            if peer in staying:
                self.bans.ban(peer, reason)
            else:
                logger.info("not banning %s, which left the run: %s", peer, reason)

    def reasons(self) -> dict[str, str]:
        """Why each peer of :meth:`banned` is excluded: its ban's reason, or the failure held against it."""
        reasons = self.bans.reasons()
        with self._lock:
            held = {peer: reason for peer, (reason, _) in self._held.items()}
        return {**held, **reasons}

    def norm_reference(self) -> float:
        """The largest norm we were judged against, or moved by a model exchange's mix, in recent
        exchanges: what the robust clip blames relative to (``swarm.gossip._robust``)."""
        return max(self._own_norms, default=0.0)

    def failed(self, peer: str, reason: str) -> None:
        """An exchange with ``peer`` failed through its fault: hold it toward a ban (see :meth:`review`)."""
        with self._lock:
            self._held.setdefault(peer, (reason, self._clock()))

    def misbehaved(self, peer: str, reason: str) -> None:
        """``peer`` sent bad data: ban it now, whatever its record says (module docstring)."""
        with self._lock:
            self._held.pop(peer, None)
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

    def committed(self, peer: str, clip: ClipStats | None, companion: ClipStats | None = None) -> None:
        """An exchange with ``peer`` committed: judge its parts (module docstring).

        ``companion``: the clip of the exchange's companion part, judged alike (a hard part counts,
        once; else the larger excess); only the first part's norm is remembered as ours. No blame
        before we know our own usual norm: a first, tiny warm-up update looks like a victim.
        """
        knows_own_norm = bool(self._own_norms)
        if clip is not None:
            self._own_norms.append(max(clip.own_norm, clip.moved))
        clips = [(what, c) for what, c in (("update", clip), ("companion part", companion)) if c is not None]
        if not clips:
            self.bans.forgive(peer)
            return
        if any(c.clipped for _, c in clips):
            self._metrics.count("clipped")
        judged = [(what, c) for what, c in clips if c.judged]
        if not judged:
            return
        what, worst = max(judged, key=lambda part: (part[1].hard, part[1].excess))
        if worst.hard and knows_own_norm:
            self._metrics.count("suspect")
            excess = worst.excess
            logger.warning("suspicious partner %s: its %s was %.3gx our plausible radius", peer, what, excess)
        verdict, why = self._suspicions.judge(peer, worst.excess, worst.hard, blame=knows_own_norm)
        if verdict is Verdict.BAN:
            last = f"its {what} was {worst.excess:.3g}x our plausible radius (clipped to {worst.scale:.3g})"
            self.bans.ban(peer, f"suspicious exchanges: {why}; the last: {last}")
        elif verdict is Verdict.FORGIVE:
            self.bans.forgive(peer)
