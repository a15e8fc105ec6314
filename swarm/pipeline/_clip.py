"""Per-sample gradient clipping relative to the recent median: what a peer's gradient may weigh.

Used on both sides of a stage boundary. A stage server clips each sample's output gradient that a data
holder sends (:mod:`swarm.pipeline._compute`); a data holder clips each sample's input gradient that a
stage server answers (:mod:`swarm.pipeline._driver`), before it goes on to the stage below or into
stage 0's backward. Neither side can check the other's compute, so neither takes a gradient's size on
trust: one sample moves the receiver at most :data:`CLIP_FACTOR` times as much as a typical recent one.
"""

from __future__ import annotations

import collections
import statistics

import torch

CLIP_FACTOR = 4.0
"""A sample's gradient may be this many times the median norm of recent accepted ones."""
CLIP_WINDOW = 256
"""Per-sample norms of the latest accepted gradients that set the bound."""
CLIP_WARMUP = 16
"""Until this many are known, the bound is :data:`INITIAL_CLIP_NORM`."""
INITIAL_CLIP_NORM = 1.0
"""Per sample. The tiny test model's honest output gradients are about 0.12; a bound that is too low
only slows the first micro-batches, and the window's median takes over after :data:`CLIP_WARMUP`."""


class GradientClip:
    """Clips each sample's gradient by norm (one thread's only; not thread-safe).

    The bound is :data:`CLIP_FACTOR` times the median per-sample norm of the last :data:`CLIP_WINDOW`
    accepted samples (after clipping), or ``initial`` before :data:`CLIP_WARMUP` are known. A median
    moves only when most recent senders move it, so a minority of senders cannot raise it.
    """

    def __init__(self, initial: float = INITIAL_CLIP_NORM, factor: float = CLIP_FACTOR) -> None:
        if not (initial > 0 and factor >= 1):
            raise ValueError(f"GradientClip needs initial > 0 and factor >= 1, got {initial}, {factor}")
        self.initial, self.factor = initial, factor
        self._norms: collections.deque[float] = collections.deque(maxlen=CLIP_WINDOW)
        self.clipped = 0
        """Samples whose gradient was clipped."""

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
        """Samples with these (clipped) norms were used: they join the window."""
        self._norms.extend(norms)
