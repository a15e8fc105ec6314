"""Reputation: which partners an averager trusts, and the verdicts that change it.

The rules (docs/gossip.md, "Never a stall" and "Malicious partners"), on top of a :class:`BanList`:

- an exchange or a handshake that failed through the partner's fault bans it (exponential backoff);
- BUSY costs nothing; a REJECT saying that it banned *us* does not ban it back: that is no evidence
  against it (perhaps the failure was ours), and banning back would keep the pair apart long after
  its ban on us expired;
- a committed exchange whose partner difference the robust clip cut hard makes the partner
  *suspect*; ``clip_strikes`` suspicions in a row ban it;
- any other committed exchange forgives the partner (its strikes and suspicions are cleared).

The robust clip blames relative to our own recent norms, so they are kept here too.
"""

from __future__ import annotations

import collections

from swarm.gossip._handshake import BANNED_REASON, Reply
from swarm.gossip._metrics import MetricsRecorder
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import BanList
from swarm.gossip._protocol import MsgKind
from swarm.gossip._robust import ClipStats


class Reputation:
    """Bans, strikes and forgiveness for one averager; counts its verdicts in ``metrics``.

    ``also`` is another averager's ban list that this one honours (read only), e.g. a trainer's
    parameter exchange honouring the bans of its pseudo-gradient exchange. Thread-safe as the ban
    list is, except :meth:`committed`, which runs under the averager's exchange lock.
    """

    def __init__(self, options: GossipOptions, metrics: MetricsRecorder, also: BanList | None = None) -> None:
        self.bans = BanList(options.ban_base_s, options.ban_max_s, also=also)
        self._clip_strikes = options.clip_strikes
        self._metrics = metrics
        self._own_norms: collections.deque[float] = collections.deque(maxlen=8)

    def is_banned(self, peer: str) -> bool:
        return self.bans.is_banned(peer)

    def norm_reference(self) -> float:
        """The largest norm we sent in recent exchanges: what the robust clip blames relative to."""
        return max(self._own_norms, default=0.0)

    def failed(self, peer: str, reason: str) -> None:
        """An exchange with ``peer`` failed through its fault: ban it."""
        self.bans.ban(peer, reason)

    def answered(self, peer: str, reply: Reply) -> None:
        """``peer`` did not accept our HELLO: judge the answer (or the failure) and count it."""
        if reply.kind is MsgKind.BUSY:
            self._metrics.count("busy")
            return
        if reply.kind is None:
            self.bans.ban(peer, f"dial/handshake failed: {reply.reason}")
        elif reply.reason != BANNED_REASON:
            self.bans.ban(peer, f"refused the handshake: {reply.reason}")
        self._metrics.count("failed")

    def committed(self, peer: str, clip: ClipStats | None) -> None:
        """An exchange with ``peer`` committed: suspect it if clipped hard, else forgive it.

        No blame before we know our own usual norm: a first, tiny warm-up update looks like a victim.
        """
        knows_own_norm = bool(self._own_norms)
        if clip is not None:
            self._own_norms.append(clip.own_norm)
            if clip.clipped:
                self._metrics.count("clipped")
            if clip.hard and knows_own_norm:
                self._metrics.count("suspect")
                reason = f"its update was {clip.excess:.3g}x our clip radius (clipped to {clip.scale:.3g})"
                self.bans.suspect(peer, reason, self._clip_strikes)
                return
        self.bans.forgive(peer)
