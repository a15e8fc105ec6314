"""The simulation: peers stepping on their own clocks, rounds, churn, membership views, evaluation.

Each peer's inner steps take its own ``step_time`` (times a log-normal jitter); every ``H`` steps its
round ends and the rule's exchange starts (``scripts/_sim_exchange.py``). Churn removes a random live
peer at ``churn_per_min`` of N per minute (a Poisson process) and a fresh one joins ``join_delay_s``
later from a live peer's anchor. Each peer refreshes its view of the membership every
``view_refresh_s`` in the design ``view`` (``scripts/_sim_views.py``: the whole list, a bounded sample,
or partners found by lookup; a dead peer's record stays listed for ``record_ttl_s``), and computes its
partner from that view: peers whose views differ disagree on the schedule.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import torch

from scripts._sim_exchange import Exchanges
from scripts._sim_host import Counters, SimConfig
from scripts._sim_net import Clock, Network
from scripts._sim_peer import Peer, World, step_times
from scripts._sim_rules import spread
from scripts._sim_views import make_views
from swarm.learning import lr_at


class Simulation:
    def __init__(
        self, cfg: SimConfig, world: World | None = None, progress: Callable[[str], None] | None = None
    ):
        self.cfg = cfg
        self.rule = cfg.rule
        sets = [*cfg.model_sets, f"run.seed={cfg.seed}"]  # the seed draws the init and the data order too
        self.world = world or World(sets, training=cfg.training, lr=cfg.lr)
        self.rng = random.Random(cfg.seed)
        self.clock = Clock()
        self.net = Network(cfg.rate_mbit * 1e6 / 8 * cfg.goodput, cfg.latency_s)
        self.counters = Counters()
        self.progress = progress
        self.samples = 0
        self.curve: list[tuple[int, float, float | None, float]] = []
        self.samples_to_target: int | None = None
        self.time_to_target: float | None = None
        self._next_eval = self._eval_every()
        self._serial = 0
        self.peers: dict[str, Peer] = {}
        self.everyone: list[Peer] = []
        self.views = make_views(cfg.view, self)
        torch.manual_seed(cfg.seed)
        for step_time in step_times(cfg.step_times, cfg.peers, self.rng):
            self._add(step_time, None)
        self.exchanges = Exchanges(self)
        for peer in self.live():
            self._perturb(peer)
        for peer in self.live():
            self.views.start(peer, joining=False)

    # -- membership ---------------------------------------------------------------------------------

    def _add(self, step_time: float, anchor: dict[str, torch.Tensor] | None) -> Peer:
        pid = f"peer-{self._serial}"
        self._serial += 1
        peer = self.world.peer(pid, step_time, self.clock.now, anchor)
        self.peers[pid] = peer
        self.everyone.append(peer)
        self.views.add(peer)
        return peer

    @torch.no_grad()
    def _perturb(self, peer: Peer) -> None:
        if self.cfg.init_spread > 0:
            for param in peer.params.values():
                param.add_(torch.randn_like(param) * self.cfg.init_spread * (param.abs().mean() + 1e-3))
            peer.set_anchor(peer.params)

    def live(self) -> list[Peer]:
        return [p for p in self.peers.values() if p.alive]

    def _refresh_view(self, peer: Peer) -> None:
        if not peer.alive:
            return
        self.views.refresh(peer)
        self.exchanges.prefetch(peer)
        self.clock.after(self.cfg.view_refresh_s, self._refresh_view, peer)

    def _leave(self) -> None:
        candidates = self.live()
        if len(candidates) > 2:
            peer = self.rng.choice(candidates)
            peer.alive, peer.died = False, self.clock.now
            peer.end_wait(self.clock.now)
            self.counters.left += 1
            self.views.left(peer)
            self.exchanges.on_leave(peer)
            self.clock.after(self.cfg.join_delay_s, self._join, peer.step_time)
        self.clock.after(self._churn_gap(), self._leave)

    def _join(self, step_time: float) -> None:
        donor = self.rng.choice(self.live())
        peer = self._add(step_time, donor.anchor)
        peer.round = donor.round
        self.views.start(peer, joining=True)
        self.counters.joined += 1
        self.clock.after(self.rng.uniform(0, self.cfg.view_refresh_s), self._refresh_view, peer)
        self.start_round(peer)

    def _churn_gap(self) -> float:
        rate = self.cfg.churn_per_min * self.cfg.peers / 60.0
        return self.rng.expovariate(rate)

    # -- the device ---------------------------------------------------------------------------------

    def lr(self) -> float:
        train = self.world.config.train
        if self.cfg.cosine:
            n = self.cfg.peers
            return lr_at(self.samples // n, train, self.cfg.samples // n)
        return lr_at(self.samples, train, None)

    def schedule_step(self, peer: Peer) -> None:
        jitter = self.rng.lognormvariate(0.0, self.cfg.step_jitter) if self.cfg.step_jitter else 1.0
        peer.step_pending = True
        self.clock.after(peer.step_time * jitter, self._step_done, peer)

    def start_round(self, peer: Peer) -> None:
        peer.round_steps = 0
        self.exchanges.prefetch(peer)
        self.schedule_step(peer)

    def _step_done(self, peer: Peer) -> None:
        peer.step_pending = False
        if not peer.alive:
            return
        if peer.trainer is not None and peer.batches is not None:
            peer.trainer.step(peer.batches, lr=self.lr())
        peer.steps += 1
        peer.round_steps += 1
        self.samples += 1
        if self.samples >= self._next_eval:
            self._evaluate()
        if self.samples >= self.cfg.samples or self.clock.stopped:
            self.clock.stop()
            return
        if peer.blocked:
            peer.start_wait("step", self.clock.now)
        elif peer.round_steps >= self.rule.sync_every:
            peer.rounds += 1
            self.exchanges.round_end(peer)
        else:
            self.schedule_step(peer)

    # -- evaluation ---------------------------------------------------------------------------------

    def _eval_every(self) -> int:
        return self.cfg.eval_every or max(1, self.cfg.samples // 24)

    def _evaluate(self) -> None:
        self._next_eval += self._eval_every()
        live = self.live()
        loss = None
        if self.cfg.curve_batches:
            of = self.world.mean_loss if self.cfg.peer_curve else self.world.loss_of_mean
            loss = of(live, self.cfg.curve_batches)
        models = [{n: p.detach() for n, p in peer.params.items()} for peer in live]
        self.curve.append(
            (self.samples, round(self.clock.now, 2), loss and round(loss, 4), float(f"{spread(models):.4g}"))
        )
        if loss is not None and loss <= self.cfg.target and self.samples_to_target is None:
            self._reached(loss)
            if self.cfg.stop_at_target:
                self.clock.stop()
        if self.progress is not None:
            self.progress(
                f"{self.samples}/{self.cfg.samples} samples, t={self.clock.now:.0f} s, loss {loss}, "
                f"spread {self.curve[-1][3]}"
            )

    def _reached(self, loss: float) -> None:
        """The first crossing of the target, interpolated from the curve's point before (as the
        testbed's ``scripts/_rows.py crossing`` does)."""
        samples, now = float(self.samples), self.clock.now
        before = self.curve[-2] if len(self.curve) > 1 else None
        if before is not None and before[2] is not None and before[2] > loss:
            share = (before[2] - self.cfg.target) / (before[2] - loss)
            samples, now = before[0] + share * (samples - before[0]), before[1] + share * (now - before[1])
        self.samples_to_target, self.time_to_target = round(samples), round(now, 2)

    # -- running ------------------------------------------------------------------------------------

    def run(self) -> dict:
        for peer in self.live():
            self.clock.after(self.rng.uniform(0, self.cfg.view_refresh_s), self._refresh_view, peer)
            self.start_round(peer)
        if self.cfg.churn_per_min > 0:
            self.clock.after(self._churn_gap(), self._leave)
        self.clock.run()
        return self.report()

    def report(self) -> dict:
        live = self.live()
        final = self.world.loss_of_mean(live, self.cfg.eval_batches) if self.cfg.eval_batches else None
        now = self.clock.now
        alive_s = [max(1e-9, (p.died if p.died is not None else now) - p.born) for p in self.everyone]
        idle = [p.idle_s / s for p, s in zip(self.everyone, alive_s, strict=True)]
        rounds = sum(p.rounds for p in self.everyone) or 1
        per_round = self.world.n_params * rounds
        c = self.counters
        alive_total = sum(alive_s)
        return {
            "final_loss": final and round(final, 4),
            "samples": self.samples,
            "sim_time_s": round(now, 2),
            "samples_to_target": self.samples_to_target,
            "time_to_target_s": self.time_to_target,
            "bytes_per_param_per_round": {
                "overlapped": round(sum(p.bytes_overlapped for p in self.everyone) / per_round, 3),
                "critical": round(sum(p.bytes_critical for p in self.everyone) / per_round, 3),
            },
            "idle_share": {
                "mean": round(sum(p.idle_s for p in self.everyone) / sum(alive_s), 4),
                "max": round(max(idle), 4),
            },
            "pairing": {
                "initiated": c.initiated,
                "paired": c.paired,
                "scheduled_partner": c.scheduled,
                "success": round(c.paired / c.initiated, 3) if c.initiated else None,
            },
            "exchanges": {
                "committed": c.committed,
                "factored": c.factored,
                "fallbacks": c.fallbacks,
                "aborted": c.aborted,
                "mean_s": round(sum(c.exchange_s) / len(c.exchange_s), 3) if c.exchange_s else None,
            },
            "churn": {"left": c.left, "joined": c.joined},
            "membership": {
                "view": self.cfg.view,
                "bytes_per_peer_s": round(
                    sum(p.membership_sent + p.membership_received for p in self.everyone) / alive_total
                ),
                "sent_per_peer_s": round(sum(p.membership_sent for p in self.everyone) / alive_total),
                "hottest_key_served_s": round(max(self.views.served.values(), default=0.0) / max(now, 1e-9)),
            },
            "steps_per_peer": {"min": min(p.steps for p in live), "max": max(p.steps for p in live)},
            "n_params": self.world.n_params,
            "curve": self.curve,
        }


def geometric_rate(curve: list[tuple[int, float, float | None, float]]) -> float:
    """The mean factor by which the spread shrinks per curve point (fitted on its logs)."""
    points = [(i, math.log(s)) for i, (_, _, _, s) in enumerate(curve) if s > 0]
    if len(points) < 2:
        return 1.0
    (i0, l0), (i1, l1) = points[0], points[-1]
    return math.exp((l1 - l0) / (i1 - i0))
