"""A tiny model and random byte batches shared by the tests of the inner loop and of the device."""

from __future__ import annotations

from collections.abc import Iterator

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
