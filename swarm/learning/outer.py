"""The outer step of DiLoCo, independent of how the pseudo-gradients are averaged.

At the start of a round the outer optimizer keeps a float32 copy of the parameters, the *anchor*.
The inner loop then moves the model; the *pseudo-gradient* is ``anchor - params``, the direction the
inner steps went, with the sign of a gradient. After the swarm averaged the pseudo-gradients, the
outer step starts again from the anchor and takes one SGD step with (Nesterov) momentum along the
average. The result is the model for the next round and its new anchor.

With ``lr = 1``, no momentum and an "average" equal to this peer's own pseudo-gradient, the outer
step lands exactly where the inner steps ended: the peer trains as if alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from swarm.config import AveragingSection


class OuterOptimizer:
    """SGD with (Nesterov) momentum applied to averaged pseudo-gradients, anchored at round start.

    The anchor and the momentum are float32 and live on ``state_device`` (default: next to each
    parameter); putting them on the CPU saves accelerator memory at the price of copies per round
    (``averaging.outer_state_device``). They are ordinary (pageable) host memory: torch's caching host
    allocator rounds every page-locked block up to a power of two and keeps the
    blocks cached for good, and the copies per round start from new pageable tensors anyway.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float,
        nesterov: bool = True,
        *,
        state_device: torch.device | str | None = None,
    ) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        self.lr = lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.rounds = 0
        self._params = dict(model.named_parameters())
        self._state_device = None if state_device is None else torch.device(state_device)
        self.anchor: dict[str, torch.Tensor] = {}
        self.momentum_buffers: dict[str, torch.Tensor] = {}
        self.reset_anchor()

    @classmethod
    def from_config(cls, model: nn.Module, averaging: AveragingSection, **options: Any) -> OuterOptimizer:
        return cls(model, averaging.outer_lr, averaging.outer_momentum, averaging.nesterov, **options)

    def _device_of(self, param: torch.Tensor) -> torch.device:
        return self._state_device or param.device

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """Take the model's current parameters as the anchor (at start, and after loading new state).

        An anchor tensor that is already float32 of the parameter's shape on the state device is
        overwritten in place; any other is freed before its replacement is made, so that a joiner never
        holds the old and the new anchor at once."""
        for name, param in self._params.items():
            old = self.anchor.get(name)
            device = self._device_of(param)
            if old is not None and (old.shape, old.dtype, old.device) == (param.shape, torch.float32, device):
                old.copy_(param.detach())
                continue
            self.anchor.pop(name, None)
            del old
            self.anchor[name] = param.detach().to(device, torch.float32, copy=True)

    @property
    def state_device(self) -> torch.device | None:
        """Where the anchor and the momentum live (None: next to each parameter)."""
        return self._state_device

    @torch.no_grad()
    def move_state(self, device: torch.device | str) -> None:
        """Move the anchor and the momentum to ``device`` (host memory, when the device ran out), one
        tensor at a time: each device tensor is freed as its copy is made."""
        self._state_device = torch.device(device)
        for state in (self.anchor, self.momentum_buffers):
            for name in list(state):
                state[name] = state[name].to(self._state_device, torch.float32)

    @torch.no_grad()
    def restore(self) -> bool:
        """Put the anchor back into the model, after its parameters went non-finite.

        Returns False, changing nothing, when the anchor itself is not finite.
        """
        if not all_finite(self.anchor.values()):
            return False
        for name, param in self._params.items():
            param.copy_(self.anchor[name])
        return True

    @torch.no_grad()
    def copy_parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the model's parameters by name (detached, in their own dtype and device)."""
        return {name: param.detach().clone() for name, param in self._params.items()}

    @torch.no_grad()
    def load_parameters(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into the model's parameters of the same names; the others stay as they are.

        The anchor and the momentum are left alone, so the next :meth:`pseudo_gradient` measures the
        new parameters from the old anchor: this is how a caller moves the model outside the inner loop
        and the outer step (an experiment pulling two peers' models together, or a late update landing
        on top of the progress made since). :meth:`reset_anchor` afterwards re-anchors there instead.
        Raises ValueError, changing nothing, on a name the model lacks or a shape that differs.
        """
        unknown = sorted(set(tensors) - set(self._params))
        if unknown:
            raise ValueError(f"no parameters named {unknown} in the model")
        for name, tensor in tensors.items():
            want = tuple(self._params[name].shape)
            if tuple(tensor.shape) != want:
                raise ValueError(f"parameter {name!r} has shape {want}, got {tuple(tensor.shape)}")
        for name, tensor in tensors.items():
            self._params[name].copy_(tensor)

    @torch.no_grad()
    def pseudo_gradient(self) -> dict[str, torch.Tensor]:
        """``anchor - params`` per parameter name, float32, on the anchor's device."""
        return {
            name: self.anchor[name] - param.detach().to(self.anchor[name].device, torch.float32)
            for name, param in self._params.items()
        }

    @torch.no_grad()
    def apply(self, averaged: Mapping[str, torch.Tensor]) -> None:
        """Outer step from the anchor along ``averaged``; write the result into the model and re-anchor."""
        self.advance(averaged)
        for name, param in self._params.items():
            param.copy_(self.anchor[name])

    @torch.no_grad()
    def advance(self, averaged: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Outer step of the anchor (and momentum) along ``averaged``, leaving the model alone.

        Returns how far each anchor tensor moved (``new - old``, float32, on the anchor's device), so
        that a caller that kept training since it took its pseudo-gradient can move its parameters by
        the same amount and keep that local progress (docs/training.md, "The update rule").
        """
        self._check_names(averaged)
        moves = {name: self.advance_tensor(name, averaged[name]) for name in self.anchor}
        self.count_round()
        return moves

    @torch.no_grad()
    def advance_tensor(self, name: str, averaged: torch.Tensor) -> torch.Tensor:
        """:meth:`advance` of one tensor: a caller that streams a round tensor by tensor (so that no
        whole-model gradient or move exists at once) calls this for every name, then :meth:`count_round`."""
        anchor = self.anchor[name]
        grad = averaged.to(anchor.device, torch.float32)
        if grad.shape != anchor.shape:
            raise ValueError(
                f"pseudo-gradient {name!r} has shape {tuple(grad.shape)}, want {tuple(anchor.shape)}"
            )
        if self.momentum:
            buffer = self.momentum_buffers.get(name)
            if buffer is None:
                buffer = self.momentum_buffers[name] = grad.clone()
            else:
                buffer.mul_(self.momentum).add_(grad)
            grad = grad.add(buffer, alpha=self.momentum) if self.nesterov else buffer
        move = grad.mul(-self.lr)
        anchor.add_(move)
        return move

    def count_round(self) -> None:
        """One outer step done (after :meth:`advance_tensor` of every tensor)."""
        self.rounds += 1

    def _check_names(self, averaged: Mapping[str, torch.Tensor]) -> None:
        if set(averaged) != set(self._params):
            missing = sorted(set(self._params) - set(averaged))
            extra = sorted(set(averaged) - set(self._params))
            raise ValueError(
                f"pseudo-gradient names differ from the model's: missing {missing}, extra {extra}"
            )

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Everything needed to continue: hyper-parameters, rounds, anchor and momentum (CPU copies).

        ``copy=False`` returns the live tensors instead (on their device), for a caller that writes them
        out before the next outer step on the thread that takes it: a checkpoint then costs no second
        copy of the state (``torch.save`` copies a device tensor to the host one at a time)."""

        def out(t: torch.Tensor) -> torch.Tensor:
            return t.to("cpu", copy=True) if copy else t.detach()

        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "rounds": self.rounds,
            "anchor": {name: out(t) for name, t in self.anchor.items()},
            "momentum_buffers": {name: out(t) for name, t in self.momentum_buffers.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the model's parameters are restored separately."""
        anchor, buffers = state["anchor"], state["momentum_buffers"]
        if set(anchor) != set(self._params) or not set(buffers) <= set(self._params):
            raise ValueError("outer optimizer state does not match the model's parameters")
        self.lr, self.momentum, self.nesterov = state["lr"], state["momentum"], state["nesterov"]
        self.rounds = int(state["rounds"])
        # loaded tensors are the caller's to give away: moved where needed, never copied in place
        self.anchor = {n: self._state_tensor(anchor[n], p) for n, p in self._params.items()}
        self.momentum_buffers = {n: self._state_tensor(buffers[n], self._params[n]) for n in buffers}

    def _state_tensor(self, loaded: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """A loaded state tensor as this optimizer keeps it: float32 on the state device, contiguous;
        the loaded tensor itself where it already is one."""
        if loaded.shape != param.shape:
            raise ValueError(
                f"outer optimizer state of shape {tuple(loaded.shape)}, want {tuple(param.shape)}"
            )
        return loaded.to(self._device_of(param), torch.float32).contiguous()


@torch.no_grad()
def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (no NaN, no Inf).

    The per-tensor checks stay on their device and are reduced there: one host sync per device, not one
    per tensor (the trainer runs this before every round, on every parameter).
    """
    flags: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        flags.setdefault(t.device, []).append(torch.isfinite(t).all())
    return all(bool(torch.stack(found).all()) for found in flags.values())


def drift(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Relative L2 distance ``||a - b|| / ||b||`` over all tensors of two same-named parameter sets."""
    if set(a) != set(b):
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    diff = norm = 0.0
    for name, tb in b.items():
        ta = a[name].detach().to(tb.device, torch.float32)
        tb = tb.detach().float()
        diff += float((ta - tb).pow(2).sum())
        norm += float(tb.pow(2).sum())
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-12)
