"""The inner loop: device choice, optimizer groups, the schedule, accumulation and the slowdown knob."""

from __future__ import annotations

import itertools

import pytest
import torch

from swarm.config import EmulationSection, ModelSection, TrainSection
from swarm.learning import (
    InnerTrainer,
    auto_micro_batch_size,
    build_model,
    lr_at,
    make_inner_optimizer,
    resolve_device,
    total_samples_of,
)
from swarm.learning.inner import MIN_LR_RATIO, parameter_groups
from tests._learning import CPU, TINY, batches
from tests._markers import needs_cuda


def test_resolve_device() -> None:
    assert resolve_device("cpu") == CPU
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            resolve_device("cuda")


def test_no_weight_decay_on_biases_norms_and_embeddings() -> None:
    model = build_model(TINY, seed=0)
    decay, no_decay = parameter_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert "blocks.0.attn.qkv.weight" in decayed and "blocks.0.mlp.up.weight" in decayed
    assert not any(n.endswith("bias") or "ln" in n or n.startswith(("wte", "wpe")) for n in decayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert isinstance(make_inner_optimizer(model, TrainSection(), CPU), torch.optim.AdamW)


def test_schedule_warms_up_then_decays_to_the_floor() -> None:
    cfg = TrainSection(lr=1e-3, warmup_steps=10, batch_size=4)
    total = 1000
    warm = [lr_at(s, cfg, total) for s in range(0, 41)]
    assert all(a < b for a, b in itertools.pairwise(warm))
    assert warm[-1] == pytest.approx(1e-3)
    decay = [lr_at(s, cfg, total) for s in range(40, total + 1, 10)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert lr_at(total, cfg, total) == pytest.approx(MIN_LR_RATIO * 1e-3)
    assert lr_at(10 * total, cfg, total) == pytest.approx(MIN_LR_RATIO * 1e-3)
    assert lr_at(5000, cfg, None) == 1e-3
    assert total_samples_of(TrainSection(max_steps=50, batch_size=4), None) == 200
    assert total_samples_of(TrainSection(max_steps=50), 77) == 77
    assert total_samples_of(TrainSection(), None) is None


@pytest.mark.parametrize("micro", [4, 5])
def test_accumulated_micro_batches_give_the_full_batch_gradient(micro: int) -> None:
    cfg = TrainSection(batch_size=16, grad_clip=1e9)
    results = []
    for micro_batch_size in (16, micro):
        model = build_model(TINY, seed=0)
        # lr = 0: the step leaves the weights alone and the gradients in place for comparison.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        trainer = InnerTrainer(model, cfg, CPU, optimizer=optimizer, micro_batch_size=micro_batch_size)
        stats = trainer.step(batches(1))
        results.append((stats.loss, [p.grad.clone() for p in model.parameters()]))
    (full_loss, full_grads), (micro_loss, micro_grads) = results
    assert micro_loss == pytest.approx(full_loss, rel=1e-5)
    for a, b in zip(full_grads, micro_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_step_reports_stats_sets_lr_and_clips() -> None:
    trainer = InnerTrainer(build_model(TINY, seed=0), TrainSection(batch_size=16, grad_clip=0.5), CPU)
    assert trainer.micro_batch_size == 16
    stats = trainer.step(batches(1), lr=1e-2)
    assert stats.samples == 16 and stats.lr == 1e-2 and stats.loss > 0
    assert stats.seconds >= stats.compute_seconds > 0
    assert trainer.steps == 1
    total_norm = torch.norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))
    assert float(total_norm) <= 0.5 + 1e-4 < stats.grad_norm


def test_slowdown_sleeps_in_proportion_to_compute() -> None:
    slow = EmulationSection(slowdown=3.0)
    trainer = InnerTrainer(build_model(TINY, seed=0), TrainSection(batch_size=16), CPU, emulation=slow)
    stats = trainer.step(batches(1))
    assert stats.seconds >= 3.0 * stats.compute_seconds * 0.95


def test_auto_micro_batch_on_cpu_is_the_whole_batch() -> None:
    assert auto_micro_batch_size(build_model(TINY, seed=0), TINY.block_size, CPU, batch_size=24) == 24


@needs_cuda
def test_cuda_step_uses_8bit_adamw_bf16_and_checkpointing() -> None:
    import bitsandbytes as bnb

    device = torch.device("cuda")
    model = build_model(ModelSection(n_layer=2, n_head=4, n_embd=128, block_size=64), seed=0)
    trainer = InnerTrainer(model, TrainSection(batch_size=32), device, activation_checkpointing=True)
    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
    assert model.activation_checkpointing
    assert 1 <= trainer.micro_batch_size <= 32
    data = ((x.repeat(1, 4), y.repeat(1, 4)) for x, y in batches(20, 32))
    losses = [trainer.step(data, lr=3e-3).loss for _ in range(20)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


@needs_cuda
def test_auto_micro_batch_on_cuda_halves_until_it_fits() -> None:
    device = torch.device("cuda")
    model = build_model(TINY, seed=0).to(device)
    assert auto_micro_batch_size(model, TINY.block_size, device, batch_size=64) == 64
    # A memory fraction no batch can meet forces halving down to a clear error.
    with pytest.raises(RuntimeError, match="not even one sample"):
        auto_micro_batch_size(model, TINY.block_size, device, batch_size=8, memory_fraction=1e-12)
    assert all(p.grad is None for p in model.parameters())
