"""A tiny model and random byte batches shared by the tests of the inner loop and of the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from swarm.config import ModelSection

TINY = ModelSection(n_layer=1, n_head=2, n_embd=32, block_size=16)
CPU = torch.device("cpu")


def batches(count: int, batch_size: int = 16, seed: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (inputs, targets) batches of random bytes, next-byte targets, ``TINY.block_size`` long."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        x = torch.randint(256, (batch_size, TINY.block_size + 1), generator=generator)
        yield x[:, :-1], x[:, 1:]


def _cuda_out_of_memory(samples: int) -> None:
    raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {samples} samples")


class OutOfMemoryAbove(torch.nn.Module):
    """A model that runs out of memory on batches of more than ``limit`` samples: ``run_out(samples)``
    fails there (by default with CUDA's error, as CUDA would; a test may allocate for real instead).
    ``sizes`` records every batch size it was called with."""

    def __init__(
        self, inner: torch.nn.Module, limit: int, run_out: Callable[[int], object] = _cuda_out_of_memory
    ) -> None:
        super().__init__()
        self.inner, self.limit, self.block_size = inner, limit, inner.block_size
        self.run_out = run_out
        self.sizes: list[int] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.sizes.append(len(idx))
        if len(idx) > self.limit:
            self.run_out(len(idx))
        return self.inner(idx)
