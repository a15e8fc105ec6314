"""The outer step: pseudo-gradients, the identity case, Nesterov momentum, state and drift."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.config import AveragingSection, ModelSection
from swarm.learning import OuterOptimizer, build_model, drift

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none present)")


def perturb(model: nn.Module, scale: float = 0.01, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(scale * torch.randn(param.shape, generator=generator))


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_identity_with_own_pseudo_gradient_lr_one_no_momentum() -> None:
    model = build_model(ModelSection(n_layer=1, n_embd=32), seed=0)
    outer = OuterOptimizer(model, lr=1.0, momentum=0.0)
    perturb(model)  # stands in for the inner steps
    before = params(model)
    pseudo = outer.pseudo_gradient()
    assert all(g.dtype == torch.float32 for g in pseudo.values())
    assert set(pseudo) == set(before)  # the tied head appears once
    outer.apply(pseudo)
    for name, param in model.named_parameters():
        assert torch.allclose(param, before[name], atol=1e-7), name
        assert torch.equal(outer.anchor[name], param.detach())
    assert all(float(g.abs().max()) == 0 for g in outer.pseudo_gradient().values())


def reference_sgd(theta0: torch.Tensor, grads: list[torch.Tensor], lr: float, mu: float, nesterov: bool):
    """Hand-written SGD with momentum in torch's convention: b = mu b + g; step g + mu b (Nesterov) or b."""
    theta, buffer = theta0.clone(), torch.zeros_like(theta0)
    for g in grads:
        buffer = mu * buffer + g
        theta = theta - lr * (g + mu * buffer if nesterov else buffer)
    return theta


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_hand_computed_momentum_sgd(nesterov: bool) -> None:
    model = nn.Linear(3, 2)
    theta0 = params(model)
    outer = OuterOptimizer(model, lr=0.7, momentum=0.9, nesterov=nesterov)
    rng = torch.Generator().manual_seed(1)
    rounds = [{n: torch.randn(t.shape, generator=rng) for n, t in theta0.items()} for _ in range(3)]
    for averaged in rounds:
        perturb(model, seed=len(outer.momentum_buffers))  # local progress is discarded by apply
        outer.apply(averaged)
    torch_model = nn.Linear(3, 2)
    torch_model.load_state_dict(theta0)
    sgd = torch.optim.SGD(torch_model.parameters(), lr=0.7, momentum=0.9, nesterov=nesterov)
    for averaged in rounds:
        for name, param in torch_model.named_parameters():
            param.grad = averaged[name].clone()
        sgd.step()
    for name, param in model.named_parameters():
        expected = reference_sgd(theta0[name], [r[name] for r in rounds], 0.7, 0.9, nesterov)
        assert torch.allclose(param, expected, atol=1e-6)
        assert torch.allclose(param, dict(torch_model.named_parameters())[name], atol=1e-6)
    assert outer.rounds == 3


def test_state_dict_round_trip_continues_identically() -> None:
    config = AveragingSection(outer_lr=0.5, outer_momentum=0.8)
    model_a = nn.Linear(4, 4)
    outer_a = OuterOptimizer.from_config(model_a, config)
    perturb(model_a)
    outer_a.apply(outer_a.pseudo_gradient())
    model_b = nn.Linear(4, 4)
    model_b.load_state_dict(model_a.state_dict())
    outer_b = OuterOptimizer(model_b, lr=1.0, momentum=0.0)
    outer_b.load_state_dict(outer_a.state_dict())
    assert (outer_b.lr, outer_b.momentum, outer_b.rounds) == (0.5, 0.8, 1)
    for model, outer in ((model_a, outer_a), (model_b, outer_b)):
        perturb(model, seed=5)
        outer.apply(outer.pseudo_gradient())
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_mismatched_pseudo_gradients_are_refused() -> None:
    outer = OuterOptimizer(nn.Linear(2, 2), lr=1.0, momentum=0.0)
    with pytest.raises(ValueError, match="missing"):
        outer.apply({"weight": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="shape"):
        outer.apply({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})
    with pytest.raises(ValueError):
        OuterOptimizer(nn.Linear(2, 2), lr=1.0, momentum=1.0)


def test_drift_is_relative_l2_distance() -> None:
    b = {"w": torch.tensor([3.0, 0.0]), "v": torch.tensor([4.0])}
    a = {"w": torch.tensor([3.0, 1.0]), "v": torch.tensor([4.0])}
    assert drift(b, b) == 0.0
    assert drift(a, b) == pytest.approx(1 / 5)
    with pytest.raises(ValueError, match="differ"):
        drift({"w": b["w"]}, b)


def test_anchor_can_live_on_the_cpu() -> None:
    model = nn.Linear(2, 2)
    outer = OuterOptimizer(model, lr=1.0, momentum=0.5, state_device="cpu")
    assert all(t.device.type == "cpu" for t in outer.anchor.values())


@needs_cuda
def test_outer_step_on_cuda_with_cpu_state() -> None:
    model = nn.Linear(8, 8).cuda()
    outer = OuterOptimizer(model, lr=1.0, momentum=0.0, state_device="cpu")
    with torch.no_grad():
        model.weight.add_(1.0)
    before = params(model)
    pseudo = outer.pseudo_gradient()
    assert all(t.device.type == "cpu" for t in pseudo.values())
    outer.apply(pseudo)
    assert all(torch.allclose(p, before[n]) for n, p in model.named_parameters())
    assert model.weight.device.type == "cuda"
