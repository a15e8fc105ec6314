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

from swarm.config import EmulationSection, TrainSection
from swarm.training.evaluation import Interrupted, nats_to_bits
from swarm.training.model import lm_loss

logger = logging.getLogger(__name__)

MIN_LR_RATIO = 0.1
"""The cosine schedule ends at this fraction of the peak learning rate."""


def resolve_device(spec: str = "auto") -> torch.device:
    """``'auto'`` is CUDA when a GPU is present, else the CPU; anything else is used as given."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"train.device is {spec!r} but no CUDA device is available")
    return device


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decay; biases, norm gains and embeddings do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_inner_optimizer(
    model: nn.Module, train_cfg: TrainSection, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay; bitsandbytes' 8-bit AdamW on CUDA (a quarter of the state)."""
    groups = parameter_groups(model, train_cfg.weight_decay)
    betas = (0.9, 0.95)
    if device.type == "cuda":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=train_cfg.lr, betas=betas)
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=betas)


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


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)


def auto_micro_batch_size(
    model: nn.Module,
    block_size: int,
    device: torch.device,
    batch_size: int = 16,
    vocab_size: int = 256,
    memory_fraction: float = 0.85,
) -> int:
    """The largest micro-batch (at most ``batch_size``) whose forward and backward fit in memory.

    On CUDA, tries ``batch_size`` and halves on out-of-memory (or when the peak exceeds
    ``memory_fraction`` of the device, to leave room for optimizer state). On the CPU memory is not
    probed and the whole batch is one micro-batch.
    """
    if device.type != "cuda":
        return batch_size
    total = torch.cuda.get_device_properties(device).total_memory
    candidate = batch_size
    while candidate >= 1:
        try:
            torch.cuda.reset_peak_memory_stats(device)
            x = torch.randint(vocab_size, (candidate, block_size), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(model, x, x)
            loss.backward()
            fits = torch.cuda.max_memory_allocated(device) <= memory_fraction * total
        except RuntimeError as error:
            if not _is_oom(error):
                raise
            fits = False
        finally:
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        if fits:
            logger.info("micro-batch size %d fits on %s", candidate, device)
            return candidate
        candidate //= 2
    raise RuntimeError(f"not even one sample of {block_size} tokens fits on {device}")


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
    """Takes inner optimizer steps on a model, one batch from an iterator of ``(x, y)`` at a time."""

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
    ) -> None:
        self.model = model.to(device)
        self.device = device
        self.cfg = train_cfg
        self.emulation = emulation or EmulationSection()
        self.optimizer = optimizer or make_inner_optimizer(self.model, train_cfg, device)
        self.use_autocast = device.type == "cuda"
        self.model.activation_checkpointing = activation_checkpointing and device.type == "cuda"
        micro = micro_batch_size or train_cfg.micro_batch_size
        if micro is None:
            block_size = block_size or getattr(model, "block_size", None)
            if block_size is None:
                raise ValueError("pass block_size to size micro-batches automatically")
            micro = auto_micro_batch_size(self.model, block_size, device, train_cfg.batch_size)
        self.micro_batch_size = min(micro, train_cfg.batch_size)
        self.steps = 0

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

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
        (:class:`~swarm.training.evaluation.Interrupted`): the gradients are dropped, the parameters
        and the optimizer state are those of the last step, and the drawn batch is not trained on.

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
        x, y = next(batch_iter)
        samples = len(x)
        compute_started = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = 0.0
        for xs, ys in zip(x.split(self.micro_batch_size), y.split(self.micro_batch_size), strict=True):
            _abandon_if(stop, self.optimizer)
            xs = xs.to(self.device, non_blocking=True)
            ys = ys.to(self.device, non_blocking=True)
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_autocast):
                loss = lm_loss(self.model, xs, ys)
            # Weight each micro-batch by its share of the samples: the sum is the full-batch mean.
            (loss * (len(xs) / samples)).backward()
            total_loss += loss.detach() * len(xs)
        _abandon_if(stop, self.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        waited = getattr(self.optimizer, "communication_seconds", 0.0)
        with guard() if guard is not None else contextlib.nullcontext():
            self.optimizer.step()
            mean_loss = nats_to_bits(float(total_loss / samples))  # also waits for the device to finish
        waited = getattr(self.optimizer, "communication_seconds", 0.0) - waited
        compute = time.perf_counter() - compute_started - waited
        device = max(compute, self.emulation.step_time_s) * self.emulation.slowdown
        if device > compute:
            time.sleep(device - compute)
        self.steps += 1
        return StepStats(
            loss=mean_loss,
            samples=samples,
            seconds=time.perf_counter() - started,
            compute_seconds=compute,
            lr=self.optimizer.param_groups[0]["lr"],
            grad_norm=float(grad_norm),
            device_seconds=device,
        )
