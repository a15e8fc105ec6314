"""``averaging.backend: allreduce``: OpenDiLoCo's method, a group all-reduce of pseudo-gradients.

Every ``sync_every_steps`` inner steps (:class:`RoundClock`) the trainers match up by hivemind's
``DecentralizedAverager`` and all-reduce their pseudo-gradients, compressed with the hivemind
counterpart of ``compression.codec``; each member then takes the same outer Nesterov step from its
anchor. This is the exact average that gossip approximates, paid for with a barrier: matchmaking
waits until every live trainer has joined (the group's target size) or ``MATCHMAKING_TIME_S`` ran out.

* **Weights.** A pseudo-gradient is a *sum* over the inner steps since the anchor, so it already holds
  each of its samples once. Every member passes ``weight=1`` and the round averages the plain mean of
  the sums: each sample of the group counts once, divided by the group size. Weighting the sums by
  sample count would count a peer's contribution in proportion to the square of its steps.
* **No group.** Alone in the swarm (no other trainer in the member list): ``solo``, an outer step on
  the own pseudo-gradient without waiting. Matchmaking found nobody in time: ``no_group``; the
  all-reduce broke after the group formed: ``failed``. Both also step on the own pseudo-gradient.
  ``partial``: a member's parts timed out and hivemind put our own values in their place, so the
  members' results may differ; we apply ours and count our state as inconsistent (below).
* **Consensus.** Averaged pseudo-gradients keep the members' anchors equal only if they were equal
  before. A state is *consistent* once it came out of a group round (or from a download) and stays so
  until this peer takes an outer step on its own; its *epoch* is the outer optimizer's round count.
  Each all-reduce gathers both, and after it a member that was inconsistent or behind the group's
  highest epoch downloads the state (anchor, momentum, epoch) of the best peer that advertises one,
  ranked by ``epoch + 0.5 * consistent`` (``load_state_from_peers``). If no member is consistent at
  the highest epoch, the first of those at that epoch by peer id keeps its state and the others take
  it. Two groups at the same epoch that never met stay apart: only epochs and flags are compared.
* **Joining.** A fresh peer downloads that state in :meth:`AllReduceBackend.join`; the inner AdamW
  state stays local, as in DiLoCo. A resumed peer is inconsistent until its first group round.
* **Bytes** are counted in the averager's own process like the hivemind baseline's
  (:mod:`swarm.trainer.baselines._hivemind_wire`): all-reduce parts, matchmaking and state downloads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import CompressionInfo

from swarm.gossip import ExchangeMetrics
from swarm.learning import OuterOptimizer
from swarm.trainer._backend import (
    BackendContext,
    JoinResult,
    NoGuard,
    RoundOutcome,
    RoundResult,
    outer_state_device,
)
from swarm.trainer._solo import RoundClock
from swarm.trainer.baselines._hivemind_wire import (
    MATCHMAKING_TIME_S,
    REQUEST_TIMEOUT_S,
    CountingAverager,
    WireCounters,
    hivemind_codec,
)

logger = logging.getLogger(__name__)


def allreduce_prefix(run_id: str) -> str:
    """The averager's DHT prefix: our run id plus ``_allreduce`` (hivemind's may not contain dots)."""
    return f"{run_id.replace('.', '_')}_allreduce"


@dataclass(frozen=True)
class GroupRound:
    """The last all-reduce this peer completed: its group, and whether this peer re-synced after it."""

    group_id: str
    size: int
    resynced: bool


class _PseudoGradientAverager(CountingAverager):
    """hivemind's averager, counting its bytes, naming its groups and sharing the outer state."""

    def __init__(self, tensors: list[torch.Tensor], *, wire: WireCounters, state_fn, **kwargs) -> None:
        self._wire, self._state_fn = wire, state_fn
        super().__init__(tensors, **kwargs)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs):
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        # hivemind fills in what a slow member did not send or reduce with our own values, so that
        # each member may end with a different "average": such a round is not consistent
        runner = self._running_groups[group_info.group_id].result()
        partial = runner.tensor_part_container.failed_size > 0 or bool(runner.banned_senders)
        members = {peer.to_base58(): info for peer, info in gathered.items()}
        return {"group_id": group_info.group_id.hex(), "members": members, "partial": partial}

    def get_current_state(self) -> tuple[dict[str, Any], list[torch.Tensor], None]:
        """What a downloading peer gets (called in this process's host, on hivemind's fetch thread)."""
        metadata, tensors = self._state_fn()
        return metadata, tensors, None

    def set_target_group_size(self, size: int) -> None:
        """Assemble a group as soon as ``size`` peers joined, rather than at the end of matchmaking."""
        self._outer_pipe.send(("_set_target_group_size", [size], {}))

    async def _set_target_group_size(self, size: int) -> None:
        self._matchmaking.target_group_size = size


