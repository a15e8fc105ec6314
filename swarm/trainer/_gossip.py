"""``averaging.backend: gossip``: quantized gossip DiLoCo with overlapped, mass-conserving exchanges.

A round ends after ``sync_every_steps`` inner steps (or ``sync_every_seconds``). Then the sync worker
exchanges with one live partner in the background while the training thread goes on with the next
round; the result is applied when it lands, keeping the local progress made meanwhile
(:mod:`swarm.trainer._live`). A partner that dials us gets a snapshot and we apply the result too
(:mod:`swarm.trainer._offers`): every exchange is a round for both sides. The device waits only when
our own exchange lags more than ``averaging.max_lag_rounds`` rounds behind (0: a blocking sync).

An exchange averages the pair's models in one tensor set each way, so every exchange is a consensus
step, and ``averaging.partners: hypercube`` picks the partner by dimension exchange over the live
trainers (docs/gossip.md, "The rule"): of a scheduled pair, the member earlier in the shared order
dials and the other waits a moment to be dialled before it dials anyone itself. While a round
trains, one member of the next pair pushes its anchor to the other as their shared base, so that the
round's exchange sends only each model's change from it.

A second averager exchanges anchors: only for a joiner that adopts a partner's state. The backend
also owns the state server that joiners download from, and joining itself.
"""

from __future__ import annotations

import contextlib
import logging
import time
from contextlib import AbstractContextManager
from typing import Any

import torch

from swarm._device import map_large_allocations
from swarm.gossip import ExchangeMetrics, GossipAverager, PartnerInfo, SyncOutcome
from swarm.learning import OuterOptimizer
from swarm.state import StateServer
from swarm.trainer._backend import (
    BackendContext,
    JoinResult,
    RoundResult,
    outer_state_device,
)
from swarm.trainer._checkpoints import checkpoint_dir_of
from swarm.trainer._joining import JOIN_WEIGHT, adopt_a_partner, download_swarm_state, publish_state
from swarm.trainer._joining import other_trainers as others
from swarm.trainer._live import LiveModel, Update
from swarm.trainer._offers import ANCHOR_WEIGHT, AnchorOffers, ModelOffers
from swarm.trainer._report import add_metrics, round_of
from swarm.trainer._schedule import Pace, Slot, slot_of, trainer_partners
from swarm.trainer._sync import SyncWorker, make_averager

logger = logging.getLogger(__name__)

SERVE_SHARE = 0.5
"""A partner is served at most once per this share of a round at the device's pace: once a round,
with room for rounds that vary."""
SCHEDULE_GRACE = 0.5
"""Of a scheduled pair, the member that waits to be dialled waits at most this share of a round at
the device's pace (and a quarter of ``exchange_timeout_s``) before it dials a partner itself."""
BASE_WAIT_SHARE = 0.5
"""An exchange waits at most this share of a round for a base still crossing between the pair:
without it the pair sends whole models, which crowd the links the base is on."""


