"""The one error type of the wire decoder and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass

from swarm._errors import SwarmError


class FrameError(SwarmError, ValueError):
    """A received frame (or stream of frames) is malformed, corrupt, or exceeds a limit.

    Every failure of the decoding side raises exactly this type; the message names the bad field.
    """


@dataclass(frozen=True)
class DecodeLimits:
    """Hard limits checked against every header field before anything is allocated.

    The defaults accept any tensor a real model has while keeping a hostile peer from making us
    allocate more than a few GiB.
    """

    max_elements: int = 1 << 30
    """Largest number of elements of one tensor (product of its shape)."""
    max_payload_bytes: int = 1 << 31
    """Largest payload of one frame, in bytes."""
    max_ndim: int = 8
    """Largest number of dimensions of one tensor."""
    max_name_bytes: int = 256
    """Longest tensor name, in UTF-8 bytes."""
    max_tensors: int = 1 << 16
    """Most distinct tensors one `TensorStreamDecoder` accepts."""
    max_total_elements: int = 1 << 32
    """Most elements, summed over all tensors, one `TensorStreamDecoder` allocates."""
    allow_nonfinite: bool = False
    """Whether decoded NaN/Inf values are accepted (by default they are a `FrameError`)."""
    min_chunk_bytes: int = 0
    """The smallest frame an honest sender cuts a tensor into: a tensor may come in at most as many
    chunks as frames of this many bytes need (0: one block per chunk). Bounds the frames, and what
    each costs the receiver beyond its bytes, by the tensor's size rather than by the sender."""

    def __post_init__(self) -> None:
        for field in ("max_elements", "max_payload_bytes", "max_ndim", "max_name_bytes", "max_tensors"):
            if getattr(self, field) < 1:
                raise ValueError(f"DecodeLimits.{field} must be >= 1")
        for field in ("max_total_elements", "min_chunk_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"DecodeLimits.{field} must be >= 0")
