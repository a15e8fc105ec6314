"""Which number format a peer computes in: ``train.precision``, resolved for this peer's device.

Mixed precision keeps the weights, gradients and optimizer state in float32 and runs the forward and
backward passes under :func:`torch.autocast` in a 16-bit type:

* ``bf16`` where the GPU computes it natively (Ampere and newer, :func:`torch.cuda.is_bf16_supported`);
* ``fp16`` with a :class:`torch.amp.GradScaler` otherwise (T4, V100, RTX 20xx, and the P100, sm_60):
  fp16 has bf16's speed on those cards but a narrow exponent, so the loss is scaled up before the
  backward pass and the gradients down before the update, and a step whose gradients overflowed is
  skipped;
* ``fp32`` on the CPU, where autocast brings no speed for these models, and on GPUs older than
  Volta (compute capability below 7.0) except the P100: Pascal GeForce cards and Maxwell compute
  fp16 at 1/64 (or less) of their fp32 rate.

``train.precision`` is per peer: the parameters every peer exchanges are float32 whatever it computes
in, so a swarm can mix cards of each kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

PrecisionName = Literal["bf16", "fp16", "fp32"]
PRECISIONS: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Precision:
    """A resolved ``train.precision``: the autocast type (None: plain float32) and whether the loss
    is scaled."""

    name: PrecisionName

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.name)

    @property
    def uses_scaler(self) -> bool:
        return self.name == "fp16"

    @property
    def half_bytes(self) -> int:
        """Bytes per element of the autocast copies of the weights (0 without autocast)."""
        return 0 if self.autocast_dtype is None else 2

    def autocast(self, device: torch.device, *, cache: bool = True) -> torch.autocast:
        """The autocast context of this precision on ``device`` (disabled for fp32).

        ``cache``: autocast's weight cache, which keeps the 16-bit copy of every weight it casts until
        the context exits, ``2 P`` at the end of a forward pass. Where autograd saves those copies for
        the backward pass anyway (a forward without activation checkpointing) the cache costs nothing;
        under activation checkpointing (pass ``cache=False``) a checkpointed block saves nothing, so
        without the cache its copies go as each op ends, and its recomputation in the backward pass
        holds that one block's copies. Without gradients (an evaluation) the cache only costs memory."""
        dtype = self.autocast_dtype
        return torch.autocast(
            device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None, cache_enabled=cache
        )

    def grad_scaler(self, device: torch.device) -> torch.amp.GradScaler | None:
        """A loss scaler for fp16, None otherwise."""
        return torch.amp.GradScaler(device.type) if self.uses_scaler else None


FAST_FP16_CAPABILITY = (7, 0)
"""Compute capability from which a GPU computes fp16 at least at its fp32 rate (Volta); below it only
the P100 (sm_60) does (:data:`FAST_FP16_EXCEPTIONS`)."""
FAST_FP16_EXCEPTIONS = frozenset({(6, 0)})


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def fast_fp16(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability computes fp16 fast (module docstring)."""
    return capability >= FAST_FP16_CAPABILITY or capability in FAST_FP16_EXCEPTIONS


def _mps_bf16(device: torch.device) -> bool:
    """Whether MPS computes bf16 here (macOS 14 and a recent torch): try one operation."""
    try:
        (torch.ones(2, device=device, dtype=torch.bfloat16) * 2).sum().item()
    except (RuntimeError, TypeError):
        return False
    return True


def half_dtype(
    device: torch.device, *, bf16_supported: Callable[[torch.device], bool] | None = None
) -> torch.dtype:
    """The 16-bit type to keep compact copies in on ``device`` (a progress, a snapshot): bfloat16
    (float32's range) where the device has it, float16 on an MPS device that has not (macOS 13)."""
    if device.type != "mps":
        return torch.bfloat16
    return torch.bfloat16 if (bf16_supported or _mps_bf16)(device) else torch.float16


def _cuda_bf16(device: torch.device) -> bool:
    try:
        with torch.cuda.device(device):
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch before 2.3 has no including_emulation (and did not emulate)
        return bool(torch.cuda.is_bf16_supported())


def resolve_precision(
    spec: str,
    device: torch.device,
    *,
    bf16_supported: Callable[[torch.device], bool] = _cuda_bf16,
    capability: Callable[[torch.device], tuple[int, int]] = _cuda_capability,
) -> Precision:
    """``train.precision`` for ``device``: ``auto`` is bf16 on a GPU that has it natively, fp16 (with a
    loss scaler) on one that does not but computes fp16 fast, fp32 on older GPUs and the CPU; anything
    else is used as given.

    ``bf16_supported`` and ``capability`` ask the GPU (tests pass fakes). Apple's MPS gets fp16, which
    every MPS device computes natively (bf16 needs macOS 14 and a recent torch).
    """
    if spec not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, not {spec!r}")
    if spec != "auto":
        return Precision(spec)  # type: ignore[arg-type]
    if device.type == "cuda":
        if bf16_supported(device):
            return Precision("bf16")
        return Precision("fp16" if fast_fp16(capability(device)) else "fp32")
    if device.type == "mps":
        return Precision("fp16")
    return Precision("fp32")
