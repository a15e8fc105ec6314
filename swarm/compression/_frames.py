"""Self-describing binary frames: one chunk of one encoded tensor per frame.

Layout (little-endian)::

    fixed header (52 bytes):
      magic        4s  b"SWQF"
      version      B   FORMAT_VERSION
      codec id     B   1 fp32, 2 fp16, 3 bf16, 4 int8, 5 int4
      dtype id     B   source dtype: 1 float32, 2 float16, 3 bfloat16, 4 float64
      ndim         B
      name length  H   bytes of the UTF-8 tensor name (>= 1)
      flags        H   reserved, must be 0
      block size   I   0 for float codecs, else a power of two
      chunk index  I
      chunk count  I   chunks the whole tensor is split into
      offset       Q   first element of this chunk in the flattened tensor
      count        Q   elements in this chunk
      payload len  Q   bytes of payload
      crc32        I   zlib.crc32 of everything in the frame except this field
    shape          ndim x Q
    name           name length bytes
    payload        payload len bytes

`decode_frame` validates every field against `DecodeLimits` before anything is allocated and
raises `FrameError` naming the field; nothing is ever unpickled.
"""

from __future__ import annotations

import functools
import math
import struct
import zlib
from dataclasses import dataclass

import torch

from swarm.compression._codecs import (
    CODEC_IDS,
    CODEC_NAMES,
    DTYPE_IDS,
    DTYPES_BY_ID,
    MAX_BLOCK_SIZE,
    MIN_BLOCK_SIZE,
    Codec,
    EncodedTensor,
    get_codec,
)
from swarm.compression._errors import DecodeLimits, FrameError

MAGIC = b"SWQF"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBBBHHIIIQQQI")
HEADER_SIZE = _HEADER.size
_CODECS_BY_ID = {CODEC_IDS[name]: name for name in CODEC_NAMES}


@dataclass(frozen=True)
class Frame:
    """A validated frame. `payload` is a view into the received bytes (not yet decoded)."""

    version: int
    codec: Codec
    dtype: torch.dtype
    shape: tuple[int, ...]
    name: str
    block_size: int
    chunk_index: int
    num_chunks: int
    offset: int
    count: int
    payload: memoryview

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def values(self, limits: DecodeLimits = DecodeLimits()) -> torch.Tensor:
        """This chunk's `count` values as a 1-D float32 tensor."""
        out = torch.empty(self.count, dtype=torch.float32)
        self.codec.decode_payload(self.payload, self.count, out, limits.allow_nonfinite)
        return out


def header_size(name: str, ndim: int) -> int:
    return HEADER_SIZE + 8 * ndim + len(name.encode("utf-8"))


@functools.cache
def wire_codec(name: str, block_size: int) -> Codec:
    """The one decoding codec per (validated) codec and block size: at most 29 of them."""
    return get_codec(name, block_size or 64, backend="torch")