class AllReduceBackend(NoGuard):
    """Outer steps on the group mean of pseudo-gradients, every ``sync_every_steps`` inner steps."""

    def __init__(self, context: BackendContext) -> None:
        self._context = context
        self.outer = OuterOptimizer.from_config(
            context.model, context.config.averaging, state_device=outer_state_device(context)
        )
        self._clock = RoundClock(context.config.averaging)
        self._names = list(self.outer.anchor)
        self._buffers = [torch.zeros(a.shape, dtype=torch.float32) for a in self.outer.anchor.values()]
        self._lock = threading.Lock()  # the outer state, against hivemind's state-fetch thread
        self.wire = WireCounters()
        self._reported = self.wire.snapshot()
        self.counts: Counter[str] = Counter()
        self.last_group: GroupRound | None = None
        self._samples = 0
        self._consistent = True
        self._aborted = threading.Event()
        self._pending: Any = None  # the step or state download in flight, for abort()
        self._averager: _PseudoGradientAverager | None = self._start_averager(client_mode=None)

    def _running(self) -> _PseudoGradientAverager:
        """The averager, from construction until :meth:`close`."""
        if self._averager is None:
            raise RuntimeError("the all-reduce backend is closed")
        return self._averager

    def _start_averager(self, client_mode: bool | None) -> _PseudoGradientAverager:
        config = self._context.config
        codec = hivemind_codec(config.compression.codec)
        # The first int8 compression imports bitsandbytes: 20 s on a loaded 2-core machine, longer than
        # a chunk timeout inside a first all-reduce. Import it here, once, for every forked averager.
        sample = torch.zeros(64)
        codec.compress(sample, CompressionInfo.from_tensor(sample))
        return _PseudoGradientAverager(
            self._buffers,
            wire=self.wire,
            state_fn=self._shared_state,
            dht=self._context.node.dht,
            start=True,
            prefix=allreduce_prefix(config.run.run_id),
            min_matchmaking_time=MATCHMAKING_TIME_S,
            request_timeout=REQUEST_TIMEOUT_S,
            allreduce_timeout=config.averaging.exchange_timeout_s,
            next_chunk_timeout=config.averaging.chunk_timeout_s,
            compression=codec,
            client_mode=client_mode,
        )

    def inner_optimizer(self) -> torch.optim.Optimizer | None:
        return None

    # ------------------------------------------------------------------ joining and shared state

    def join(self, fresh: bool) -> JoinResult:
        """A fresh peer takes over the best advertised state; without one it keeps the seed's."""
        found = self._download() if fresh else None
        self._advertise()
        if found is None:
            return JoinResult()
        return JoinResult(donors=(found["peer"],), meta={"samples_total": int(found["samples_total"])})

    def _shared_state(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        with self._lock:
            state = self.outer.state_dict()
        momentum = sorted(state["momentum_buffers"])
        metadata = {
            "epoch": state["rounds"],
            "momentum": momentum,
            "samples_total": self._context.progress.samples_total,
            "peer": self._context.node.peer_id,
        }
        anchor, buffers = state["anchor"], state["momentum_buffers"]
        return metadata, [anchor[n] for n in self._names] + [buffers[n] for n in momentum]

    def _download(self) -> dict[str, Any] | None:
        """Adopt the state of the best peer that advertises one; its metadata, or None."""
        try:
            self._pending = self._running().load_state_from_peers(
                wait=False, timeout=self._context.config.averaging.chunk_timeout_s
            )
            found = self._pending.result()
        except Exception as exc:  # cancelled by abort(), or the donor went away
            logger.info("state download failed: %r", exc)
            return None
        if found is None or self._aborted.is_set() or not self._adopt(*found):
            return None
        self._consistent = True
        return found[0]

    def _adopt(self, metadata: dict[str, Any], tensors: list[torch.Tensor]) -> bool:
        names, n = list(metadata.get("momentum", [])), len(self._names)
        shapes = [a.shape for a in self.outer.anchor.values()]
        shapes += [self.outer.anchor[name].shape for name in names if name in self.outer.anchor]
        if [t.shape for t in tensors] != shapes:
            logger.warning("ignoring a downloaded state that does not match the model")
            return False
        outer = self.outer
        state: dict[str, Any] = {"lr": outer.lr, "momentum": outer.momentum, "nesterov": outer.nesterov}
        state.update(rounds=metadata["epoch"], anchor=dict(zip(self._names, tensors[:n], strict=True)))
        state["momentum_buffers"] = dict(zip(names, tensors[n:], strict=True))
        with self._lock, torch.no_grad():
            outer.load_state_dict(state)
            for name, param in self._context.model.named_parameters():
                param.copy_(outer.anchor[name])
        return True

    def _advertise(self) -> None:
        if self._averager is not None and not self._averager.client_mode:
            self._averager.state_sharing_priority = self.outer.rounds + 0.5 * self._consistent

    # ------------------------------------------------------------------ rounds

    def after_step(self, samples: int) -> list[RoundResult]:
        self._clock.tick()
        self._samples += samples
        return []

    def sync_due(self) -> bool:
        return self._clock.due() and not self._aborted.is_set()

    def sync_round(self) -> list[RoundResult]:
        grad = self.outer.pseudo_gradient()
        samples, self._samples = self._samples, 0
        self._clock.restart()
        others = self._other_trainers()
        if others == 0:
            return [self._step_alone("solo", grad, samples)]
        try:
            result = self._all_reduce(grad, others + 1)
        except Exception as exc:  # no group in time, a broken all-reduce, or abort()
            if self._aborted.is_set():
                return []
            began = getattr(self._pending, "began_allreduce", False)
            outcome: RoundOutcome = "failed" if began else "no_group"
            logger.info("all-reduce round %s: %r", outcome, exc)
            return [self._step_alone(outcome, grad, samples)]
        with self._lock, self._running().get_tensors() as averaged:
            self.outer.apply(dict(zip(self._names, averaged, strict=True)))
        members, outcome = result["members"], "partial" if result["partial"] else "ok"
        resynced = self._settle(members) if outcome == "ok" else self._lost_consensus()
        self.last_group = GroupRound(result["group_id"], len(members), resynced)
        self.counts[outcome] += 1
        return [self._result(outcome, samples, partner=f"{len(members)} peers", role="initiator")]

    def _all_reduce(self, grad: dict[str, torch.Tensor], group_size: int) -> dict[str, Any]:
        """One matchmaking and all-reduce; the group's id and gathered ``{peer: info}``, or raises."""
        self._pending = None
        averager = self._running()
        with averager.get_tensors() as buffers:
            for name, buffer in zip(self._names, buffers, strict=True):
                buffer.copy_(grad[name])
        averager.set_target_group_size(group_size)
        gather = {"epoch": self.outer.rounds, "consistent": self._consistent}
        timeout = max(self._context.config.averaging.exchange_timeout_s, 2 * MATCHMAKING_TIME_S)
        self._pending = averager.step(gather=gather, weight=1.0, timeout=timeout, wait=False)
        return self._pending.result()

    def _settle(self, members: dict[str, dict[str, Any]]) -> bool:
        """After a group round: keep our state, or take over the best advertised one. True if we did."""
        top = max(m["epoch"] for m in members.values())
        mine = members[self._context.node.peer_id]
        if mine["consistent"] and mine["epoch"] == top:
            resync = False
        elif any(m["consistent"] and m["epoch"] == top for m in members.values()):
            resync = True
        else:  # nobody holds a group state: the first peer at the top epoch lends its own
            reference = min(peer for peer, m in members.items() if m["epoch"] == top)
            resync = reference != self._context.node.peer_id
        if resync:
            self.counts["resync"] += 1
        self._consistent = self._download() is not None if resync else True
        self._advertise()
        return resync

    def _result(self, outcome: RoundOutcome, samples: int, **fields: Any) -> RoundResult:
        """A round's report, with the wire bytes counted since the previous one."""
        now = self.wire.snapshot()
        sent, received = now[0] - self._reported[0], now[1] - self._reported[1]
        self._reported = now
        return RoundResult(outcome, bytes_sent=sent, bytes_received=received, weight=samples, **fields)

    def _step_alone(self, outcome: RoundOutcome, grad: dict[str, torch.Tensor], samples: int) -> RoundResult:
        with self._lock:
            self.outer.apply(grad)
        self._lost_consensus()
        self.counts[outcome] += 1
        return self._result(outcome, samples, role="local")

    def _lost_consensus(self) -> bool:
        """Our state is no longer known to be the group's: fix that at the next group round."""
        self._consistent = False
        self._advertise()
        return False

    def _other_trainers(self) -> int:
        """Live trainers of this run config besides us (as of the node's last background read)."""
        node, config_hash = self._context.node, self._context.config.config_hash()
        return sum(
            m.peer_id != node.peer_id and m.record.role == "trainer" and m.record.config_hash == config_hash
            for m in node.recent_members()
        )

    # ------------------------------------------------------------------ the rest of the protocol

    def rollback(self) -> bool:
        with self._lock:
            return self.outer.restore()

    def on_client_mode(self) -> None:
        """Nobody can dial us: restart the averager in client mode (it joins groups, leads none)."""
        if self._averager is not None and not self._averager.client_mode:
            self._averager.shutdown()
            self._averager = self._start_averager(client_mode=True)

    def status(self) -> dict[str, Any]:
        return {}

    def metrics(self) -> ExchangeMetrics:
        """Measured wire bytes; ``exchanges_ok`` counts all-reduce rounds (``partial`` ones too)."""
        sent, received, rounds, _ = self.wire.snapshot()
        counts = {"exchanges_failed": self.counts["failed"], "no_partner": self.counts["no_group"]}
        return ExchangeMetrics(exchanges_ok=rounds, bytes_sent=sent, bytes_received=received, **counts)

    def details(self) -> dict[str, Any]:
        _, _, rounds, peers = self.wire.snapshot()
        group = peers / rounds if rounds else None
        state = {"epoch": self.outer.rounds, "consistent": self._consistent}
        return {"rounds": dict(self.counts), "mean_group_size": group, **state}

    def checkpoint_state(self) -> dict[str, Any]:
        with self._lock:
            return {"outer_optimizer": self.outer.state_dict()}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        with self._lock:
            self.outer.load_state_dict(state["outer_optimizer"])
        self._consistent = False  # the swarm may have moved on: take its state at the first group round

    def abort(self) -> None:
        self._aborted.set()
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):
                pending.cancel()

    def finish(self) -> list[RoundResult]:
        return []

    def close(self) -> None:
        """Stop the averager process. Idempotent."""
        averager, self._averager = self._averager, None
        if averager is not None and averager.is_alive():
            averager.shutdown()