class GossipBackend:
    """Model gossip with scheduled partners and shared bases; the outer step moves to the pair's mean."""

    def __init__(self, context: BackendContext) -> None:
        self._context, self._config, self._node = context, context.config, context.node
        self._namespace = context.group.suffix if context.group is not None else ""
        self._run_id = self._config.run.run_id + self._namespace
        avg = context.config.averaging
        map_large_allocations()  # an exchange's copies go back to the system when freed
        self.outer = OuterOptimizer.from_config(context.model, avg, state_device=outer_state_device(context))
        self.live = LiveModel(
            context.model, self.outer, context.config.train.batch_size, before_change=self._invalidate_offers
        )
        self._model_offers = ModelOffers(self.live)
        self._anchor_offers = AnchorOffers(self.live)  # it only serves joiners
        self._every_steps, self._every_seconds = avg.sync_every_steps, avg.sync_every_seconds
        self._max_lag = avg.max_lag_rounds
        self._last_request = time.monotonic()
        self._pace = Pace(avg.sync_every_steps)
        self._scheduled: str | None = None
        self._adopted = True  # False: a fresh peer that could not take over a state yet
        self._rounds = dict.fromkeys(("initiator", "responder", "local"), 0)
        self.stalled_seconds = 0.0
        self._state_hash = ""
        self._joined_meta: dict[str, int] = {}
        self._publish_due = False
        self.models: GossipAverager | None = None
        self.anchors: GossipAverager | None = None
        self.state_server: StateServer | None = None
        self._worker: SyncWorker | None = None
        self._push_worker: SyncWorker | None = None
        try:
            self._make_averagers(client_mode=None)
            # a replaced state is served while the record naming it may still be read
            keep_s = self._config.network.record_ttl_s + 5.0
            self.state_server = StateServer(self._node.dht, self._run_id, keep_replaced_s=keep_s)
            self._worker = SyncWorker(self._own_round)
            if avg.partners == "hypercube":
                self._push_worker = SyncWorker(self._push_next_base, name="gossip-base")
            schema = {name: (tuple(p.shape), torch.float32) for name, p in context.model.named_parameters()}
            self._averagers()[0].expect_schema(schema)  # bases may be pushed to us before our first offer
        except BaseException:
            self.close()
            raise

    def _make_averagers(self, client_mode: bool | None) -> None:
        config, dht = self._config, self._node.dht
        space = self._namespace
        self.models = make_averager(config, dht, self._model_offers, namespace=space, client_mode=client_mode)
        self.anchors = make_averager(
            config,
            dht,
            self._anchor_offers,
            suffix=".params",
            namespace=space,
            codec=config.averaging.param_codec,
            client_mode=client_mode,
            respect_bans_of=self.models,  # a peer banned for its updates is not trusted with parameters
        )

    def _invalidate_offers(self) -> None:
        """Our anchor is about to change: the exchanges still reading it in place stop (the two
        averagers share one gate)."""
        if self.models is not None:
            self.models.invalidate()

    def _averagers(self) -> tuple[GossipAverager, GossipAverager]:
        """The model and anchor averagers, which exist from construction until :meth:`close`."""
        if self.models is None or self.anchors is None:
            raise RuntimeError("the gossip backend's averagers are closed")
        return self.models, self.anchors

    def _sync_worker(self) -> SyncWorker:
        if self._worker is None:
            raise RuntimeError("the gossip backend's sync worker is not running")
        return self._worker

    def _partners(self) -> list[PartnerInfo]:
        """The trainers a round may pair with, as the announcer last read them: a round reads no DHT.
        Two reads a round (the schedule's slot, then the sync) took a second or more on loaded links,
        all of it before the exchange; the list is at most one record interval old, and a partner that
        left since costs one failed dial."""
        return trainer_partners(self._of_our_group(self._node.recent_members()))

    def _members(self) -> list[Any]:
        """The live members we average with, read from the DHT now (joining wants the freshest)."""
        return self._of_our_group(self._node.members())

    def _of_our_group(self, members: list[Any]) -> list[Any]:
        """All of ``members``, or those of our group (``BackendContext.group``)."""
        group = self._context.group
        return members if group is None else [m for m in members if group.accepts(m.record)]

    def inner_optimizer(self) -> torch.optim.Optimizer | None:
        return None

    def update_guard(self) -> AbstractContextManager[Any]:
        return self.live.updating()

    # ------------------------------------------------------------------ joining

    def join(self, fresh: bool) -> JoinResult:
        """A fresh peer takes over the swarm's state: the donors' announced state, or else one partner's
        anchor through an anchor exchange at a negligible weight. Fresh or resumed, it then starts
        serving its own state to later joiners."""
        joined = None
        if fresh:
            model, run_id = self._context.model, self._run_id
            joined = download_swarm_state(self._node, self._members, model, self.live, run_id)
            if joined is None:
                me = self._node.peer_id
                adopted = adopt_a_partner(
                    self._averagers()[1], self._anchor_offers, self.live, lambda: others(self._members(), me)
                )
                self._set_adopted(adopted)
        self._joined_meta = joined.meta if joined is not None else {}
        self._publish_state()
        return joined or JoinResult()

    def _publish_state(self, wait: bool = True) -> None:
        """Serve our state to joiners and announce its digest (joiners ask for it in our record): at
        once when joining, in the background from the training thread."""
        if self.state_server is None:
            return
        directory = checkpoint_dir_of(self._config)
        spool = None if directory is None else str(directory)
        digest = publish_state(
            self.state_server, self.outer, self._context.progress, self._joined_meta, spool
        )
        if digest is None:
            return
        self._state_hash = digest
        if wait:
            self._node.announce_now()
        else:
            self._node.announce_soon()

    # ------------------------------------------------------------------ rounds (training thread)

    def after_step(self, samples: int) -> list[RoundResult]:
        self._pace.step(time.monotonic())
        if self._publish_due:  # the core booked the last rounds: the published progress includes them
            self._publish_due = False
            self._publish_state(wait=False)
        return self._apply()

    def sync_due(self) -> bool:
        """A round is due; and either no exchange of ours is running, or it lags too far behind."""
        steps = self.live.steps
        timed = (
            self._every_seconds is not None and time.monotonic() - self._last_request >= self._every_seconds
        )
        if steps == 0 or not (steps >= self._every_steps or timed):
            return False
        return not self._sync_worker().busy or steps >= self._every_steps * (1 + self._max_lag)

    def sync_round(self) -> list[RoundResult]:
        """Start our exchange in the background; wait only when blocking or lagging too far."""
        if self._sync_worker().request():
            self._last_request = time.monotonic()
            if self._max_lag > 0:
                return []
        started = time.monotonic()
        self._sync_worker().wait_idle()
        stalled = time.monotonic() - started
        self.stalled_seconds += stalled
        self._pace.stalled(stalled)
        return self._apply()

    def _apply(self) -> list[RoundResult]:
        rounds = []
        updates = self.live.apply_pending()
        if self._push_worker is not None and any(update.kind == "model" for update in updates):
            self._push_worker.request()  # our anchor moved, and the schedule with it: the next base
        for update in updates:
            info = update.info
            if info.get("drift") is not None:  # exact (anchor exchange) or sampled (the probe)
                self._context.progress.drift = info["drift"]
            if update.kind == "anchor":
                continue
            rounds.append(round_of(update))
            self._rounds[rounds[-1].role] += 1
        if rounds:
            self._publish_due = True
        return rounds

    # ------------------------------------------------------------------ our own round (sync worker)

    def _set_adopted(self, adopted: bool) -> None:
        """Whether we hold the swarm's state. Until we do, partners get nothing from us (they would
        judge our seed an attacker's push, and we theirs), and each round tries the adoption again."""
        self._adopted = adopted
        self._model_offers.accepting = adopted

    def _adopt_again(self) -> None:
        """One more try to take over a partner's state, as joining does; the anchor update it queues is
        applied by the training thread."""
        me = self._node.peer_id
        if not others(self._members(), me):
            logger.info("no other trainers left to adopt from: our state is the swarm's")
            self._set_adopted(True)
            return
        self._anchor_offers.weight = JOIN_WEIGHT
        try:
            result = self._averagers()[1].sync(self._partners())
        finally:
            self._anchor_offers.weight = ANCHOR_WEIGHT
        if result.outcome is SyncOutcome.OK:
            logger.info("adopted the parameters of %s", result.partner)
            self._set_adopted(True)
        else:
            logger.info("adopting a live peer's state: %s; trying again next round", result.reason)

    def _own_round(self) -> None:
        """One exchange as initiator; an outer step on our own when nobody took part."""
        now = time.monotonic()
        self._pace.round(now)
        round_s = self._pace.nominal_round_s()
        for averager in self._averagers():  # a partner gets one exchange of ours per round
            averager.serve_interval_s = SERVE_SHARE * round_s
            averager.base_wait_s = BASE_WAIT_SHARE * round_s
        if not self._adopted:
            self._adopt_again()
            return
        if self._config.averaging.partners == "hypercube" and self._schedule_says_wait():
            timeout = self._config.averaging.exchange_timeout_s
            grace = min(SCHEDULE_GRACE * round_s, timeout / 4)
            self.live.wait_queued(grace)  # then sync() finds nothing to offer: the partner's exchange did it
        if self._push_worker is not None and self._push_worker.busy:  # our base to a partner is crossing:
            self._push_worker.wait_idle(BASE_WAIT_SHARE * round_s)  # the exchange needs it
        waited = time.monotonic() - now
        result = self._averagers()[0].sync(self._partners(), first=self._scheduled)
        logger.debug(
            "own round: %.2f s since the last, waited %.2f s to be dialled, sync %.2f s: %s %s",
            self._pace.round_s,
            waited,
            time.monotonic() - now - waited,
            result.outcome.value,
            result.reason,
        )
        if result.outcome in (SyncOutcome.OK, SyncOutcome.CANCELLED, SyncOutcome.SKIPPED):
            return  # skipped: a partner's exchange used our steps
        # an exchange reading our anchor in place would stop if a solo step moved it
        why = result.outcome.value
        if self.live.has_pending() or self._model_offers.in_flight() or self._anchor_offers.in_flight():
            logger.info("sync without a partner (%s): a partner's exchange with us is this round", why)
            return
        logger.info("sync without a partner (%s): outer step on our own pseudo-gradient", why)
        info = {"outcome": "solo", "reason": why, "role": "local", "bytes_sent": result.bytes_sent}
        self.live.queue(Update("solo", info=info))

    def _push_next_base(self) -> None:
        """If we push the base of our next scheduled pair (:class:`~swarm.trainer._schedule.Slot`), push
        our anchor to the partner as soon as our last exchange is applied, while both train
        (docs/gossip.md, "Nothing waits on the full model"): the round's exchange then sends only each
        model's change from it. Runs on its own thread, so that a push never delays an exchange."""
        slot = self._slot()
        if slot.partner is None or not slot.pushes:
            return
        anchor = self.live.anchor_view()
        if anchor is not None and not self._averagers()[0].push_base(slot.partner, anchor):
            logger.debug("no base pushed to %s: the next exchange with it sends whole models", slot.partner)

    def _schedule_says_wait(self) -> bool:
        """Set this round's scheduled partner; True if we are the member that waits to be dialled (the
        later one in the order), so that the two do not dial each other at once."""
        slot = self._slot()
        self._scheduled = slot.partner
        return slot.waits

    def _slot(self) -> Slot:
        """Our place in this round of the schedule, over the dialable live trainers."""
        ids = [p.peer_id for p in self._partners() if not (p.client_mode or p.leaving or p.joining)]
        return slot_of(ids, self._node.peer_id, self._run_id, self._model_offers.round)

    # ------------------------------------------------------------------ status and lifecycle

    def rollback(self) -> bool:
        return self.live.rollback()

    def on_client_mode(self) -> None:
        """Recreate the averagers without a handler, and stop serving state."""
        for service in (self.state_server, self.anchors, self.models):
            if service is not None:
                service.close()
        self.state_server = None
        self._state_hash = ""
        self._make_averagers(client_mode=True)

    def status(self) -> dict[str, Any]:
        return {"state_hash": self._state_hash}

    def metrics(self) -> ExchangeMetrics:
        """Both averagers' counters added up (latencies are the model averager's)."""
        parts = [a.metrics() for a in (self.models, self.anchors) if a is not None]
        return add_metrics(parts) if parts else ExchangeMetrics()

    def details(self) -> dict[str, Any]:
        models = self.models
        return {
            "exchange_metrics": models.metrics() if models is not None else ExchangeMetrics(),
            "banned_peers": models.banned_peers() if models is not None else {},
            "ban_strikes": models.ban_strikes() if models is not None else {},
            "rounds_by_role": dict(self._rounds),
            "stalled_seconds": self.stalled_seconds,
        }

    def checkpoint_state(self) -> dict[str, Any]:
        # the live tensors: the core writes the checkpoint on the training thread, before the next update
        return {"outer_optimizer": self.outer.state_dict(copy=False), "steps": self.live.steps}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["outer_optimizer"])
        self.live.reset()
        self.live.steps = int(state.get("steps", 0))

    def abort(self) -> None:
        for averager in (self.models, self.anchors):
            if averager is not None:
                averager.abort()

    def finish(self) -> list[RoundResult]:
        """Let our running exchange end (quickly, after :meth:`abort`) and apply what committed."""
        if self._worker is not None:
            self._worker.wait_idle(self._config.averaging.exchange_timeout_s * 2)
        return self._apply()

    def close(self) -> None:
        self.abort()
        for worker in (self._worker, self._push_worker):
            if worker is not None:
                worker.stop()
        for service in (self.state_server, self.anchors, self.models):
            if service is not None:
                with contextlib.suppress(Exception):
                    service.close()
