"""The model: shapes, deterministic construction, the forward contract, and that it learns."""

from __future__ import annotations

import pytest
import torch

from swarm.config import DataSection, ModelSection, TrainSection
from swarm.learning import (
    GPT,
    InnerTrainer,
    TrainBatches,
    build_model,
    count_parameters,
    evaluate,
    lm_loss,
    make_eval_set,
    open_source,
)
from tests._markers import needs_cuda

TINY = ModelSection(n_layer=1, n_head=2, n_embd=32, block_size=32)


def test_forward_shape_and_tied_head() -> None:
    model = build_model(ModelSection(), seed=0)
    logits = model(torch.randint(256, (3, 17)))
    assert logits.shape == (3, 17, 256)
    assert isinstance(model, GPT)
    assert model.lm_head.weight is model.wte.weight
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())


def test_longer_than_block_size_is_refused() -> None:
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, TINY.block_size + 1, dtype=torch.long))


def test_construction_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_model(TINY, seed=7), build_model(TINY, seed=7), build_model(TINY, seed=8)
    assert torch.equal(torch.rand(1), expected_next)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_causality_future_tokens_do_not_change_past_logits() -> None:
    model = build_model(TINY, seed=0).eval()
    idx = torch.randint(256, (1, 20))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 256
    assert torch.allclose(model(idx)[0, :10], model(changed)[0, :10], atol=1e-6)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    x = torch.randint(256, (2, 16))
    grads = []
    for flag in (False, True):
        model = build_model(TINY, seed=0, activation_checkpointing=flag)
        lm_loss(model, x, x).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, checkpointed in zip(*grads, strict=True):
        assert torch.allclose(plain, checkpointed, atol=1e-6)


def test_tiny_model_learns_stdlib_text() -> None:
    source = open_source(DataSection())
    model = build_model(TINY, seed=0)
    eval_set = make_eval_set(source, TINY.block_size, batch_size=16)
    before = evaluate(model, eval_set, batches=4)
    trainer = InnerTrainer(model, TrainSection(batch_size=16, lr=3e-3), torch.device("cpu"))
    batches = TrainBatches(source, TINY.block_size, 16, peer_key="solo", seed=0)
    losses = [trainer.step(batches).loss for _ in range(30)]
    after = evaluate(model, eval_set, batches=4)
    assert before == pytest.approx(8.0, abs=0.5)  # near-uniform at initialisation
    assert after < before - 2.0, (before, after)
    assert sum(losses[-5:]) < sum(losses[:5])


def test_hf_model_from_config_without_download() -> None:
    pytest.importorskip("transformers")
    config = ModelSection(
        kind="hf",
        block_size=32,
        hf_config={"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 32, "n_positions": 32},
    )
    a, b = build_model(config, seed=3).eval(), build_model(config, seed=3).eval()  # eval: no dropout
    x = torch.randint(256, (2, 8))
    assert a(x).shape == (2, 8, 256)
    assert torch.equal(a(x), b(x))
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    assert lm_loss(a, x, x).ndim == 0


def test_hf_config_needs_a_model_type() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match="model_type"):
        build_model(ModelSection(kind="hf", hf_config={"n_layer": 1}), seed=0)


@needs_cuda
def test_forward_backward_on_cuda_in_bf16() -> None:
    model = build_model(TINY, seed=0, activation_checkpointing=True).cuda()
    x = torch.randint(256, (4, 32), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = lm_loss(model, x, x)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
