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

An output gradient comes from a data holder (the stage server refuses applying requests from anyone
else, :mod:`swarm.pipeline._server`), and even one of those is not trusted with its size:
:class:`GradientClip` clips each sample's output gradient to a bound set by the norms of the committed
micro-batches before it, so one sender moves the stage's parameters at most as much as a few honest
samples would.
"""

from __future__ import annotations

import collections
import logging
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from swarm.pipeline._estimate import MAX_CACHED
from swarm.pipeline._protocol import Request

logger = logging.getLogger(__name__)

Key = tuple[str, str]
"""(client peer id, micro-batch id): a client cannot touch another client's micro-batches."""
APPLIED_MEMORY = 1 << 16
"""How many committed micro-batch keys a server remembers to refuse a second application."""
CLIP_FACTOR = 4.0
"""A sample's output gradient may be this many times the median norm of recent committed ones."""
CLIP_WINDOW = 256
"""Per-sample norms of the latest committed output gradients that set the bound."""
CLIP_WARMUP = 16
"""Until this many are known, the bound is :data:`INITIAL_CLIP_NORM`."""
INITIAL_CLIP_NORM = 1.0
"""Per sample. The tiny test model's honest output gradients are about 0.12; a bound that is too low
only slows the first micro-batches, and the window's median takes over after :data:`CLIP_WARMUP`."""


