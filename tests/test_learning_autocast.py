"""Autocast's 16-bit copies of the weights: how many are alive at once, measured, against the estimate.

The copies are counted by a dispatch mode that sees every cast of a parameter and follows the life of
the storage it made, so the count is exact and does not depend on the allocator or the clock.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from swarm.config import ModelSection, TrainSection
from swarm.learning import InnerTrainer, build_model
from swarm.learning._precision import Precision
from swarm.learning.estimate import autocast_copy_bytes
from swarm.learning.evaluation import EvalSet, evaluate

MODEL = ModelSection(n_layer=4, n_head=4, n_embd=64, block_size=32)
CPU = torch.device("cpu")


class WeightCopies(TorchDispatchMode):
    """The peak bytes of bf16 copies of parameters (leaf tensors that require grad) alive at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.casts = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        is_param = isinstance(source, torch.Tensor) and source.is_leaf and source.requires_grad
        if func is torch.ops.aten._to_copy.default and is_param:
            for tensor in tree_flatten(out)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16:
                    storage = tensor.untyped_storage()
                    self.casts += 1
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes


def _batches(batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(256, (batch_size, MODEL.block_size + 1), generator=generator)
        yield x[:, :-1], x[:, 1:]


def _trainer(checkpointing: bool, batch_size: int = 4) -> InnerTrainer:
    model = build_model(MODEL, 0)
    cfg = TrainSection(batch_size=batch_size, micro_batch_size=2, precision="bf16")
    trainer = InnerTrainer(model, cfg, CPU, block_size=MODEL.block_size)
    trainer.model.activation_checkpointing = checkpointing  # the trainer turns it on on CUDA only
    return trainer


def _step_peak(trainer: InnerTrainer) -> int:
    with WeightCopies() as copies:
        trainer.step(_batches(trainer.cfg.batch_size))
    assert copies.casts > 0 and copies.live == 0  # every copy made was freed by the end of the step
    return copies.peak


def test_checkpointed_training_holds_one_blocks_copies_not_the_whole_models() -> None:
    """With activation checkpointing the copies alive at once are one block's and the head's, as the
    estimate counts them, not a copy of every weight (the autocast cache's)."""
    trainer = _trainer(checkpointing=True)
    full, checkpointed = autocast_copy_bytes(trainer.model, 2)
    peak = _step_peak(trainer)
    assert peak <= checkpointed < full / 2
    # the recomputed blocks hold their copies: this is a real peak, not a missed count
    assert peak > checkpointed / 2


def test_without_checkpointing_the_copies_of_every_weight_live_until_the_backward() -> None:
    trainer = _trainer(checkpointing=False)
    full, _ = autocast_copy_bytes(trainer.model, 2)
    assert full / 2 < _step_peak(trainer) <= full


def test_a_checkpointed_step_computes_what_a_plain_one_does() -> None:
    plain, checkpointed = _trainer(checkpointing=False), _trainer(checkpointing=True)
    for trainer in (plain, checkpointed):
        trainer.step(_batches(trainer.cfg.batch_size))
    for a, b in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_an_evaluation_holds_one_weights_copy_at_a_time() -> None:
    model: nn.Module = build_model(MODEL, 0)
    eval_set = EvalSet(torch.randint(256, (4096,), dtype=torch.uint8), MODEL.block_size, batch_size=4)
    largest = max(p.numel() for p in model.parameters())
    with WeightCopies() as copies:
        evaluate(model, eval_set, batches=2, precision=Precision("bf16"))
    assert 0 < copies.peak <= 2 * 2 * largest


def test_a_model_without_blocks_holds_every_copy_whether_checkpointed_or_not() -> None:
    """Nothing is recomputed block by block: the copies are counted once, not once per block and once
    again as layers outside the blocks."""
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    params = sum(p.numel() for p in model.parameters())
    assert autocast_copy_bytes(model, 2) == (2 * params, 2 * params)
