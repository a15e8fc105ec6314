"""Exchanges in the simulator: who meets whom at a round's end, what crosses the links, and what each
side applies when it lands (the arithmetic is in ``scripts/_sim_rules.py``).

Rounds are not aligned: the peer whose round ends first initiates; its partner offers its progress so
far (its round is cut short, and it uses the result too), and both leave with round
``max(r_i, r_j) + 1``. A peer takes part in one exchange at a time; one that lags ``max_lag`` rounds
waits for it. The partner is the one the initiator's membership view schedules
(``scripts/_sim_views.py``: the hypercube partner of its full view, or the one found by lookup),
else a random candidate of that view that is live and free (a dead one costs a round trip, a busy one
a dial), ``max_attempts`` at most; with none, the peer takes its own outer step alone. With
``clock_round_s`` the schedule's round is the shared clock's instead (the time of the round's end
over it, rounded), and exchanges leave it alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from scripts._sim_host import Counters, Host
from scripts._sim_net import Network
from scripts._sim_peer import Peer, Prefetch, World
from scripts._sim_rules import Rule, Tensors, clone, factored_anchor, pair_mean, rebase
from scripts._sim_views import Views
from scripts._sim_wire import message_bytes, through


class Simulated(Host, Protocol):
    """What an exchange reads and drives of the simulation."""

    rule: Rule
    views: Views
    net: Network
    world: World
    counters: Counters

    def live(self) -> list[Peer]: ...

    def schedule_step(self, peer: Peer) -> None: ...

    def start_round(self, peer: Peer) -> None: ...


@dataclass
class Exchange:
    """One pair's exchange in flight: per side its snapshot, what it sent (as decoded), the new error
    feedback residual to keep if it commits, and (factored) the partner's anchor it uses."""

    kind: str
    sides: tuple[Peer, Peer]
    started: float
    snapshot: dict[str, Tensors] = field(default_factory=dict)
    sent: dict[str, Tensors] = field(default_factory=dict)
    residual: dict[str, Tensors] = field(default_factory=dict)
    seen_anchor: dict[str, Tensors] = field(default_factory=dict)
    lands: float = 0.0


def usable_prefetch(receiver: Peer, sender: Peer) -> Prefetch | None:
    """``sender``'s anchor as ``receiver`` holds it, if it is ``sender``'s current one (else None: a
    stale copy must not be used, or the anchor's change would count twice)."""
    got = receiver.prefetched.get(sender.pid)
    return got if got is not None and got.version == sender.version else None


def shared_base(a: Peer, b: Peer, now: float) -> Prefetch | None:
    """The base ``a`` and ``b`` both hold under one id and that has landed by ``now``, else None."""
    mine, theirs = a.bases.get(b.pid), b.bases.get(a.pid)
    if mine is None or theirs is None or mine.version != theirs.version or mine.lands > now:
        return None
    return mine


def apply_exchange(ex: Exchange) -> None:
    """Commit ``ex`` on both sides: the new anchor, the progress since the snapshot, error feedback."""
    a, b = ex.sides
    for me, other in ((a, b), (b, a)):
        if ex.kind == "factored":
            anchor = factored_anchor(me.anchor, ex.seen_anchor[me.pid], ex.sent[me.pid], ex.sent[other.pid])
        else:  # the whole model: our own snapshot exactly, the partner's as it arrived
            anchor = pair_mean(ex.snapshot[me.pid], ex.sent[other.pid])
        rebase(me.params, anchor, ex.snapshot[me.pid])
        me.set_anchor(anchor)
        if me.pid in ex.residual:
            me.residual = ex.residual[me.pid]


