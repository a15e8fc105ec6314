"""The inner (local) loop: AdamW steps on this peer's own batches between two syncs.

One :meth:`InnerTrainer.step` is one optimizer step on ``train.batch_size`` samples, computed in
micro-batches whose gradients are accumulated, so a peer whose GPU holds fewer samples at once
still takes the same steps as one that holds them all.

The learning rate follows the *swarm's* progress (samples processed by all peers together, as the
membership records report it), not this peer's step count: a peer that joins late starts at the
learning rate the swarm is at, instead of warming up again from zero.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from swarm._device import describe_device
from swarm.config import EmulationSection, TrainSection
from swarm.learning._micro_batch import OutOfDeviceMemory, auto_micro_batch_size, is_oom, release_cached
from swarm.learning._optimizer import (
    make_inner_optimizer,
    optimizer_name,
    optimizer_state_bytes,
    parameter_groups,  # noqa: F401  # re-exported: the hivemind baseline and tests import it from here
)
from swarm.learning._precision import resolve_precision
from swarm.learning._prefetch import Prefetcher
from swarm.learning._throughput import (
    Throughput,
    flops_per_token,
    model_dims,
    peak_flops,
    peak_memory_bytes,
)
from swarm.learning.evaluation import Interrupted, nats_to_bits
from swarm.learning.model import count_parameters, lm_loss

logger = logging.getLogger(__name__)

MIN_LR_RATIO = 0.1
"""The cosine schedule ends at this fraction of the peak learning rate."""
MAX_UPDATE_OOMS = 3
"""Optimizer steps in a row that may run out of memory (each skipped) before the step gives up:
:class:`~swarm.learning._micro_batch.OutOfDeviceMemory`, for the peer to change its layout or stop."""


def resolve_device(spec: str = "auto") -> torch.device:
    """``'auto'`` is CUDA when a GPU is present, else Apple's MPS when present, else the CPU; anything
    else is used as given."""
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device is {spec!r} but no CUDA device is available")
    if device.type == "mps" and not _mps_available():
        raise RuntimeError(f"train.device is {spec!r} but this torch has no MPS device")
    return device


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def lr_at(progress_samples: int, train_cfg: TrainSection, total_samples: int | None) -> float:
    """Learning rate after the swarm processed ``progress_samples`` samples.

    Linear warm-up over ``warmup_steps * batch_size`` samples, then a cosine decay from ``lr`` to
    ``MIN_LR_RATIO * lr`` at ``total_samples`` (and flat after it). Without ``total_samples`` the
    rate stays at ``lr`` after the warm-up.
    """
    peak = train_cfg.lr
    warmup = train_cfg.warmup_steps * train_cfg.batch_size
    if progress_samples < warmup:
        return peak * (progress_samples + 1) / (warmup + 1)
    if total_samples is None or total_samples <= warmup:
        return peak
    done = min(1.0, (progress_samples - warmup) / (total_samples - warmup))
    floor = MIN_LR_RATIO * peak
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * done))


def total_samples_of(train_cfg: TrainSection, target_samples: int | None) -> int | None:
    """Length of the schedule: ``run.target_samples``, else ``max_steps * batch_size``, else none."""
    if target_samples is not None:
        return target_samples
    if train_cfg.max_steps is not None:
        return train_cfg.max_steps * train_cfg.batch_size
    return None


@dataclass(frozen=True)
class StepStats:
    """What one inner step did.

    ``loss`` is the batch's mean training loss in bits per token (bits per byte for byte-level data),
    the unit of the held-out loss, so that the two compare directly. ``seconds`` is wall time
    including any padding; ``compute_seconds`` is the part really spent in forward, backward and the
    optimizer step; ``device_seconds`` is how long the (possibly emulated) device was busy: the
    compute, or ``emulation.step_time_s`` when that is longer, times ``emulation.slowdown``.
    """

    loss: float
    samples: int
    seconds: float
    compute_seconds: float
    lr: float
    grad_norm: float
    device_seconds: float = 0.0


def _abandon_if(stop: threading.Event | None, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`Interrupted` once ``stop`` is set, dropping the gradients accumulated so far."""
    if stop is not None and stop.is_set():
        optimizer.zero_grad(set_to_none=True)
        raise Interrupted("inner step abandoned: stopping")