class GradientClip:
    """Clips each sample's output gradient by norm (the compute thread's only; not thread-safe).

    The bound is :data:`CLIP_FACTOR` times the median per-sample norm of the last :data:`CLIP_WINDOW`
    committed samples (after clipping), or ``initial`` before :data:`CLIP_WARMUP` are known. A median
    moves only when most recent senders move it, so a minority of data holders cannot raise it.
    """

    def __init__(self, initial: float = INITIAL_CLIP_NORM, factor: float = CLIP_FACTOR) -> None:
        if not (initial > 0 and factor >= 1):
            raise ValueError(f"GradientClip needs initial > 0 and factor >= 1, got {initial}, {factor}")
        self.initial, self.factor = initial, factor
        self._norms: collections.deque[float] = collections.deque(maxlen=CLIP_WINDOW)
        self.clipped = 0
        """Samples whose output gradient was clipped."""

    @property
    def bound(self) -> float:
        if len(self._norms) < CLIP_WARMUP:
            return self.initial
        return self.factor * statistics.median(self._norms)

    def clip(self, grad: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """``grad`` (samples first) with each sample's norm at most :attr:`bound`, and those norms."""
        norms = grad.detach().float().flatten(1).norm(dim=1)
        scale = (self.bound / norms.clamp_min(1e-30)).clamp(max=1.0)
        self.clipped += int((scale < 1).sum())
        shaped = scale.view(-1, *([1] * (grad.dim() - 1))).to(grad.dtype)
        return grad * shaped, (norms * scale).tolist()

    def accept(self, norms: list[float]) -> None:
        """A micro-batch with these per-sample norms was committed: they join the window."""
        self._norms.extend(norms)


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


@dataclass
class WorkerStats:
    requests: int = 0
    committed: int = 0
    committed_samples: int = 0
    rolled_back: int = 0
    refused: int = 0
    busy: int = 0
    device_s: float = 0.0
    train_device_s: float = 0.0


class DeviceClock:
    """``emulation.step_time_s`` and ``emulation.slowdown`` per unit of work: an emulated accelerator.

    Work worth ``share`` of an inner step (forward and backward of a micro-batch of ``samples`` out of
    ``batch_size`` is ``samples / batch_size``; a forward alone a third of that) takes at least
    ``share * step_time_s`` of device time, stretched by
    ``slowdown``; the caller sleeps for the difference, the way a process waits on its busy device.
    Returns the device time.
    """

    def __init__(self, step_time_s: float, slowdown: float, batch_size: int) -> None:
        self.step_time_s, self.slowdown, self.batch_size = step_time_s, slowdown, batch_size

    def pad(self, compute_s: float, share: float) -> float:
        device = max(compute_s, self.step_time_s * share) * self.slowdown
        if device > compute_s:
            time.sleep(device - compute_s)
        return device

    def share(self, samples: int) -> float:
        return samples / self.batch_size


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
    ) -> None:
        self.module, self.device, self.batch_size = module, device, batch_size
        self._clock = clock
        self.clip = clip or GradientClip()
        self._queue: queue.Queue[tuple[str, object]] = queue.Queue()
        self._max_queue = max_queue
        self._pending = 0  # submitted requests not yet taken (thread-safe through _lock)
        self._lock = threading.Lock()
        self._deferred: collections.deque[Work] = collections.deque()
        self._cache: collections.OrderedDict[Key, tuple[torch.Tensor, float]] = collections.OrderedDict()
        self._cache_timeout = cache_timeout_s
        self._provisional: dict[Key, _Provisional] = {}
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
        self._queue.put(("work", work))
        return True

    def resolve(self, key: Key, commit: bool) -> None:
        """The client committed (or abandoned) the applying request ``key``; applied in queue order."""
        self._queue.put(("commit" if commit else "rollback", key))

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
        """A batch's worth of committed samples, and nothing provisional: the inner step may run."""
        return self.samples_since_step >= self.batch_size and not self._provisional

    def stepped(self) -> None:
        """The inner step was taken: start the next batch, let deferred requests through."""
        self.samples_since_step = 0
        self.loss_sum, self.loss_samples = 0.0, 0

    def process(self, timeout: float) -> bool:
        """Handle one queued item (waiting up to ``timeout``); False if there was none."""
        if self._deferred and not self._batch_full:
            self._run(self._deferred.popleft())
            return True
        try:
            kind, item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return False
        if kind == "work":
            work = item
            assert isinstance(work, Work)
            with self._lock:
                self._pending -= 1
            if work.request.applies and self._batch_full:
                self._deferred.append(work)  # the step comes first; it waits for commits, not for these
            else:
                self._run(work)
        elif kind == "commit":
            self._commit(item)  # type: ignore[arg-type]
        else:
            self._rollback(item)  # type: ignore[arg-type]
        return True

    def _run(self, work: Work) -> None:
        self.stats.requests += 1
        if self.closing:
            work.done(Outcome(error="this peer is leaving the stage"))
            return
        if work.cancelled or time.monotonic() > work.deadline:
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
        if work.request.applies and (key in self._applied or key in self._provisional):
            return "micro-batch already applied here"
        if work.request.op == "backward" and key not in self._cache:
            return "unknown micro-batch (its input is not cached here)"
        return None

    def _compute(self, work: Work) -> Outcome:
        r, key = work.request, work.key
        self.module.train(r.train)
        if r.op == "backward":
            x, _ = self._cache.pop(key)
        else:
            x = work.tensors["x"].to(self.device)
        if not r.train:
            with torch.no_grad():
                if work.targets is not None:
                    return Outcome(loss=float(self.module.loss(x, work.targets.to(self.device))))
                return Outcome(tensors=[("y", self.module(x))])
        if r.caches:
            with torch.no_grad():
                y = self.module(x)
            self._remember(key, x)
            return Outcome(tensors=[("y", y)])
        grad, norms = work.tensors.get("g"), list[float]()
        if grad is not None:
            grad, norms = self.clip.clip(grad.to(self.device))
        targets = None if work.targets is None else work.targets.to(self.device)
        pending = _Provisional(x, grad, targets, r.samples, norms=norms)
        loss, dx = self._backprop(pending, sign=1.0)
        pending.loss = loss
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

    def _remember(self, key: Key, x: torch.Tensor) -> None:
        now = time.monotonic()
        self._cache[key] = (x, now)
        while self._cache and (
            len(self._cache) > MAX_CACHED or now - next(iter(self._cache.values()))[1] > self._cache_timeout
        ):
            self._cache.popitem(last=False)

    def _commit(self, key: Key) -> None:
        pending = self._provisional.pop(key, None)
        if pending is None:
            return
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
        if pending is None:
            return
        self.module.train(True)
        started = time.perf_counter()
        self._backprop(pending, sign=-1.0)
        self.stats.train_device_s += self._clock.pad(
            time.perf_counter() - started, self._clock.share(pending.samples)
        )
        self.stats.rolled_back += 1

    def forget_inputs(self) -> None:
        """Drop cached inputs (the stage is being closed or moved)."""
        self._cache.clear()

    @property
    def provisional(self) -> int:
        return len(self._provisional)
