"""Codecs: tensor <-> `EncodedTensor`, and an encoded tensor's byte layout on the wire.

A codec works on the flattened tensor. Quantized codecs cut it into blocks of `block_size`
values; a chunk of the tensor (one frame) always starts on a block boundary, so every frame
decodes on its own. The payload of a chunk is ``[per-block scales][codes]``, little-endian.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from swarm.compression import _quantize as kq
from swarm.compression._errors import FrameError

CODEC_NAMES: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4")
CODEC_IDS: dict[str, int] = {name: i + 1 for i, name in enumerate(CODEC_NAMES)}
DTYPE_IDS: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4}
DTYPES_BY_ID: dict[int, torch.dtype] = {v: k for k, v in DTYPE_IDS.items()}
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 1 << 16
_NP_DTYPES = {torch.float32: "<f4", torch.float16: "<f2", torch.int8: "i1", torch.uint8: "u1"}


@dataclass(frozen=True)
class EncodedTensor:
    """One tensor in its codec's representation (all tensors 1-D).

    For `fp32` input and codec, `data` may alias the input tensor (no copy is made): do not
    modify the input while its frames are still being produced.
    """

    codec: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    """dtype of the source tensor; the stream decoder restores it."""
    block_size: int
    """0 for the float codecs."""
    data: torch.Tensor
    """values (fp32/fp16/bf16), int8 codes, or packed 4-bit codes (uint8, two per byte)."""
    scales: torch.Tensor | None
    """per-block scales (fp32 for int8, bf16 for int4), None for the float codecs."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + scales

    def cpu(self) -> EncodedTensor:
        if self.data.device.type == "cpu":
            return self
        scales = None if self.scales is None else self.scales.cpu()
        return EncodedTensor(self.codec, self.shape, self.dtype, self.block_size, self.data.cpu(), scales)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy byte view of a contiguous CPU tensor (little-endian machines)."""
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def read_tensor(payload: memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    """A fresh CPU tensor of `count` elements copied from `payload` (exactly the right length)."""
    out = torch.empty(count, dtype=dtype)
    if count:
        if dtype == torch.bfloat16:
            out.view(torch.int16).numpy()[:] = np.frombuffer(payload, dtype="<i2", count=count)
        else:
            out.numpy()[:] = np.frombuffer(payload, dtype=_NP_DTYPES[dtype], count=count)
    return out


def _check_input(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_IDS:
        raise ValueError(f"cannot encode dtype {t.dtype}; expected one of {sorted(map(str, DTYPE_IDS))}")
    return t.detach().reshape(-1)


class Codec(ABC):
    """Encodes a float tensor; `decode` always returns float32 of the original shape."""

    name: str
    lossless: bool = False
    block_size: int = 0

    @property
    def codec_id(self) -> int:
        return CODEC_IDS[self.name]

    @abstractmethod
    def encode(self, t: torch.Tensor) -> EncodedTensor:
        """Raises ValueError for NaN/Inf input (or values the wire dtype cannot hold)."""

    def decode(self, e: EncodedTensor) -> torch.Tensor:
        if e.codec != self.name:
            raise ValueError(f"codec {self.name!r} cannot decode a tensor encoded with {e.codec!r}")
        out = torch.empty(e.numel, dtype=torch.float32, device=e.data.device)
        self._decode_into(e.data, e.scales, e.numel, out)
        return out.reshape(e.shape)

    def roundtrip(self, t: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(t))

    @property
    def granule(self) -> int:
        """Chunks start at multiples of this many elements (one block; one element for floats)."""
        return max(1, self.block_size)

    @abstractmethod
    def payload_nbytes(self, count: int) -> int:
        """Exact payload length of a chunk of `count` elements."""

    @abstractmethod
    def block_nbytes(self) -> int:
        """Payload bytes of one full granule."""

    @abstractmethod
    def payload_parts(self, e: EncodedTensor, start: int, count: int) -> list[memoryview]:
        """Byte pieces of the chunk [start, start + count) of a CPU encoded tensor."""

    @abstractmethod
    def payload_spans(self, numel: int, start: int, count: int) -> list[tuple[int, int, int]]:
        """Where the payload of the chunk [start, start + count) lies in the payload of the whole
        tensor of `numel` elements: (offset in the chunk's payload, offset in the tensor's, length)
        per piece. The chunks of a tensor tile its payload, ``payload_nbytes(numel)`` bytes."""

    @abstractmethod
    def decode_payload(
        self, payload: memoryview, count: int, out: torch.Tensor, allow_nonfinite: bool
    ) -> None:
        """Decodes one chunk (exact length already checked) into the 1-D `out`; raises FrameError."""

    @abstractmethod
    def _decode_into(
        self, data: torch.Tensor, scales: torch.Tensor | None, n: int, out: torch.Tensor
    ) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size})"


class FloatCodec(Codec):
    """Plain cast to fp32 / fp16 / bf16."""

    def __init__(self, name: str, wire_dtype: torch.dtype) -> None:
        self.name = name
        self.wire_dtype = wire_dtype
        self.lossless = wire_dtype == torch.float32

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        flat = _check_input(t)
        data = flat.to(self.wire_dtype).contiguous()
        if data.numel() and not bool(torch.isfinite(data).all()):
            raise ValueError(f"{self.name}: input has NaN/Inf (or values beyond the {self.wire_dtype} range)")
        return EncodedTensor(self.name, tuple(t.shape), t.dtype, 0, data, None)

    def _decode_into(
        self, data: torch.Tensor, scales: torch.Tensor | None, n: int, out: torch.Tensor
    ) -> None:
        out.copy_(data)

    def payload_nbytes(self, count: int) -> int:
        return count * self.block_nbytes()

    def block_nbytes(self) -> int:
        return torch.empty(0, dtype=self.wire_dtype).element_size()

    def payload_parts(self, e: EncodedTensor, start: int, count: int) -> list[memoryview]:
        return [tensor_bytes(e.data[start : start + count])]

    def payload_spans(self, numel: int, start: int, count: int) -> list[tuple[int, int, int]]:
        size = self.block_nbytes()
        return [(0, start * size, count * size)]

    def decode_payload(
        self, payload: memoryview, count: int, out: torch.Tensor, allow_nonfinite: bool
    ) -> None:
        if out.dtype == self.wire_dtype and out.is_contiguous() and self.wire_dtype != torch.bfloat16:
            vals = out  # decode straight into the destination: one copy, no staging tensor
            if count:
                out.numpy()[:] = np.frombuffer(payload, dtype=_NP_DTYPES[self.wire_dtype], count=count)
        else:
            vals = read_tensor(payload, self.wire_dtype, count)
        if not allow_nonfinite and count and not bool(torch.isfinite(vals).all()):
            raise FrameError(f"payload: {self.name} values contain NaN/Inf")
        if vals is not out:
            out.copy_(vals)


class _BlockCodec(Codec):
    """A quantized codec: per-block scales, then ``bits``-wide codes stored as ``code_dtype``."""

    scale_dtype: torch.dtype
    code_dtype: torch.dtype
    bits: int

    def __init__(self, block_size: int, backend: str) -> None:
        self.block_size = block_size
        self.backend = backend
        if backend == "bnb":
            kq.resolve_backend(backend, block_size, torch.device("cpu"))

    def _backend(self, device: torch.device) -> kq.Backend:
        return kq.resolve_backend(self.backend, self.block_size, device)

    def _nblocks(self, count: int) -> int:
        return -(-count // self.block_size)

    def _ncodes(self, count: int) -> int:
        """How many stored codes (elements of ``code_dtype``) hold ``count`` values."""
        return (count * self.bits + 7) // 8

    def _scale_nbytes(self) -> int:
        return torch.empty(0, dtype=self.scale_dtype).element_size()

    def payload_nbytes(self, count: int) -> int:
        return self._nblocks(count) * self._scale_nbytes() + self._ncodes(count)

    def payload_spans(self, numel: int, start: int, count: int) -> list[tuple[int, int, int]]:
        scales = self._nblocks(count) * self._scale_nbytes()  # start is on a block boundary
        all_scales = self._nblocks(numel) * self._scale_nbytes()
        first = start // self.block_size * self._scale_nbytes()
        return [(0, first, scales), (scales, all_scales + self._ncodes(start), self._ncodes(count))]

    def block_nbytes(self) -> int:
        return self.payload_nbytes(self.block_size)

    def encode(self, t: torch.Tensor) -> EncodedTensor:
        flat = _check_input(t)
        x = flat if flat.dtype == torch.float32 else flat.float()
        data, scales = self._encode_flat(x.contiguous(), self._backend(x.device))
        if scales.numel() and not bool(torch.isfinite(scales).all()):
            raise ValueError(f"{self.name}: input has NaN/Inf")
        return EncodedTensor(self.name, tuple(t.shape), t.dtype, self.block_size, data, scales)

    @abstractmethod
    def _encode_flat(self, x: torch.Tensor, backend: kq.Backend) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def _decode(
        self, codes: torch.Tensor, scales: torch.Tensor, n: int, backend: kq.Backend, out: torch.Tensor
    ) -> None:
        """Dequantize the ``n`` values of ``codes`` with their block ``scales`` into ``out``."""

    def _check_codes(self, codes: torch.Tensor, count: int) -> None:
        """Raise FrameError for received codes that no encoder writes (nothing to check by default)."""

    def _decode_into(
        self, data: torch.Tensor, scales: torch.Tensor | None, n: int, out: torch.Tensor
    ) -> None:
        assert scales is not None
        self._decode(data, scales, n, self._backend(data.device), out)

    def payload_parts(self, e: EncodedTensor, start: int, count: int) -> list[memoryview]:
        assert e.scales is not None
        b0, b1 = start // self.block_size, self._nblocks(start + count)
        codes = e.data[self._ncodes(start) : self._ncodes(start + count)]  # start is on a block boundary
        return [tensor_bytes(e.scales[b0:b1]), tensor_bytes(codes)]

    def decode_payload(
        self, payload: memoryview, count: int, out: torch.Tensor, allow_nonfinite: bool
    ) -> None:
        nb = self._nblocks(count)
        scale_len = nb * torch.empty(0, dtype=self.scale_dtype).element_size()
        scales = read_tensor(payload[:scale_len], self.scale_dtype, nb)
        scales32 = scales.float()
        if not bool(torch.isfinite(scales32).all()) or not bool((scales32 >= 0).all()):
            raise FrameError("payload: block scales must be finite and >= 0")
        codes = read_tensor(payload[scale_len:], self.code_dtype, self._ncodes(count))
        self._check_codes(codes, count)
        self._decode(codes, scales, count, "torch", out)


class Int8Codec(_BlockCodec):
    """Blockwise absmax-linear int8 (fp32 scale per block)."""

    name = "int8"
    scale_dtype = torch.float32
    code_dtype = torch.int8
    bits = 8

    def _encode_flat(self, x: torch.Tensor, backend: kq.Backend) -> tuple[torch.Tensor, torch.Tensor]:
        return kq.int8_encode(x, self.block_size, backend)

    def _decode(
        self, codes: torch.Tensor, scales: torch.Tensor, n: int, backend: kq.Backend, out: torch.Tensor
    ) -> None:
        kq.int8_decode(codes, scales, self.block_size, backend, out=out)


class Int4Codec(_BlockCodec):
    """Blockwise NF4 (bf16 scale per block, two codes per byte)."""

    name = "int4"
    scale_dtype = torch.bfloat16
    code_dtype = torch.uint8
    bits = 4

    def _encode_flat(self, x: torch.Tensor, backend: kq.Backend) -> tuple[torch.Tensor, torch.Tensor]:
        return kq.int4_encode(x, self.block_size, backend)

    def _decode(
        self, codes: torch.Tensor, scales: torch.Tensor, n: int, backend: kq.Backend, out: torch.Tensor
    ) -> None:
        kq.int4_decode(codes, scales, n, self.block_size, backend, out=out)

    def _check_codes(self, codes: torch.Tensor, count: int) -> None:
        if count % 2 and int(codes[-1]) & 0x0F:
            raise FrameError("payload: the unused last 4-bit code must be zero")


def check_block_size(block_size: int) -> None:
    ok = isinstance(block_size, int) and MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
    if not ok or block_size & (block_size - 1):
        raise ValueError(
            f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}"
        )


def get_codec(name: str, block_size: int = 64, backend: str = "auto") -> Codec:
    """The codec called `name` (one of CODEC_NAMES).

    `block_size` applies to int8/int4 only. `backend` picks the quantization kernel:
    "torch", "bnb" (bitsandbytes; ValueError if unavailable for this block size) or "auto"
    (bitsandbytes on CUDA, torch on CPU where it measured faster; see docs/compression.md).
    """
    if backend not in ("auto", "bnb", "torch"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'bnb' or 'torch'")
    if name == "fp32":
        return FloatCodec("fp32", torch.float32)
    if name == "fp16":
        return FloatCodec("fp16", torch.float16)
    if name == "bf16":
        return FloatCodec("bf16", torch.bfloat16)
    if name in ("int8", "int4"):
        check_block_size(block_size)
        return Int8Codec(block_size, backend) if name == "int8" else Int4Codec(block_size, backend)
    raise ValueError(f"unknown codec {name!r}; expected one of {CODEC_NAMES}")
