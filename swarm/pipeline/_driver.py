"""A data holder's micro-batches: stage 0 locally, the later stages through the swarm, with retries.

:class:`DataHolder` cuts its batches into micro-batches of ``pipeline.microbatch_size``, runs stage 0
(embeddings and first blocks) on its own device, and sends each micro-batch's activations on a
*chain*: FORWARD through one peer of each middle stage, FORWARD with the targets to a peer of the last
stage (loss and input gradient at once), then BACKWARD back through the middle stages, each hop to a
peer the :class:`~swarm.pipeline.Router` draws. Up to ``pipeline.max_inflight`` chains run at once on
the client's event loop, across inner steps; the training thread backprops stage 0 as each one
returns and steps every ``train.batch_size`` samples. There is no barrier, between data holders or
between one holder's batches. A chain sent before a step comes back after it: stage 0 is recomputed
at the new weights, and the later stages computed theirs at whatever weights they had (the staleness
of asynchronous pipelines, bounded by ``max_inflight``).

Failures: a hop whose peer fails, refuses or stalls (``pipeline.request_timeout_s``) is retried on
another peer of that stage (the server applied nothing, see :mod:`swarm.pipeline._client`); a BACKWARD
whose peer lost the cached input is redone there or elsewhere as FORWARD with the output gradient
(forward and backward at once). A micro-batch that runs out of attempts is dropped: its stage 0
gradient is never applied, and stages that already committed it keep it (at most once each).

A stage server's answer is not trusted with its size either: a server that skips its compute (or lies)
may answer any input gradient up to 65504 per value, which would go on to the stage below and into
stage 0's backward. Each sample's input gradient from a stage is clipped by norm to 4 times the median
of the last 256 that stage's peers answered (:class:`~swarm.pipeline._clip.GradientClip`, one per
stage), as the stage servers clip the output gradients they are sent.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from swarm.learning import EvalSet
from swarm.pipeline._client import CallFailed, Reply, StageClient
from swarm.pipeline._clip import GradientClip
from swarm.pipeline._clock import DeviceClock
from swarm.pipeline._protocol import EVAL_SAMPLES, Request, StageError
from swarm.pipeline._router import Router
from swarm.pipeline._stages import StageModule

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 4
"""Peers tried per hop before a micro-batch is dropped."""
NO_PEER_WAIT_S = 0.25


class ChainFailed(Exception):
    """A micro-batch could not get through a stage."""


@dataclass
class BatchStats:
    """One batch through the pipeline: samples whose gradient reached stage 0, their mean loss in nats."""

    samples: int
    dropped: int
    loss: float | None
    compute_s: float
    device_s: float
    seconds: float


class DataHolder:
    """Stage 0 of the pipeline: drives micro-batches of local data through the swarm's later stages."""

    def __init__(
        self,
        module: StageModule,
        device: torch.device,
        client: StageClient,
        router: Router,
        *,
        microbatch_size: int,
        max_inflight: int,
        timeout_s: float,
        clock: DeviceClock,
    ) -> None:
        self.module, self.device, self.client, self.router = module, device, client, router
        self.num_stages = len(client.limits)
        self._micro, self._max_inflight, self._timeout = microbatch_size, max_inflight, timeout_s
        self._clock = clock
        self._inflight: dict[concurrent.futures.Future, torch.Tensor] = {}
        self._pending: collections.deque[tuple[torch.Tensor, torch.Tensor]] = collections.deque()
        self.dropped = 0
        self.retries = 0
        self.clips = [GradientClip() for _ in range(self.num_stages)]
        """Per stage: the bound on each sample's input gradient its peers answer (the chain's thread only)."""

    # ------------------------------------------------------------------ training (the training thread)

    def train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], batch_size: int) -> BatchStats:
        """Accumulate stage 0's gradient until ``batch_size`` samples came back (the caller then steps).

        Chains stay in flight across steps, so no peer waits for a batch's last micro-batch: a chain sent
        before a step is backpropagated after it, through stage 0 recomputed at the current weights (as
        the stage servers do with their cached inputs). Its forward is sent without keeping a graph.
        """
        started = time.perf_counter()
        self.module.train()
        totals = {"samples": 0, "dropped": 0, "loss": 0.0, "compute": 0.0, "device": 0.0}
        while totals["samples"] + totals["dropped"] < batch_size:
            while len(self._inflight) < self._max_inflight:
                self._send(batches, totals)
            self._harvest(totals)
        samples = int(totals["samples"])
        return BatchStats(
            samples=samples,
            dropped=int(totals["dropped"]),
            loss=totals["loss"] / samples if samples else None,
            compute_s=totals["compute"],
            device_s=totals["device"],
            seconds=time.perf_counter() - started,
        )

    def _send(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]], totals: dict) -> None:
        if not self._pending:
            x, y = next(batches)
            self._pending.extend(zip(x.split(self._micro), y.split(self._micro), strict=True))
        xs, ys = self._pending.popleft()
        began = time.perf_counter()
        with torch.no_grad():
            h0 = self.module(xs.to(self.device))
        self._account(totals, time.perf_counter() - began, len(xs), 1 / 3)
        chain = self._chain(secrets.token_hex(16), h0, ys, train=True)
        self._inflight[self.client.submit(chain)] = xs

    def _harvest(self, totals: dict) -> None:
        done, _ = concurrent.futures.wait(
            list(self._inflight), return_when=concurrent.futures.FIRST_COMPLETED
        )
        for future in done:
            xs = self._inflight.pop(future)
            samples = len(xs)
            try:
                loss, grad = future.result()
            except Exception as exc:  # ChainFailed; anything else is a bug, but must not stop training
                log = logger.info if isinstance(exc, ChainFailed) else logger.exception
                log("dropped a micro-batch of %d samples: %s", samples, exc)
                totals["dropped"] += samples
                self.dropped += 1
                continue
            began = time.perf_counter()
            h0 = self.module(xs.to(self.device))
            h0.backward(grad.to(self.device, h0.dtype))
            self._account(totals, time.perf_counter() - began, samples, 1)
            totals["samples"] += samples
            totals["loss"] += loss * samples

    def _account(self, totals: dict, compute: float, samples: int, part: float) -> None:
        """Device time of stage 0's forward (``part`` 1/3 of a micro-batch's work) or of the recomputed
        forward and the backward (1)."""
        totals["compute"] += compute
        totals["device"] += self._clock.pad(compute, part * self._clock.share(samples))

    def drain(self, timeout_s: float) -> None:
        """At the end: let the chains in flight finish (their servers commit them), without using them."""
        if self._inflight:
            concurrent.futures.wait(list(self._inflight), timeout=timeout_s)
        self._inflight.clear()
        self._pending.clear()

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self, eval_set: EvalSet, batches: int) -> float | None:
        """Mean held-out loss in bits per token through the pipeline; None if no batch got through."""
        was_training = self.module.training
        self.module.eval()
        futures = []
        try:
            for x, y in eval_set.batches(batches):
                for xs, ys in zip(x.split(EVAL_SAMPLES), y.split(EVAL_SAMPLES), strict=True):
                    h0 = self.module(xs.to(self.device))
                    futures.append(
                        (self.client.submit(self._chain(secrets.token_hex(16), h0, ys, False)), len(xs))
                    )
            results = []
            for future, samples in futures:
                try:
                    results.append((future.result()[0], samples))
                except Exception as exc:  # as in training: a failed chain costs its batch only
                    log = logger.info if isinstance(exc, ChainFailed) else logger.exception
                    log("an evaluation batch did not get through: %s", exc)
        finally:
            self.module.train(was_training)
        if not results:
            return None
        return sum(loss * n for loss, n in results) / sum(n for _, n in results) / math.log(2)

    # ------------------------------------------------------------------ one micro-batch (the client's loop)

    async def _chain(
        self, mb: str, h0: torch.Tensor, targets: torch.Tensor, train: bool
    ) -> tuple[float, torch.Tensor | None]:
        """Through stages 1..S-1 and back; returns the loss (nats) and the gradient of stage 0's output."""
        samples, tokens = targets.shape
        last = self.num_stages - 1

        def request(op: str, *, targets: bool = False, grad: bool = False) -> Request:
            return Request(op, mb, samples, tokens, targets, grad, train, frames=0)

        inputs, path = [h0.to("cpu", torch.float32)], []
        for stage in range(1, last):
            reply, peer = await self._hop(stage, request("forward"), [("x", inputs[-1])], None)
            inputs.append(reply.tensor)
            path.append(peer)
        reply, _ = await self._hop(last, request("forward", targets=True), [("x", inputs[-1])], targets)
        grad, loss = reply.tensor, reply.loss
        if loss is None:  # the client checked it is there; for the type checker
            raise ChainFailed(f"stage {last} answered no loss")
        if not train:
            return loss, None
        grad = self._clipped(last, grad)
        for stage in range(last - 1, 0, -1):
            x = inputs[stage - 1]
            try:
                back, _ = await self._hop(
                    stage, request("backward"), [("g", grad)], None, only=path[stage - 1]
                )
            except ChainFailed:  # that peer lost our input (or left): forward and backward at once elsewhere
                self.retries += 1
                back, _ = await self._hop(stage, request("forward", grad=True), [("x", x), ("g", grad)], None)
            grad = self._clipped(stage, back.tensor)
        return loss, grad

    def _clipped(self, stage: int, grad: torch.Tensor | None) -> torch.Tensor:
        """The input gradient a peer of ``stage`` answered, each sample's norm clipped."""
        if grad is None:  # the client checked a training answer carries it; for the type checker
            raise ChainFailed(f"stage {stage} answered no gradient")
        clip = self.clips[stage]
        grad, norms = clip.clip(grad)
        clip.accept(norms)
        return grad

    async def _hop(
        self,
        stage: int,
        request: Request,
        tensors: list[tuple[str, torch.Tensor]],
        targets: torch.Tensor | None,
        only: str | None = None,
    ) -> tuple[Reply, str]:
        """One stage of a chain, on up to MAX_ATTEMPTS peers (just ``only`` if given)."""
        tried: list[str] = []
        errors: list[str] = []
        deadline = time.monotonic() + self._timeout
        attempts = 1 if only else MAX_ATTEMPTS
        while len(tried) < attempts:
            peer = only or self.router.choose(stage, exclude=tried)
            if peer is None:
                if tried or time.monotonic() > deadline:
                    break
                await asyncio.sleep(NO_PEER_WAIT_S)  # no live peer of that stage yet: the roster refreshes
                continue
            if tried:
                self.retries += 1
            tried.append(peer)
            self.router.started(peer)
            try:
                reply = await self.client.call(peer, stage, request, tensors, targets, self._timeout)
            except (StageError, CallFailed) as exc:
                self.router.finished(peer, request.samples, None, None)
                errors.append(f"{peer[-6:]}: {exc}")
                if isinstance(exc, StageError) and not exc.retry and "bad request" in str(exc):
                    break  # our own request is wrong: no other peer will take it either
                continue
            self.router.finished(peer, request.samples, reply.latency_s, reply.queue, reply.compute_s)
            return reply, peer
        raise ChainFailed(f"stage {stage}: " + ("; ".join(errors) or "no live peer"))
