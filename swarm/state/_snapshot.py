"""A state's identity: its canonical frames, its digest, and the decoded form a download returns.

Canonical encoding: the tensors, sorted by name, each as float32 encoded with the ``bf16`` codec of
:mod:`swarm.compression` into frames of at most ``chunk_bytes``, one tensor after the other. The bf16
cast rounds to nearest even: deterministic, and exact on a value bf16 already holds. So a state
decoded from the wire (float32 tensors holding bf16 values) encodes again to the very same frames,
and a joiner that publishes the state it took over announces the digest it downloaded.

The digest is a hash over the frame hashes (:func:`state_digest`): a client verifies each frame the
moment it arrives, from whichever donor, and blames exactly the donor that sent a bad one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from swarm._protocol import PROTOCOL_VERSION
from swarm.compression import encode_tensors, get_codec

WIRE_CODEC = get_codec("bf16")
"""How a state's anchor and momentum travel and are kept by a donor: 2 bytes per value."""
DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 64 << 20
_DOMAIN = f"swarm.state.v{PROTOCOL_VERSION}.bf16\n".encode()
"""The digest's domain tag; it names the frames' codec, so a state encoded otherwise never matches."""


def canonical_meta(meta: Mapping[str, Any]) -> bytes:
    """The one byte string a meta dict hashes as (ValueError/TypeError if it is not plain JSON)."""
    return json.dumps(meta, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def state_digest(meta_json: bytes, chunk_bytes: int, frame_hashes: Iterable[bytes]) -> str:
    """sha256 over a domain tag, the canonical meta, the chunk size, the frame count and the sha256 of
    each frame (lengths as 8-byte big-endian integers)."""
    hashes = list(frame_hashes)
    h = hashlib.sha256(_DOMAIN)
    h.update(len(meta_json).to_bytes(8, "big") + meta_json)
    h.update(chunk_bytes.to_bytes(8, "big"))
    h.update(len(hashes).to_bytes(8, "big"))
    for frame_hash in hashes:
        h.update(frame_hash)
    return h.hexdigest()


def check_chunk_bytes(chunk_bytes: int) -> None:
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int):
        raise TypeError(f"chunk_bytes must be an int, got {type(chunk_bytes).__name__}")
    if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes {chunk_bytes} is not in [1, {MAX_CHUNK_BYTES}]")


def canonical_frames(tensors: Mapping[str, torch.Tensor], chunk_bytes: int) -> Iterator[bytes]:
    """The canonical frames of ``tensors`` (any device), in order. Besides the frame it yields, it
    holds one tensor's bf16 encoding at a time (2 bytes per element of that tensor); a tensor that is
    not float32 is cast first. ValueError for NaN/Inf or a value beyond bf16's range."""
    for name in sorted(tensors):
        tensor = tensors[name].detach()
        yield from encode_tensors([(name, tensor.float())], WIRE_CODEC, chunk_bytes)


def wire_precision(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy of ``tensor`` with each value rounded to bf16: what a joiner receives."""
    # cast on the CPU: an MPS device without bfloat16 (macOS 13) cannot
    return tensor.detach().to("cpu", torch.float32).to(torch.bfloat16).float().contiguous()


@dataclass(frozen=True)
class StateSnapshot:
    """A decoded state: CPU float32 tensors, each value one bf16 holds (what the wire carries), plus
    JSON meta, identified by ``digest``. What a download returns; build one with :func:`make_snapshot`.
    """

    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    digest: str
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    sources: tuple[str, ...] = field(default=(), compare=False)
    """The donors a downloaded snapshot came from (empty for one made here)."""
    received_bytes: int = field(default=0, compare=False)
    """Frame bytes the download read from donors, each verified frame once (0 for one made here)."""


def make_snapshot(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> StateSnapshot:
    """Copy ``tensors`` to CPU float32 at wire precision (:func:`wire_precision`) and compute the
    digest over their canonical frames and ``meta``."""
    return build_snapshot({name: wire_precision(t) for name, t in tensors.items()}, meta, chunk_bytes)


def build_snapshot(
    tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any], chunk_bytes: int
) -> StateSnapshot:
    """The snapshot of ``tensors`` as they are: CPU float32 holding bf16 values already (a decoded or
    rounded state), so that its digest names exactly its tensors. Holds one frame at a time."""
    check_chunk_bytes(chunk_bytes)
    meta_json = canonical_meta(meta)
    hashes = (hashlib.sha256(frame).digest() for frame in canonical_frames(tensors, chunk_bytes))
    digest = state_digest(meta_json, chunk_bytes, hashes)
    return StateSnapshot(dict(sorted(tensors.items())), json.loads(meta_json), digest, chunk_bytes)