def _chunk_elements(codec: Codec, header_bytes: int, min_chunk_bytes: int) -> int:
    """The fewest elements a chunk holds in frames of ``min_chunk_bytes`` (at least one block)."""
    return max(1, (min_chunk_bytes - header_bytes) // codec.block_nbytes()) * codec.granule


def encode_frame(
    name: str,
    encoded: EncodedTensor,
    codec: Codec,
    offset: int = 0,
    count: int | None = None,
    chunk_index: int = 0,
    num_chunks: int = 1,
) -> bytes:
    """One frame holding elements [offset, offset + count) of `encoded` (default: all of it)."""
    name_bytes = name.encode("utf-8")
    if not name_bytes or len(name_bytes) > 0xFFFF:
        raise ValueError(f"tensor name must be 1..65535 UTF-8 bytes, got {len(name_bytes)}")
    if encoded.codec != codec.name:
        raise ValueError(f"tensor was encoded with {encoded.codec!r}, not {codec.name!r}")
    numel = encoded.numel
    count = numel - offset if count is None else count
    if offset < 0 or count < 0 or offset + count > numel or offset % codec.granule:
        raise ValueError(f"bad chunk [{offset}, {offset + count}) of a tensor of {numel} elements")
    encoded = encoded.cpu()
    parts = codec.payload_parts(encoded, offset, count)
    payload_len = sum(p.nbytes for p in parts)
    shape = struct.pack(f"<{len(encoded.shape)}Q", *encoded.shape)
    fields = (
        MAGIC,
        FORMAT_VERSION,
        codec.codec_id,
        DTYPE_IDS[encoded.dtype],
        len(encoded.shape),
        len(name_bytes),
        0,
        encoded.block_size,
        chunk_index,
        num_chunks,
        offset,
        count,
        payload_len,
    )
    head = _HEADER.pack(*fields, 0)[:-4]
    crc = zlib.crc32(head)
    pieces: list[bytes | memoryview] = [shape, name_bytes, *parts]
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return b"".join((head, struct.pack("<I", crc), *pieces))


def decode_frame(
    data: bytes | bytearray | memoryview, limits: DecodeLimits = DecodeLimits(), codec: Codec | None = None
) -> Frame:
    """Parse and validate one frame; raises FrameError (naming the field) on anything wrong.

    ``codec``: the codec the stream agreed on; a frame in another codec (or block size) is refused
    from its header. Frames share one codec object per codec and block size, whatever their number.
    """
    try:
        view = memoryview(data).cast("B")
    except TypeError as exc:
        raise FrameError(f"frame: expected bytes, got {type(data).__name__}") from exc
    if len(view) < HEADER_SIZE:
        raise FrameError(f"header: truncated, {len(view)} bytes < {HEADER_SIZE}")
    (magic, version, codec_id, dtype_id, ndim, name_len, flags, block_size, chunk_index, num_chunks,
     offset, count, payload_len, crc) = _HEADER.unpack_from(view)  # fmt: skip
    if magic != MAGIC:
        raise FrameError(f"magic: expected {MAGIC!r}, got {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise FrameError(f"version: unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if codec_id not in _CODECS_BY_ID:
        raise FrameError(f"codec id: unknown codec id {codec_id}")
    if dtype_id not in DTYPES_BY_ID:
        raise FrameError(f"dtype id: unknown dtype id {dtype_id}")
    if ndim > limits.max_ndim:
        raise FrameError(f"ndim: {ndim} exceeds the limit {limits.max_ndim}")
    if not 1 <= name_len <= limits.max_name_bytes:
        raise FrameError(f"name length: {name_len} not in [1, {limits.max_name_bytes}]")
    if flags:
        raise FrameError(f"flags: reserved bits set ({flags:#x})")
    codec_name = _CODECS_BY_ID[codec_id]
    if codec_name in ("int8", "int4"):
        ok = MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE and not block_size & (block_size - 1)
        if not ok:
            raise FrameError(
                f"block size: {block_size} is not a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
            )
    elif block_size:
        raise FrameError(f"block size: must be 0 for codec {codec_name}, got {block_size}")
    if codec is not None and (codec_name, block_size) != (codec.name, codec.block_size):
        raise FrameError(
            f"codec: a frame in {codec_name} (block size {block_size}) on a stream agreed on "
            f"{codec.name} (block size {codec.block_size})"
        )
    if payload_len > limits.max_payload_bytes:
        raise FrameError(f"payload length: {payload_len} exceeds the limit {limits.max_payload_bytes}")
    expected_len = HEADER_SIZE + 8 * ndim + name_len + payload_len
    if expected_len != len(view):
        raise FrameError(f"frame length: header says {expected_len} bytes, got {len(view)}")
    actual_crc = zlib.crc32(view[HEADER_SIZE:], zlib.crc32(view[: HEADER_SIZE - 4]))
    if actual_crc != crc:
        raise FrameError(f"checksum: crc32 {actual_crc:#010x} does not match header {crc:#010x}")

    shape = struct.unpack_from(f"<{ndim}Q", view, HEADER_SIZE)
    numel = 1
    for dim in shape:
        numel *= dim
        if numel > limits.max_elements:
            raise FrameError(f"shape: {shape} exceeds the element limit {limits.max_elements}")
    name_at = HEADER_SIZE + 8 * ndim
    try:
        name = str(view[name_at : name_at + name_len], "utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError("name: not valid UTF-8") from exc

    wire = wire_codec(codec_name, block_size)
    granule = wire.granule
    max_chunks = max(1, -(-numel // _chunk_elements(wire, name_at + name_len, limits.min_chunk_bytes)))
    if not 1 <= num_chunks <= max_chunks:
        raise FrameError(f"chunk count: {num_chunks} not in [1, {max_chunks}] for {numel} elements")
    if chunk_index >= num_chunks:
        raise FrameError(f"chunk index: {chunk_index} >= chunk count {num_chunks}")
    if offset > numel or count > numel - offset:
        raise FrameError(f"offset/count: chunk [{offset}, {offset + count}) outside {numel} elements")
    if offset % granule:
        raise FrameError(f"offset: {offset} is not a multiple of the block size {granule}")
    if count == 0 and numel:
        raise FrameError("count: empty chunk of a non-empty tensor")
    if offset + count < numel and count % granule:
        raise FrameError(f"count: {count} is not a multiple of the block size {granule} (not the last chunk)")
    if payload_len != wire.payload_nbytes(count):
        raise FrameError(
            f"payload length: {payload_len} != {wire.payload_nbytes(count)} for {count} elements"
        )
    return Frame(
        version=version,
        codec=wire,
        dtype=DTYPES_BY_ID[dtype_id],
        shape=tuple(shape),
        name=name,
        block_size=block_size,
        chunk_index=chunk_index,
        num_chunks=num_chunks,
        offset=offset,
        count=count,
        payload=view[name_at + name_len :],
    )