class Exchanges:
    def __init__(self, sim: Simulated) -> None:
        self.sim = sim
        self.rule = sim.rule
        self._barrier: list[Peer] = []
        self._reducing = False
        self._base_id = 0

    # -- anchors ahead of time (factored) --------------------------------------------------------

    def scheduled(self, peer: Peer) -> str | None:
        return self.sim.views.scheduled(peer)

    def push_base(self, peer: Peer) -> None:
        """``based``: our exchange landed; if we are the pusher of our next scheduled pair, send our
        anchor as the pair's base (both sides keep the same decoded copy, under one id)."""
        self._clock_round(peer, ahead=True)  # the pair of our next round's end
        target = self.sim.peers.get(self.scheduled(peer) or "")
        if target is None or not peer.alive or (target.pid, peer.version) in peer.prefetch_sent:
            return
        peer.prefetch_sent.add((target.pid, peer.version))
        if not self.sim.views.pushes(peer, target.pid):
            return  # the partner pushes
        nbytes = message_bytes(self.rule.model_wire, self.sim.world.shapes)
        lands = self.sim.net.send(peer.pid, target.pid, nbytes, self.sim.clock.now)
        peer.bytes_overlapped += nbytes
        self._base_id += 1
        seen, _ = through(self.rule.model_wire, peer.anchor)
        base = Prefetch(self._base_id, seen, lands)
        peer.bases[target.pid] = base
        if target.alive:
            target.bases[peer.pid] = base

    def prefetch(self, peer: Peer) -> None:
        """Send our anchor to the partner our view schedules for this round's end, once per version."""
        if self.rule.kind == "based" and peer.exchange is None:
            self.push_base(peer)
            return
        if self.rule.kind != "factored" or peer.exchange is not None or not peer.alive:
            return
        self._clock_round(peer, ahead=True)  # the pair of our next round's end
        target = self.sim.peers.get(self.scheduled(peer) or "")
        if target is None or (target.pid, peer.version) in peer.prefetch_sent:
            return
        peer.prefetch_sent.add((target.pid, peer.version))
        nbytes = message_bytes(self.rule.model_wire, self.sim.world.shapes)
        lands = self.sim.net.send(peer.pid, target.pid, nbytes, self.sim.clock.now)
        peer.bytes_overlapped += nbytes
        if target.alive:
            seen, _ = through(self.rule.model_wire, peer.anchor)
            target.prefetched[peer.pid] = Prefetch(peer.version, seen, lands)

    # -- a round's end ----------------------------------------------------------------------------

    def round_end(self, peer: Peer) -> None:
        now = self.sim.clock.now
        if self.rule.kind == "allreduce":
            peer.start_wait("barrier", now)
            self._barrier.append(peer)
            self._try_reduce()
        elif peer.exchange is not None:
            if peer.lag < self.rule.max_lag:
                peer.lag += 1
                self.sim.start_round(peer)
            else:
                peer.start_wait("initiate", now)
        else:
            self.initiate(peer)

    def _clock_round(self, peer: Peer, ahead: bool) -> None:
        """With ``clock_round_s``: set the peer's schedule round by the shared clock, for a round that
        ends now or (``ahead``) for its next round's end at its step time."""
        period = self.sim.cfg.clock_round_s
        if period:
            steps_left = max(0, self.rule.sync_every - peer.round_steps) if ahead else 0
            peer.round = round((self.sim.clock.now + steps_left * peer.step_time) / period)

    def _dial_s(self) -> float:
        dial = self.sim.cfg.dial_s
        return 2 * self.sim.cfg.latency_s if dial is None else dial

    def _choose(self, peer: Peer) -> tuple[Peer | None, float, bool]:
        """A partner, the seconds spent dialling ones that were gone or busy, and whether it was the
        scheduled one."""
        sim, delay = self.sim, 0.0
        self._clock_round(peer, ahead=False)
        first = self.scheduled(peer)
        rest = [pid for pid in sim.views.candidates(peer) if pid not in (peer.pid, first)]
        sim.rng.shuffle(rest)
        for pid in ([first] if first else []) + rest[: sim.cfg.max_attempts]:
            other = sim.peers.get(pid)
            if other is None or not other.alive:
                sim.views.failed(peer, pid)
                delay += 2 * sim.cfg.latency_s
                continue
            if other.exchange is not None or other.waiting == "barrier":
                delay += self._dial_s()
                continue
            return other, delay, pid == first
        return None, delay, False

    def initiate(self, me: Peer) -> None:
        sim, now = self.sim, self.sim.clock.now
        sim.counters.initiated += 1
        other, delay, scheduled = self._choose(me)
        if other is None:  # alone: an outer step on our own pseudo-gradient (lr 1: a <- x)
            sim.counters.solo += 1
            me.set_anchor(me.params)
            sim.start_round(me)
            return
        sim.counters.paired += 1
        sim.counters.scheduled += scheduled
        sim.views.on_exchange(me, other)
        other.rounds += 1
        ex = self._build(me, other, now + delay + self._dial_s() + sim.cfg.exchange_overhead_s)
        round_ = max(me.round, other.round) + 1
        for side in (me, other):
            side.exchange, side.lag, side.round_steps = ex, 0, 0
            if not sim.cfg.clock_round_s:  # clocked rounds are the clock's
                side.round = round_
        if self.rule.max_lag == 0:
            me.start_wait("step", now)
            other.blocked = True
            if not other.step_pending and other.waiting is None:
                other.start_wait("step", now)
        else:
            sim.start_round(me)
        sim.clock.at(ex.lands, self._land, ex)

    def _build(self, a: Peer, b: Peer, start: float) -> Exchange:
        """The exchange's messages, sent from ``start``: Δ when both hold the other's current anchor,
        else (a fallback) the whole model."""
        rule, sim = self.rule, self.sim
        got = {a.pid: usable_prefetch(a, b), b.pid: usable_prefetch(b, a)}
        factored = rule.kind == "factored" and all(got.values())
        base = None
        if rule.kind == "based":  # a base still crossing is waited for, up to half a round
            wait = self.sim.cfg.base_wait_rounds * rule.sync_every * min(a.step_time, b.step_time)
            base = shared_base(a, b, start + wait)
            if base is not None:
                start = max(start, base.lands)
        kind = "factored" if factored else "late"
        if rule.kind in ("factored", "based") and not (factored or base is not None):
            sim.counters.fallbacks += 1
        ex = Exchange(kind, (a, b), sim.clock.now)
        wire = rule.delta_wire if factored or base is not None else rule.model_wire
        lands = start
        for me, other in ((a, b), (b, a)):
            ex.snapshot[me.pid] = me.snapshot()
            if base is not None:  # x - B through the delta codec, B added back: the model as received
                residual = me.residual if rule.error_feedback else None
                change = {n: t - base.anchor[n] for n, t in ex.snapshot[me.pid].items()}
                decoded, dropped = through(wire, change, residual)
                ex.sent[me.pid] = {n: t + base.anchor[n] for n, t in decoded.items()}
                if rule.error_feedback:
                    ex.residual[me.pid] = dropped
            elif factored:
                residual = me.residual if rule.error_feedback else None
                ex.sent[me.pid], dropped = through(wire, me.delta(), residual)
                if rule.error_feedback:
                    ex.residual[me.pid] = dropped
                prefetch = got[me.pid]
                assert prefetch is not None
                ex.seen_anchor[me.pid] = prefetch.anchor
                lands = max(lands, prefetch.lands)
            else:
                ex.sent[me.pid], _ = through(wire, ex.snapshot[me.pid])
            nbytes = message_bytes(wire, sim.world.shapes)
            lands = max(lands, sim.net.send(me.pid, other.pid, nbytes, start))
            me.bytes_critical += nbytes
        ex.lands = lands + sim.cfg.latency_s  # the commit's acknowledgement
        return ex

    def _land(self, ex: Exchange) -> None:
        sim = self.sim
        a, b = ex.sides
        if a.alive and b.alive:
            apply_exchange(ex)
            sim.counters.committed += 1
            sim.counters.factored += ex.kind == "factored"
            sim.counters.exchange_s.append(sim.clock.now - ex.started)
        else:  # the partner died: nothing commits (the snapshot and the residual are dropped)
            sim.counters.aborted += 1
        for side in ex.sides:
            side.exchange = None
            side.blocked = False
            if side.alive:
                self._resume(side)

    def _resume(self, peer: Peer) -> None:
        reason = peer.end_wait(self.sim.clock.now)
        if reason == "initiate":
            self.initiate(peer)
        else:  # a blocking exchange ended (the device trains again) or one landed mid-round
            self.prefetch(peer)
            if reason == "step":
                self.sim.schedule_step(peer)

    def on_leave(self, peer: Peer) -> None:
        """A peer died: the all-reduce goes on without it; its exchange aborts when it would land."""
        if peer in self._barrier:
            self._barrier.remove(peer)
        self._try_reduce()

    # -- exact all-reduce -------------------------------------------------------------------------

    def _try_reduce(self) -> None:
        live = self.sim.live()
        if self._reducing or not live or any(p.waiting != "barrier" for p in live):
            return
        self._reducing = True
        nbytes = message_bytes(self.rule.model_wire, self.sim.world.shapes)
        share = self.sim.net.ring_allreduce_s(len(live), nbytes)
        for peer in live:
            peer.bytes_critical += 2 * (len(live) - 1) / len(live) * nbytes
        self.sim.clock.after(share, self._reduce)

    def _reduce(self) -> None:
        self._reducing = False
        live = [p for p in self._barrier if p.alive]
        self._barrier = []
        deltas = [p.delta() for p in live]
        mean = {n: sum(d[n] for d in deltas) / len(deltas) for n in deltas[0]}
        for peer in live:
            anchor = {n: peer.anchor[n] - mean[n] for n in mean}
            rebase(peer.params, anchor, clone(peer.params))
            peer.set_anchor(anchor)
            peer.end_wait(self.sim.clock.now)
            self.sim.start_round(peer)
