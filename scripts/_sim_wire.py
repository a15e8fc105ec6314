"""What the simulator's messages carry: tensors through a codec, with the bytes that costs.

Wire names: ``fp32``, ``int8`` and ``int4`` are the project's own blockwise codecs
(:func:`swarm.compression.get_codec`, their ``payload_nbytes`` give the bytes); ``topk<F>`` (``topk0.25``)
keeps the fraction F of each tensor's entries of largest magnitude, each sent as a sign and a 2-bit
magnitude (four levels of the tensor's largest kept value), the positions as gaps in a Golomb code
(about ``log2(1/F) + 2`` bits each).

Error feedback (:func:`through`, ``residual``): what the codec dropped is added to the next message
of the same peer. The caller keeps the new residual only when the exchange commits, so an exchange
that fails loses nothing and counts nothing twice (docs/compression.md, "Error feedback").
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from swarm.compression import Codec, get_codec

Tensors = dict[str, torch.Tensor]


def _topk_fraction(name: str) -> float | None:
    if not name.startswith("topk"):
        return None
    fraction = float(name[4:])
    if not 0 < fraction <= 1:
        raise ValueError(f"top-k fraction must be in (0, 1], got {name!r}")
    return fraction


def check_wire(name: str) -> None:
    """Raise ValueError for an unknown wire name."""
    if _topk_fraction(name) is None:
        get_codec(name)


@lru_cache(maxsize=64)
def _codec(name: str) -> Codec:
    return get_codec(name)


def tensor_bytes(name: str, numel: int) -> int:
    """Payload bytes of one tensor of ``numel`` values through wire ``name``."""
    fraction = _topk_fraction(name)
    if fraction is None:
        return int(_codec(name).payload_nbytes(numel))
    kept = max(1, math.ceil(fraction * numel))
    index_bits = math.log2(numel / kept) + 2
    return math.ceil(kept * (3 + index_bits) / 8) + 4


def message_bytes(name: str, shapes: dict[str, int]) -> int:
    """Payload bytes of a message of tensors with ``shapes`` (name -> numel) through wire ``name``."""
    return sum(tensor_bytes(name, numel) for numel in shapes.values())


def _topk_roundtrip(x: torch.Tensor, fraction: float) -> torch.Tensor:
    flat = x.flatten()
    kept = max(1, math.ceil(fraction * flat.numel()))
    index = flat.abs().topk(kept).indices
    values = flat[index]
    top = float(values.abs().max())
    out = torch.zeros_like(flat)
    if top > 0:
        levels = (values.abs() / top * 4).round().clamp(1, 4) / 4 * top
        out[index] = levels * values.sign()
    return out.view_as(x)


def roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as the receiver decodes it through wire ``name``."""
    fraction = _topk_fraction(name)
    if fraction is not None:
        return _topk_roundtrip(x, fraction)
    if name == "fp32":
        return x.clone()
    return _codec(name).roundtrip(x).to(x.dtype).clone()


def through(name: str, tensors: Tensors, residual: Tensors | None = None) -> tuple[Tensors, Tensors]:
    """``(sent, new_residual)``: what the receiver decodes of ``tensors`` plus ``residual`` (error
    feedback; None: none), and what the codec dropped of that sum."""
    sent, dropped = {}, {}
    for key, value in tensors.items():
        x = value.detach().to(torch.float32)
        if residual is not None and key in residual:
            x = x + residual[key]
        sent[key] = roundtrip(name, x)
        dropped[key] = x - sent[key]
    return sent, dropped