class InnerTrainer:
    """Takes inner optimizer steps on a model, one batch from an iterator of ``(x, y)`` at a time.

    ``train.precision`` picks the autocast type (and a loss scaler for fp16, see
    :mod:`swarm.learning._precision`); ``train.compile`` runs the forward through :func:`torch.compile`.
    Without ``micro_batch_size`` (nor ``train.micro_batch_size``) the micro-batch is sized from the
    memory free now, less the inner optimizer's state when it does not exist yet and
    ``reserve_bytes``: build the trainer after the rest of the persistent state.
    """

    def __init__(
        self,
        model: nn.Module,
        train_cfg: TrainSection,
        device: torch.device,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        micro_batch_size: int | None = None,
        activation_checkpointing: bool = False,
        block_size: int | None = None,
        emulation: EmulationSection | None = None,
        reserve_bytes: int = 0,
    ) -> None:
        self.model = model.to(device)
        self.device = device
        self.cfg = train_cfg
        self.emulation = emulation or EmulationSection()
        self.precision = resolve_precision(train_cfg.precision, device)
        self.scaler = self.precision.grad_scaler(device)
        self._owns_optimizer = optimizer is None
        self.optimizer = optimizer or make_inner_optimizer(self.model, train_cfg, device)
        self.optimizer_name = optimizer_name(self.optimizer)
        self.model.activation_checkpointing = activation_checkpointing and device.type == "cuda"
        self.forward_model: nn.Module = self.model
        if train_cfg.compile:
            self.forward_model = torch.compile(self.model)
        self.block_size = block_size or getattr(model, "block_size", None)
        micro = micro_batch_size or train_cfg.micro_batch_size
        if micro is None:
            if self.block_size is None:
                raise ValueError("pass block_size to size micro-batches automatically")
            eight_bit = self.optimizer_name == "adamw8bit"
            pending = 0 if self.optimizer.state else optimizer_state_bytes(self.model, eight_bit)
            micro = auto_micro_batch_size(
                self.model,
                self.block_size,
                device,
                train_cfg.batch_size,
                reserve_bytes=pending + reserve_bytes,
                precision=self.precision,
            )
        self.micro_batch_size = min(micro, train_cfg.batch_size)
        self.steps = 0
        self.oom_retries = 0
        self.skipped_updates = 0
        self._update_ooms = 0
        layers, hidden = model_dims(self.model)
        device_name = describe_device(str(device))[0]
        self.throughput = Throughput(
            flops_per_token(count_parameters(self.model), layers, hidden, self.block_size or 0),
            peak_flops(device_name, self.precision.name) if device.type == "cuda" else None,
        )
        logger.info(
            "training on %s in %s with %s, micro-batch %d%s",
            device_name,
            self.precision.name,
            self.optimizer_name,
            self.micro_batch_size,
            ", compiled" if train_cfg.compile else "",
        )

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def free_gradients(self) -> None:
        """Drop the last step's gradients (the next step starts without them anyway), so that an
        evaluation has their memory; kept when the optimizer is not ours (hivemind's may need them)."""
        if self._owns_optimizer:
            self.optimizer.zero_grad(set_to_none=True)

    def summary(self) -> dict[str, Any]:
        """What this trainer chose and measured: precision, optimizer, micro-batch, tokens/s, MFU and
        peak memory (None where unknown), for summaries and reports."""
        return {
            "precision": self.precision.name,
            "optimizer": self.optimizer_name,
            "micro_batch_size": self.micro_batch_size,
            "compiled": self.cfg.compile,
            "oom_retries": self.oom_retries,
            "skipped_updates": self.skipped_updates,
            "compute_tokens_per_second": self.throughput.tokens_per_s,
            "mfu": self.throughput.mfu,
            "peak_memory_bytes": peak_memory_bytes(self.device),
        }

    def step(
        self,
        batch_iter: Iterator[tuple[torch.Tensor, torch.Tensor]],
        *,
        lr: float | None = None,
        guard: Callable[[], AbstractContextManager[Any]] | None = None,
        stop: threading.Event | None = None,
    ) -> StepStats:
        """One optimizer step on the next batch of ``batch_iter``, at ``lr`` when given.

        A set ``stop`` abandons the step before its next micro-batch and before the parameter update
        (:class:`~swarm.learning.evaluation.Interrupted`): the gradients are dropped, the parameters
        and the optimizer state are those of the last step, and the drawn batch is not trained on.

        Out of memory in a forward or backward pass is not fatal: the gradients are dropped, the
        micro-batch is halved (the step still covers the whole batch, in more micro-batches) and the
        step starts over on the same batch.

        ``guard()`` is entered around the optimizer's in-place parameter update only (forward and
        backward only read the parameters), so that another thread may copy them meanwhile. An
        optimizer that talks to the network inside ``step`` (the hivemind baseline) says how long it
        waited in its ``communication_seconds`` attribute; that time is not device time.

        An emulated device (``emulation.step_time_s``, 0 = off) pads the step by sleeping until it took
        at least that long, the way a process sits idle while its accelerator works; ``emulation.slowdown``
        (1 = off) then stretches the device time by that factor, so that one machine can host "slow"
        and "fast" peers of the same model.
        """
        if lr is not None:
            self.set_lr(lr)
        started = time.perf_counter()
        x, y = batch_iter.draw(stop) if isinstance(batch_iter, Prefetcher) else next(batch_iter)
        samples = len(x)
        compute_started = time.perf_counter()
        self.model.train()
        total_loss = self._accumulate_retrying(x, y, stop)
        _abandon_if(stop, self.optimizer)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        waited = getattr(self.optimizer, "communication_seconds", 0.0)
        with guard() if guard is not None else contextlib.nullcontext():
            self._update()
            mean_loss = nats_to_bits(float(total_loss / samples))  # also waits for the device to finish
        waited = getattr(self.optimizer, "communication_seconds", 0.0) - waited
        compute = time.perf_counter() - compute_started - waited
        device = max(compute, self.emulation.step_time_s) * self.emulation.slowdown
        if device > compute:
            time.sleep(device - compute)
        self.steps += 1
        self.throughput.record(x.numel(), compute)
        return StepStats(
            loss=mean_loss,
            samples=samples,
            seconds=time.perf_counter() - started,
            compute_seconds=compute,
            lr=self.optimizer.param_groups[0]["lr"],
            grad_norm=float(grad_norm),
            device_seconds=device,
        )

    def _update(self) -> None:
        """The optimizer's step. Out of memory in it (the 8-bit state made at the first step, a fused
        kernel's workspace) skips this step's update, with the gradients dropped: the optimizer state
        of a tensor the step did reach is updated, the others are not, the parameters move as far as
        it got. :data:`MAX_UPDATE_OOMS` in a row raise :class:`OutOfDeviceMemory`."""
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
                self.scaler.update()
            else:
                self.optimizer.step()
            self._update_ooms = 0
            return
        except RuntimeError as error:
            if not is_oom(error):
                raise
            message = _first_line(error)
        # outside the handler: its traceback no longer holds the step's temporaries
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()  # the unscaled gradients are gone: the scaler starts its next step afresh
        release_cached(self.device)
        self.skipped_updates += 1
        self._update_ooms += 1
        logger.warning("out of memory in the optimizer step (%s): this step's update is skipped", message)
        if self._update_ooms >= MAX_UPDATE_OOMS:
            raise OutOfDeviceMemory(
                f"the optimizer step ran out of memory {self._update_ooms} times in a row on {self.device}"
            )

    def _accumulate_retrying(
        self, x: torch.Tensor, y: torch.Tensor, stop: threading.Event | None
    ) -> torch.Tensor:
        """:meth:`_accumulate`, halving the micro-batch and starting over on out-of-memory; at a
        micro-batch of 1 it raises :class:`OutOfDeviceMemory` (with nothing of the step kept)."""
        while True:
            self.optimizer.zero_grad(set_to_none=True)
            try:
                return self._accumulate(x, y, stop)
            except RuntimeError as error:
                if not is_oom(error):
                    raise
                message = _first_line(error)
            # outside the handler: the traceback, and the activations its frames hold, are gone
            if self.micro_batch_size == 1:
                self.optimizer.zero_grad(set_to_none=True)
                release_cached(self.device)
                where = f"a micro-batch of 1 sample on {self.device}"
                raise OutOfDeviceMemory(f"out of memory at {where}: {message}")
            self._shrink(message)

    def _shrink(self, message: str) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        release_cached(self.device)
        old, self.micro_batch_size = self.micro_batch_size, self.micro_batch_size // 2
        if self.oom_retries == 0:
            logger.warning(
                "out of memory at a micro-batch of %d (%s): retrying the step at %d, and halving again "
                "whenever it recurs (logged once)",
                old,
                message,
                self.micro_batch_size,
            )
        else:
            logger.debug("out of memory again: micro-batch %d -> %d", old, self.micro_batch_size)
        self.oom_retries += 1

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, stop: threading.Event | None) -> torch.Tensor:
        """Forward and backward of ``(x, y)`` in micro-batches; gradients of the batch mean accumulate
        in the parameters. Returns the summed (not mean) loss in nats."""
        samples = len(x)
        total_loss = torch.zeros((), device=self.device)
        cache = not self.model.activation_checkpointing  # see Precision.autocast
        for xs, ys in zip(x.split(self.micro_batch_size), y.split(self.micro_batch_size), strict=True):
            _abandon_if(stop, self.optimizer)
            xs = xs.to(self.device, non_blocking=True)
            ys = ys.to(self.device, non_blocking=True)
            with self.precision.autocast(self.device, cache=cache):
                loss = lm_loss(self.forward_model, xs, ys)
            # Weight each micro-batch by its share of the samples: the sum is the full-batch mean.
            weighted = loss * (len(xs) / samples)
            (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
            total_loss += loss.detach() * len(xs)
        return total_loss


def _first_line(error: BaseException) -> str:
    """The first line of an error's message (an allocator's runs on for lines), at most 200 characters."""
    return (str(error).splitlines() or [""])[0][:200]
