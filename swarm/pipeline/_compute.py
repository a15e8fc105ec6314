"""A stage server's compute, run by the peer's training thread: requests in, gradients accumulated.

The server's stream handlers (:mod:`swarm.pipeline._server`) decode and validate a request, then
:meth:`StageWorker.submit` it; the training thread calls :meth:`StageWorker.process` in its loop and is
the only thread that touches the module, so parameters change only between two requests, and the inner
optimizer step (taken by :class:`~swarm.pipeline.StagePeer`) never races a forward pass.

Gradients are provisional until the client commits (see :mod:`swarm.pipeline._protocol`): a request
that applies adds its parameter gradients to the accumulator at once, and remembers its input; a
rollback recomputes the same forward and backward with the opposite sign. Rollbacks are exact because
no inner step is taken while any micro-batch is provisional (:attr:`StageWorker.step_ready`), and
applying requests that arrive once a step is due wait until it is taken. Each ``(client, micro-batch)``
is committed at most once; later requests for it are refused.

A data holder that reads its answers and never commits must not hold the stage: each holder's
provisional samples are capped at half a batch (:attr:`StageWorker.holder_share`; its further
applying requests wait, nobody else's), and a provisional micro-batch that has waited longer than
``hold_s`` for its COMMIT while it holds the batch full (others' applying requests wait, or the step is
due) is *parked*: its gradient is taken back at once (exact: no step was taken since) and it no longer
counts toward the batch; if its COMMIT still comes, it is computed again at the weights of that moment
and counts then, else it is forgotten when its stream ends. A parked micro-batch still counts toward
its holder's share, so a holder that never commits has at most half a batch in play and holds the
batch full for at most ``hold_s`` per stream it leaves open. COMMITs and rollbacks are handled before
any queued request, so an answer's COMMIT is never late because of work queued behind it.

An output gradient comes from a data holder (the stage server refuses applying requests from anyone
else, :mod:`swarm.pipeline._server`), and even one of those is not trusted with its size:
:class:`GradientClip` clips each sample's output gradient to a bound set by the norms of the committed
micro-batches before it (:mod:`swarm.pipeline._clip`), so one sender moves the stage's parameters at
most as much as a few honest samples would. Inputs cached for a BACKWARD are shared per peer
(:mod:`swarm.pipeline._cache`).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.pipeline._cache import InputCache, Key
from swarm.pipeline._clip import GradientClip
from swarm.pipeline._clock import DeviceClock
from swarm.pipeline._protocol import Request

logger = logging.getLogger(__name__)

APPLIED_MEMORY = 1 << 16
"""How many committed micro-batch keys a server remembers to refuse a second application."""
PROVISIONAL_HOLD_S = 2.0
"""How long a provisional micro-batch may hold a full batch waiting for its COMMIT before it is parked.
An honest COMMIT follows the answer by a round trip and the answer's transfer; a slower one is not lost,
only computed again when it comes."""


@dataclass
class Outcome:
    """What the compute thread answers to one request."""

    loss: float | None = None
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    error: str | None = None
    retry: bool = True
    compute_s: float = 0.0


@dataclass
class Work:
    """One decoded request waiting for the compute thread. ``done`` is called exactly once, from it."""

    peer: str
    request: Request
    tensors: dict[str, torch.Tensor]
    targets: torch.Tensor | None
    deadline: float
    done: Callable[[Outcome], None]
    cancelled: bool = False

    @property
    def key(self) -> Key:
        return (self.peer, self.request.mb)


@dataclass
class _Provisional:
    x: torch.Tensor
    grad: torch.Tensor | None
    targets: torch.Tensor | None
    samples: int
    loss: float | None = None
    norms: list[float] = field(default_factory=list)
    since: float = 0.0
    """When its answer was handed to the stream (it waits for the COMMIT from then on)."""


@dataclass
class WorkerStats:
    requests: int = 0
    committed: int = 0
    committed_samples: int = 0
    rolled_back: int = 0
    parked: int = 0
    """Provisional micro-batches taken back for holding a full batch past ``hold_s``."""
    reapplied: int = 0
    """Parked micro-batches whose COMMIT came after all: computed again and counted."""
    refused: int = 0
    busy: int = 0
    device_s: float = 0.0
    train_device_s: float = 0.0


class StageWorker:
    """Serves one stage module's requests on the thread that calls :meth:`process`."""

    def __init__(
        self,
        module: torch.nn.Module,
        device: torch.device,
        *,
        batch_size: int,
        max_queue: int,
        clock: DeviceClock,
        cache_timeout_s: float = 120.0,
        clip: GradientClip | None = None,
        hold_s: float = PROVISIONAL_HOLD_S,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        self.module, self.device, self.batch_size = module, device, batch_size
        self._clock, self._now, self.hold_s = clock, now, hold_s
        self.holder_share = max(1, batch_size // 2)
        """Provisional (and parked) samples one data holder may have here; one request always fits."""
        self.clip = clip or GradientClip()
        self._incoming: collections.deque[Work] = collections.deque()
        self._resolutions: collections.deque[tuple[Key, bool]] = collections.deque()
        self._wake = threading.Event()
        self._max_queue = max_queue
        self._pending = 0  # submitted requests not yet taken (thread-safe through _lock)
        self._lock = threading.Lock()
        self._deferred: collections.deque[Work] = collections.deque()
        self._cache = InputCache(cache_timeout_s, now=now)
        self._provisional: dict[Key, _Provisional] = {}
        self._parked: dict[Key, _Provisional] = {}
        self._applied: collections.OrderedDict[Key, None] = collections.OrderedDict()
        self.committed_log: list[Key] = []
        """Every key this worker committed, in order (tests check that none is applied twice)."""
        self.stats = WorkerStats()
        self.closing = False
        """Set when the peer leaves the stage: queued requests are refused, nothing new is provisional."""
        self.samples_since_step = 0
        self.loss_sum = 0.0
        self.loss_samples = 0

    # ------------------------------------------------------------------ any thread

    def submit(self, work: Work) -> bool:
        """Queue a request; False (busy) when ``max_queue`` requests wait already."""
        with self._lock:
            if self._pending >= self._max_queue:
                self.stats.busy += 1
                return False
            self._pending += 1
        self._incoming.append(work)
        self._wake.set()
        return True

    def resolve(self, key: Key, commit: bool) -> None:
        """The client committed (or abandoned) the applying request ``key``; handled before queued work."""
        self._resolutions.append((key, commit))
        self._wake.set()

    @property
    def queue_length(self) -> int:
        with self._lock:
            return self._pending

    # ------------------------------------------------------------------ the compute thread

    @property
    def _batch_full(self) -> bool:
        """Committed and provisional samples make a batch: further applying requests wait for the step."""
        pending = sum(p.samples for p in self._provisional.values())
        return self.samples_since_step + pending >= self.batch_size

    @property
    def step_ready(self) -> bool:
        """A batch's worth of committed samples, and nothing provisional: the inner step may run (parked
        micro-batches are out of the accumulator: they do not hold it)."""
        return self.samples_since_step >= self.batch_size and not self._provisional

    def _held(self, peer: str) -> int:
        """Samples of ``peer`` provisional or parked here."""
        held = itertools.chain(self._provisional.items(), self._parked.items())
        return sum(p.samples for key, p in held if key[0] == peer)

    def _must_wait(self, work: Work) -> bool:
        """An applying request waits while the batch is full or its holder has its share in play (one to
        be refused is answered at once)."""
        if not work.request.applies or self._refusal(work) is not None:
            return False
        held = self._held(work.peer)
        return self._batch_full or (held > 0 and held + work.request.samples > self.holder_share)

    def _next_deferred(self) -> Work | None:
        """The first deferred request that may run now, or one that is only to be answered (expired)."""
        now = self._now()
        for work in self._deferred:
            if self.closing or work.cancelled or now > work.deadline or not self._must_wait(work):
                self._deferred.remove(work)
                return work
        return None

    def _park_stale(self) -> None:
        """Take back the provisional micro-batches that held a full batch past ``hold_s``."""
        if not (self._batch_full and (self._deferred or self.samples_since_step >= self.batch_size)):
            return
        now = self._now()
        for key in [k for k, p in self._provisional.items() if now - p.since > self.hold_s]:
            pending = self._provisional.pop(key)
            self._unapply(pending)
            self._parked[key] = pending
            self.stats.parked += 1
            logger.info("micro-batch %s of %s held the batch without COMMIT: parked", key[1][:8], key[0])

    def stepped(self) -> None:
        """The inner step was taken: start the next batch, let deferred requests through."""
        self.samples_since_step = 0
        self.loss_sum, self.loss_samples = 0.0, 0

    def process(self, timeout: float) -> bool:
        """Handle one COMMIT, rollback or request (waiting up to ``timeout``); False if there was none."""
        if self._resolutions:
            return self._resolve_next()
        self._park_stale()
        deferred = self._next_deferred()
        if deferred is not None:
            self._run(deferred)
            return True
        if not self._incoming:
            self._wake.clear()  # before looking: a submit or resolve from now on sets it again
            if not (self._incoming or self._resolutions):
                self._wake.wait(timeout)
            if self._resolutions:
                return self._resolve_next()
            if not self._incoming:
                return False
        work = self._incoming.popleft()
        with self._lock:
            self._pending -= 1
        if self._must_wait(work):
            self._deferred.append(work)  # the step comes first; it waits for commits, not for these
        else:
            self._run(work)
        return True

    def _resolve_next(self) -> bool:
        key, commit = self._resolutions.popleft()
        if commit:
            self._commit(key)
        else:
            self._rollback(key)
        return True

    def _run(self, work: Work) -> None:
        self.stats.requests += 1
        if self.closing:
            work.done(Outcome(error="this peer is leaving the stage"))
            return
        if work.cancelled or self._now() > work.deadline:
            work.done(Outcome(error="expired before it was served"))
            return
        refusal = self._refusal(work)
        if refusal is not None:
            self.stats.refused += 1
            work.done(Outcome(error=refusal, retry=False))
            return
        started = time.perf_counter()
        try:
            outcome = self._compute(work)
        except (RuntimeError, ValueError) as exc:  # e.g. out of memory: the request fails, the server lives
            logger.warning("stage request %s failed: %s", work.request.mb[:8], exc)
            self._provisional.pop(work.key, None)
            self.module.zero_grad(set_to_none=False)
            work.done(Outcome(error=f"compute failed: {str(exc)[:200]}"))
            return
        compute = time.perf_counter() - started
        forward_only = not work.request.applies  # a third of a forward and backward
        share = self._clock.share(work.request.samples) / (3 if forward_only else 1)
        device = self._clock.pad(compute, share)
        self.stats.device_s += device
        if work.request.train:
            self.stats.train_device_s += device
        outcome.compute_s = device
        work.done(outcome)

    def _refusal(self, work: Work) -> str | None:
        key = work.key
        if work.request.applies and (key in self._applied or key in self._provisional or key in self._parked):
            return "micro-batch already applied here"
        if work.request.op == "backward" and key not in self._cache:
            return "unknown micro-batch (its input is not cached here)"
        return None

    def _compute(self, work: Work) -> Outcome:
        r, key = work.request, work.key
        self.module.train(r.train)
        x = self._cache.pop(key) if r.op == "backward" else work.tensors["x"].to(self.device)
        if not r.train:
            with torch.no_grad():
                if work.targets is not None:
                    return Outcome(loss=float(self.module.loss(x, work.targets.to(self.device))))
                return Outcome(tensors=[("y", self.module(x))])
        if r.caches:
            with torch.no_grad():
                y = self.module(x)
            self._cache.put(key, x)
            return Outcome(tensors=[("y", y)])
        grad, norms = work.tensors.get("g"), list[float]()
        if grad is not None:
            grad, norms = self.clip.clip(grad.to(self.device))
        targets = None if work.targets is None else work.targets.to(self.device)
        pending = _Provisional(x, grad, targets, r.samples, norms=norms)
        loss, dx = self._backprop(pending, sign=1.0)
        pending.loss, pending.since = loss, self._now()
        self._provisional[key] = pending
        return Outcome(loss=loss, tensors=[("dx", dx)])

    def _backprop(self, p: _Provisional, sign: float) -> tuple[float | None, torch.Tensor]:
        """Forward and backward of one micro-batch, adding ``sign`` times its gradients to the accumulator."""
        x = p.x.detach().requires_grad_(True)
        if p.targets is not None:
            loss = self.module.loss(x, p.targets)
            (loss * (sign * p.samples / self.batch_size)).backward()
            return float(loss.detach()), x.grad
        if p.grad is None:
            raise ValueError("a middle stage's gradient step needs the output gradient")
        y = self.module(x)
        y.backward(p.grad * sign)
        return None, x.grad

    def _commit(self, key: Key) -> None:
        pending = self._provisional.pop(key, None)
        if pending is None:
            pending = self._parked.pop(key, None)
            if pending is None:
                return
            self._reapply(pending)
        self._applied[key] = None
        while len(self._applied) > APPLIED_MEMORY:
            self._applied.popitem(last=False)
        self.committed_log.append(key)
        self.clip.accept(pending.norms)
        self.stats.committed += 1
        self.stats.committed_samples += pending.samples
        self.samples_since_step += pending.samples
        if pending.loss is not None:
            self.loss_sum += pending.loss * pending.samples
            self.loss_samples += pending.samples

    def _rollback(self, key: Key) -> None:
        pending = self._provisional.pop(key, None)
        if pending is not None:
            self._unapply(pending)
        elif self._parked.pop(key, None) is None:
            return
        self.stats.rolled_back += 1

    def _unapply(self, pending: _Provisional) -> None:
        """Subtract a provisional micro-batch's gradients (exact: no step was taken since it was added)."""
        self._backprop_timed(pending, sign=-1.0)

    def _reapply(self, pending: _Provisional) -> None:
        """A parked micro-batch was committed after all: its gradients at the weights of now."""
        self._backprop_timed(pending, sign=1.0)
        self.stats.reapplied += 1

    def _backprop_timed(self, pending: _Provisional, sign: float) -> None:
        self.module.train(True)
        started = time.perf_counter()
        self._backprop(pending, sign=sign)
        self.stats.train_device_s += self._clock.pad(
            time.perf_counter() - started, self._clock.share(pending.samples)
        )

    def forget_inputs(self) -> None:
        """Drop cached inputs (the stage is being closed or moved)."""
        self._cache.clear()

    @property
    def provisional(self) -> int:
        """Micro-batches waiting for their COMMIT (parked ones too: a COMMIT would still count them)."""
        return len(self._provisional) + len(self._parked)
