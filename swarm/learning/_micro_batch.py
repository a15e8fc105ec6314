"""How many samples one forward pass takes: chosen from free memory, and halved on out-of-memory.

The micro-batch is sized after the persistent state exists (the model, the outer state and the
exchange's buffers where they live on the device), against the memory that is *free* then, less what
is known to come later and is not there yet (the inner optimizer's state, made at its first step).
Other processes on the GPU, allocator fragmentation and the exchange's temporaries can still exhaust
it mid-run; :class:`swarm.learning.InnerTrainer` then halves the micro-batch and retries the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from swarm.learning._precision import Precision, resolve_precision
from swarm.learning.model import lm_loss

logger = logging.getLogger(__name__)

MEMORY_FRACTION = 0.9
"""Share of the free memory (less the reserve) a micro-batch's forward and backward may take."""


_OOM_MESSAGES = ("out of memory", "can't allocate memory", "not enough memory")
"""How allocators word it: CUDA, ROCm and MPS ("out of memory"), the CPU's ("DefaultCPUAllocator:
can't allocate memory", "not enough memory")."""


class OutOfDeviceMemory(RuntimeError):
    """Out of memory where halving the micro-batch cannot help (at a micro-batch of 1, or in the
    optimizer step again and again): the peer moves its outer state to host memory, or stops with the
    advice of ``swarm config check``."""


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an allocator out-of-memory (CUDA, ROCm, MPS, or the CPU's allocator)."""
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None), torch.cuda.OutOfMemoryError) if t is not None
    )
    if isinstance(error, oom_types):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(m in message for m in _OOM_MESSAGES)


def release_cached(device: torch.device) -> None:
    """Hand the allocator's cached blocks on ``device`` back (CUDA; nothing elsewhere).

    Call it after an out-of-memory error was handled, never in a ``finally`` or an ``except`` block
    while the error propagates: its traceback holds the frames that hold the activations, so nothing
    would be freed."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def largest_fitting(batch_size: int, fits: Callable[[int], bool]) -> int:
    """The largest of ``batch_size, batch_size // 2, ...`` that ``fits``; raises when not even 1 does."""
    candidate = batch_size
    while candidate >= 1:
        if fits(candidate):
            return candidate
        candidate //= 2
    raise RuntimeError("not even a micro-batch of one sample fits in memory")


def auto_micro_batch_size(
    model: nn.Module,
    block_size: int,
    device: torch.device,
    batch_size: int = 16,
    vocab_size: int = 256,
    *,
    reserve_bytes: int = 0,
    precision: Precision | None = None,
    memory_fraction: float = MEMORY_FRACTION,
    free_bytes: int | None = None,
    probe: Callable[[int], int] | None = None,
) -> int:
    """The largest micro-batch (at most ``batch_size``, halving) whose forward and backward fit.

    On CUDA, a candidate fits when the memory its forward and backward allocate beyond what is held
    now (the gradients, made at the first backward, included) is at most ``memory_fraction`` of the
    free memory less ``reserve_bytes`` (state still to come, such as the inner optimizer's). An
    out-of-memory during the probe means it does not fit. ``free_bytes`` and ``probe`` (candidate ->
    bytes allocated) replace the device's answers in tests. Elsewhere memory is not probed and the
    whole batch is one micro-batch (the step halves it on out-of-memory).
    """
    if device.type != "cuda" and probe is None:
        return batch_size
    if free_bytes is None:
        free_bytes = int(torch.cuda.mem_get_info(device)[0])
    budget = memory_fraction * free_bytes - reserve_bytes
    run = probe or (lambda n: _probe_cuda(model, n, block_size, device, vocab_size, precision))

    def fits(candidate: int) -> bool:
        try:
            used: int | None = run(candidate)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            used = None
        release_cached(device)  # after the handler: the error's traceback no longer holds the activations
        return used is not None and used <= budget

    if budget <= 0:
        logger.warning(
            "%.2f GiB free on %s and %.2f GiB still to come: starting at a micro-batch of 1",
            free_bytes / 2**30,
            device,
            reserve_bytes / 2**30,
        )
        return 1
    try:
        micro = largest_fitting(batch_size, fits)
    except RuntimeError:
        raise RuntimeError(f"not even one sample of {block_size} tokens fits on {device}") from None
    logger.info(
        "micro-batch size %d fits on %s (%.2f GiB free, %.2f GiB reserved for state to come)",
        micro,
        device,
        free_bytes / 2**30,
        reserve_bytes / 2**30,
    )
    return micro


def _probe_cuda(
    model: nn.Module,
    candidate: int,
    block_size: int,
    device: torch.device,
    vocab_size: int,
    precision: Precision | None,
) -> int:
    """Bytes one forward and backward of ``candidate`` samples allocate beyond what is held now, in the
    run's precision (``auto`` resolved for this device when none is given). The caller empties the
    allocator's cache once an out-of-memory error is handled (:func:`release_cached`)."""
    precision = precision or resolve_precision("auto", device)
    held = torch.cuda.memory_allocated(device)
    try:
        return _forward_backward(model, candidate, block_size, device, vocab_size, precision) - held
    finally:
        model.zero_grad(set_to_none=True)


def _forward_backward(
    model: nn.Module,
    candidate: int,
    block_size: int,
    device: torch.device,
    vocab_size: int,
    precision: Precision,
) -> int:
    """Peak bytes allocated by one forward and backward; its tensors are gone when it returns or raises
    (only a traceback still referring to this frame keeps them)."""
    torch.cuda.reset_peak_memory_stats(device)
    x = torch.randint(vocab_size, (candidate, block_size), device=device)
    with precision.autocast(device, cache=not getattr(model, "activation_checkpointing", False)):
        loss = lm_loss(model, x, x)
    loss.backward()
    return int(torch.cuda.max_memory_allocated(device))
