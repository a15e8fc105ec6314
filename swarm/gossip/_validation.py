"""The local tensor schema, its hash for the handshake, and the checks every received tensor must pass.

Norm check (per tensor ``t``)::

    ||remote_t|| <= max_norm_ratio * max(||local_t||, floor_t)
    floor_t = max(local_rms * sqrt(numel_t), norm_floor * sqrt(numel_t / numel_total))

``local_rms`` is the RMS over all local tensors. The floor exists because a local norm of (nearly)
zero is legitimate: a zero-initialised bias, or an all-zero tensor that training has not moved yet.
Without it such a peer would reject every honest partner. The first term lets a tensor that is zero
locally accept what is typical for the model as a whole; the second, with the absolute
``norm_floor`` (L2 over the whole model), covers an all-zero local state.

No float64 anywhere (Apple's MPS has none): norms are float32, accumulated in blocks of
:data:`NORM_BLOCK` elements (one float32 sum over millions of elements drifts by a percent), and
rescaled by the largest magnitude when squares would overflow or underflow float32.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from swarm._errors import SwarmError
from swarm.compression import Schema

NORM_BLOCK = 1024
"""Elements per float32 partial norm in :func:`tensor_norm`: 1e-8 relative error, measured on 2**25
elements, against 1e-2 for one float32 reduction over all of them."""


def tensor_norm(t: torch.Tensor) -> float:
    """The L2 norm of ``t`` in float32 arithmetic, accurate to about 1e-7 (see the module docstring).

    NaN in ``t`` gives NaN; Inf gives Inf.
    """
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return 0.0
    norm = _blocked_norm(flat)
    if norm == 0.0 or norm == math.inf:  # squares underflowed or overflowed float32: rescale
        peak = float(flat.abs().amax())
        if 0.0 < peak < math.inf:
            return peak * _blocked_norm(flat / peak)
    return norm


def _blocked_norm(flat: torch.Tensor) -> float:
    """Norms of blocks of ``NORM_BLOCK`` elements, then norms of those, until one is left."""
    while flat.numel() > NORM_BLOCK:
        full = flat.numel() // NORM_BLOCK * NORM_BLOCK
        parts = [torch.linalg.vector_norm(flat[:full].reshape(-1, NORM_BLOCK), dim=1, dtype=torch.float32)]
        if full < flat.numel():
            parts.append(torch.linalg.vector_norm(flat[full:], dtype=torch.float32).reshape(1))
        flat = torch.cat(parts)
    return float(torch.linalg.vector_norm(flat, dtype=torch.float32))


def norm_of(tensors: Mapping[str, torch.Tensor]) -> float:
    """L2 norm over all ``tensors`` (:func:`tensor_norm` of each, combined in Python floats)."""
    return math.sqrt(sum(tensor_norm(t) ** 2 for t in tensors.values()))


def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``a - b`` over ``a``'s names, in float32 (one tensor's difference at a time)."""
    return math.sqrt(sum(tensor_norm(b[n].float() - a[n].to(device=b[n].device).float()) ** 2 for n in a))


class ValidationError(SwarmError, ValueError):
    """Received tensors that must not be applied; the message names the tensor and the reason."""


def schema_hash(schema: Schema) -> str:
    """Order-sensitive digest of names, shapes and dtypes: both sides must stream the same layout."""
    layout = [[name, list(shape), str(dtype)] for name, (shape, dtype) in schema.items()]
    return hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class NormPolicy:
    max_norm_ratio: float = 100.0
    norm_floor: float = 1.0


@dataclass(frozen=True)
class TensorNorms:
    """The norms of one tensor of an exchange that the checks and the robust clip need: ours
    (``local``), what our frames decode to (``sent``), the partner's (``received``), the distance
    between the last two (``diff``), and what our own values lost on the way (``own_error``)."""

    numel: int
    local: float
    sent: float
    received: float
    diff: float
    own_error: float = 0.0


def check_norms(norms: Mapping[str, TensorNorms], policy: NormPolicy) -> None:
    """Raise ValidationError unless every received tensor's norm is plausible next to ours (the
    module docstring's rule)."""
    total_numel = sum(n.numel for n in norms.values()) or 1
    local_rms = math.sqrt(sum(n.local**2 for n in norms.values()) / total_numel)
    for name, n in norms.items():
        scale = math.sqrt(n.numel)
        floor = max(local_rms * scale, policy.norm_floor * scale / math.sqrt(total_numel))
        limit = policy.max_norm_ratio * max(n.local, floor)
        if n.received > limit:
            raise ValidationError(
                f"tensor {name!r} norm {n.received:.4g} exceeds {policy.max_norm_ratio:g}x the local "
                f"reference ({limit / policy.max_norm_ratio:.4g})"
            )


def check_finite(name: str, received: torch.Tensor) -> None:
    if not bool(torch.isfinite(received).all()):
        raise ValidationError(f"tensor {name!r} contains NaN or Inf")


def validate_received(
    received: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    policy: NormPolicy,
) -> None:
    """Raise ValidationError unless ``received`` matches ``local``'s schema, is finite and plausible."""
    _check_schema(received, local)
    norms = {}
    for name, theirs in received.items():
        check_finite(name, theirs)
        norms[name] = TensorNorms(theirs.numel(), tensor_norm(local[name]), 0.0, tensor_norm(theirs), 0.0)
    check_norms({name: norms[name] for name in local}, policy)


def _check_schema(received: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> None:
    if set(received) != set(local):
        missing = sorted(set(local) - set(received))
        extra = sorted(set(received) - set(local))
        raise ValidationError(f"tensor names differ (missing {missing[:5]}, unexpected {extra[:5]})")
    for name, theirs in received.items():
        mine = local[name]
        if theirs.shape != mine.shape:
            raise ValidationError(f"tensor {name!r} shape {tuple(theirs.shape)} != {tuple(mine.shape)}")
        if theirs.dtype != mine.dtype:
            raise ValidationError(f"tensor {name!r} dtype {theirs.dtype} != {mine.dtype}")
