"""OuterOptimizer's public access to the model's parameters: copy_parameters and load_parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from swarm.learning import OuterOptimizer


def _outer() -> tuple[nn.Linear, OuterOptimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, OuterOptimizer(model, lr=1.0, momentum=0.0)


def test_loaded_parameters_reach_the_model_and_are_measured_from_the_old_anchor() -> None:
    model, outer = _outer()
    anchor = {name: t.clone() for name, t in outer.anchor.items()}
    new_weight = torch.full_like(model.weight, 0.5)
    outer.load_parameters({"weight": new_weight})
    assert torch.equal(model.weight.detach(), new_weight)
    assert torch.equal(model.bias.detach(), anchor["bias"])  # a name left out stays as it was
    assert all(torch.equal(outer.anchor[n], anchor[n]) for n in anchor)  # the anchor is not moved
    gradient = outer.pseudo_gradient()
    assert torch.equal(gradient["weight"], anchor["weight"] - new_weight)
    assert torch.equal(gradient["bias"], torch.zeros_like(model.bias))


def test_a_loaded_tensor_is_copied_not_kept() -> None:
    model, outer = _outer()
    source = torch.ones_like(model.bias)
    outer.load_parameters({"bias": source})
    source.add_(1.0)
    assert torch.equal(model.bias.detach(), torch.ones_like(model.bias))


def test_copied_parameters_are_a_copy() -> None:
    model, outer = _outer()
    before = model.weight.detach().clone()
    copied = outer.copy_parameters()
    assert set(copied) == {"weight", "bias"} and torch.equal(copied["weight"], before)
    copied["weight"].add_(1.0)
    assert torch.equal(model.weight.detach(), before)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"weight": torch.zeros(2, 3), "gain": torch.zeros(2)}, r"no parameters named \['gain'\]"),
        ({"weight": torch.zeros(2, 3), "bias": torch.zeros(3)}, r"'bias' has shape \(2,\), got \(3,\)"),
    ],
)
def test_an_unknown_name_or_a_wrong_shape_changes_nothing(tensors: dict, message: str) -> None:
    model, outer = _outer()
    before = outer.copy_parameters()
    with pytest.raises(ValueError, match=message):
        outer.load_parameters(tensors)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
