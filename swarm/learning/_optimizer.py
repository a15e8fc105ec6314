"""The inner optimizer: bitsandbytes' 8-bit AdamW where it works, torch's AdamW otherwise.

8-bit AdamW keeps a quarter of AdamW's state, which is what lets a 1B model fit a consumer GPU. But
bitsandbytes is a native library that a volunteer's machine may lack or have broken (a CUDA version
it was not built for, a ROCm build, a missing ``libcudart``), and such failures show only at the first
step. So it is used only after it imports *and* a probe step on this device runs and gives finite
numbers; otherwise the peer trains with torch's AdamW (fused on CUDA) and says so in a warning.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from swarm.config import TrainSection

logger = logging.getLogger(__name__)

BETAS = (0.9, 0.95)
BNB_MIN_8BIT_SIZE = 4096
"""bitsandbytes keeps the state of tensors with fewer elements in float32."""
BNB_BLOCK = 256
"""Elements per quantisation block of bitsandbytes' optimizer state (one float32 scale each)."""
_PROBE_SIZE = BNB_MIN_8BIT_SIZE

_probed: dict[str, bool] = {}


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices decay; biases, norm gains and embeddings do not."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and id(param) not in embeddings else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes can be found (not whether it works: :func:`adamw8bit_works` says that)."""
    return importlib.util.find_spec("bitsandbytes") is not None


def adamw8bit_works(device: torch.device) -> bool:
    """Whether bitsandbytes imports and one AdamW8bit step on ``device`` gives finite numbers; asked once
    per device, warning once when it does not."""
    key = str(device)
    if key not in _probed:
        try:
            _probe_step(device)
            _probed[key] = True
        except Exception as error:  # any failure of a native library means: do not use it
            logger.warning(
                "bitsandbytes' 8-bit AdamW does not work on %s (%s: %s): training with torch's AdamW "
                "instead, whose state takes 4x the memory (8 bytes per parameter)",
                device,
                type(error).__name__,
                error,
            )
            _probed[key] = False
    return _probed[key]


def _probe_step(device: torch.device) -> None:
    import bitsandbytes as bnb

    probe = torch.full((_PROBE_SIZE,), 0.5, device=device, requires_grad=True)
    optimizer = bnb.optim.AdamW8bit([probe], lr=1e-3, betas=BETAS)
    probe.grad = torch.ones_like(probe)
    optimizer.step()
    if not bool(torch.isfinite(probe).all()) or bool((probe == 0.5).all()):
        raise RuntimeError("the probe step left the parameter non-finite or unchanged")


def make_inner_optimizer(
    model: nn.Module, train_cfg: TrainSection, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW with decoupled weight decay: 8-bit (bitsandbytes) on CUDA when it works, else torch's,
    fused on CUDA."""
    groups = parameter_groups(model, train_cfg.weight_decay)
    options: dict[str, Any] = {"lr": train_cfg.lr, "betas": BETAS}
    if device.type == "cuda":
        if adamw8bit_works(device):
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(groups, **options)
        return torch.optim.AdamW(groups, **options, fused=True)
    return torch.optim.AdamW(groups, **options)


def optimizer_name(optimizer: torch.optim.Optimizer) -> str:
    """A short name of the inner optimizer for logs and reports: ``adamw8bit``, ``adamw-fused``, ..."""
    kind = type(optimizer).__name__.lower()
    if isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused"):
        return f"{kind}-fused"
    return kind


_STATE_KEYS = {"adamw8bit": "state1", "adamw": "exp_avg"}
"""A key each per-tensor state of the kind has: bitsandbytes' 8-bit moments, torch's moments."""


def state_kind(state: Mapping[str, Any]) -> str | None:
    """The kind of optimizer an ``optimizer.state_dict()`` came from, by its per-tensor state:
    ``adamw8bit`` (bitsandbytes), ``adamw`` (torch's AdamW, fused or not), or None (no state yet, or
    neither)."""
    for tensor_state in dict(state.get("state") or {}).values():
        for kind, key in _STATE_KEYS.items():
            if isinstance(tensor_state, Mapping) and key in tensor_state:
                return kind
    return None


def can_load_state(optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> bool:
    """Whether ``state`` (a checkpoint's inner-optimizer state) is of ``optimizer``'s kind: a run that
    saved 8-bit AdamW state and resumes with torch's (bitsandbytes broke meanwhile), or the reverse,
    cannot load it. A state of no known kind (empty) loads."""
    saved, name = state_kind(state), optimizer_name(optimizer)
    ours = "adamw8bit" if name == "adamw8bit" else "adamw" if name.startswith("adamw") else None
    return saved is None or ours is None or saved == ours


def optimizer_state_bytes(model: nn.Module, eight_bit: bool) -> int:
    """Bytes of AdamW's two moments for ``model``: 8-bit blockwise as bitsandbytes stores them (2 bytes
    per element plus a float32 scale per block and moment, for tensors of at least
    :data:`BNB_MIN_8BIT_SIZE` elements), else float32 (8 bytes per element)."""
    total = 0
    for param in model.parameters():
        n = param.numel()
        if eight_bit and n >= BNB_MIN_8BIT_SIZE:
            total += 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
        else:
            total += 8 * n
    return total
