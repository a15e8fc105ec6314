"""Streaming: named tensors -> bounded-size frames -> named tensors, one frame at a time.

The sender never builds a message larger than `chunk_bytes`; the receiver allocates each tensor
once (after its first header passed every check) and decodes each frame straight into it, so
memory stays bounded by one frame plus the tensors themselves.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from swarm.compression._codecs import Codec, EncodedTensor
from swarm.compression._errors import DecodeLimits, FrameError
from swarm.compression._feedback import ErrorFeedback
from swarm.compression._frames import Frame, decode_frame, encode_frame, header_size
from swarm.compression._lazy import schema_of


def _chunk_elements(codec: Codec, name: str, ndim: int, chunk_bytes: int) -> int:
    head = header_size(name, ndim)
    blocks = (chunk_bytes - head) // codec.block_nbytes()
    if blocks < 1:
        raise ValueError(
            f"chunk_bytes={chunk_bytes} cannot hold a frame of {name!r}: "
            f"{head} header bytes + {codec.block_nbytes()} bytes for one block"
        )
    return blocks * codec.granule


def encode_tensors(
    named: Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    codec: Codec,
    chunk_bytes: int = 1 << 20,
    error_feedback: ErrorFeedback | None = None,
    commit_residuals: bool = False,
    keep_residuals: bool = True,
) -> Iterator[bytes]:
    """Frames (each <= `chunk_bytes`) for `named`, tensor by tensor, in order.

    With `error_feedback`, each tensor is encoded through it with ``commit=commit_residuals``:
    by default the new residuals stay pending until the caller, once the exchange succeeded,
    calls ``error_feedback.commit_all()`` (or ``discard_pending()`` if it failed). With
    ``keep_residuals=False`` nothing is kept (``ErrorFeedback.peek``): the caller folds each residual
    itself once the exchange committed (``ErrorFeedback.fold``).

    Sizes are checked before the first frame is produced: ValueError if `chunk_bytes` cannot hold
    a header plus one block for some tensor, or if a name repeats.
    """
    if isinstance(named, Mapping):
        source: Mapping[str, torch.Tensor] = named
        shapes = [(name, shape) for name, (shape, _) in schema_of(named).items()]
    else:
        source = dict(named)  # a repeated name is refused below, before anything is encoded
        shapes = [(name, tuple(tensor.shape)) for name, tensor in named]
    plan = []
    seen: set[str] = set()
    for name, shape in shapes:
        if name in seen:
            raise ValueError(f"tensor name {name!r} appears twice")
        seen.add(name)
        if error_feedback is not None and error_feedback.codec.name != codec.name:
            raise ValueError("error_feedback uses a different codec than `codec`")
        plan.append((name, _chunk_elements(codec, name, len(shape), chunk_bytes)))
    return _frames(source, plan, codec, error_feedback, commit_residuals, keep_residuals)


def _frames(
    source: Mapping[str, torch.Tensor],
    plan: list[tuple[str, int]],
    codec: Codec,
    feedback: ErrorFeedback | None,
    commit: bool,
    keep: bool,
) -> Iterator[bytes]:
    for name, per_chunk in plan:
        tensor = source[name]  # one at a time: a LazyTensors computes it here
        encoded: EncodedTensor
        if feedback is None:
            encoded = codec.encode(tensor)
        elif keep:
            encoded = feedback.encode(name, tensor, commit=commit)
        else:
            encoded = feedback.peek(name, tensor)
        del tensor  # while its frames go out, only its encoding is alive (a LazyTensors makes each anew)
        encoded = encoded.cpu()
        numel = encoded.numel
        num_chunks = max(1, math.ceil(numel / per_chunk))
        for index in range(num_chunks):
            offset = index * per_chunk
            count = min(per_chunk, numel - offset)
            yield encode_frame(name, encoded, codec, offset, count, index, num_chunks)


def chunk_size(f: Frame) -> int:
    """The chunk size ``p`` of the grid the frame ``f`` lies on; FrameError if it lies on none.

    A tensor's ``k`` chunks are the grid :func:`encode_tensors` cuts: chunk ``i`` holds the elements
    ``[i * p, min((i + 1) * p, numel))``. Any frame tells ``p`` (its count, or for the last chunk its
    offset over ``k - 1``), so a chunk is placed by its index alone, and two chunks with different
    indices on one grid never overlap.
    """
    n, k, i = f.numel, f.num_chunks, f.chunk_index
    if k == 1:
        p, ok = f.count, f.offset == 0 and f.count == n
    elif i < k - 1:
        p = f.count
        ok = f.offset == i * p and (k - 1) * p < n <= k * p
    else:
        p, rest = divmod(f.offset, k - 1)
        ok = not rest and not p % f.codec.granule and f.offset + f.count == n and f.count <= p
    if not ok:
        raise FrameError(
            f"offset: chunk {i} [{f.offset}, {f.offset + f.count}) of {f.name!r} is not chunk {i} "
            f"of {k} equal chunks of {n} elements"
        )
    return p


class _Pending:
    """One tensor being received: its header, its chunk size, and which chunks arrived (O(1) a frame)."""

    __slots__ = ("chunks", "dtype", "header", "num_chunks", "numel", "per_chunk", "received", "shape")

    def __init__(self, f: Frame, per_chunk: int) -> None:
        self.header = _header(f)
        self.shape, self.dtype, self.numel, self.num_chunks = f.shape, f.dtype, f.numel, f.num_chunks
        self.per_chunk = per_chunk
        self.chunks: set[int] = set()
        self.received = 0

    def check_consistent(self, f: Frame, per_chunk: int) -> None:
        if _header(f) != self.header:
            raise FrameError(
                f"header: codec/dtype/shape/block size/chunk count of a chunk of {f.name!r} "
                "disagree with its earlier chunks"
            )
        if per_chunk != self.per_chunk:
            raise FrameError(
                f"offset: chunk {f.chunk_index} of {f.name!r} is cut in chunks of {per_chunk} "
                f"elements, its earlier chunks in chunks of {self.per_chunk}"
            )
        if f.chunk_index in self.chunks:
            raise FrameError(f"chunk index: duplicate chunk {f.chunk_index} of {f.name!r}")

    def add(self, f: Frame) -> None:
        self.chunks.add(f.chunk_index)
        self.received += f.count

    def whole(self) -> bool:
        return self.received == self.numel and len(self.chunks) == self.num_chunks


def _header(f: Frame) -> tuple[object, ...]:
    return (f.codec.name, f.dtype, f.shape, f.block_size, f.num_chunks)


class TensorStreamDecoder:
    """Reassembles named tensors from frames fed one at a time (in any order).

    With `expected` (name -> (shape, dtype)), a frame for an unknown name, or with another shape or
    dtype, is rejected from its header, before anything is allocated; with `codec`, so is a frame in
    another codec or block size. A tensor's chunks must lie on one grid (:func:`chunk_size`), so each
    is placed by its index in O(1), in any order. Any `FrameError` poisons the decoder: later
    `feed`/`finish` calls raise too, so a half-received exchange is never used. `finish` returns each
    tensor in the dtype it was sent with.
    """

    def __init__(
        self,
        expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        limits: DecodeLimits = DecodeLimits(),
        *,
        codec: Codec | None = None,
    ) -> None:
        self.expected = None if expected is None else {k: (tuple(s), d) for k, (s, d) in expected.items()}
        self.limits = limits
        self.codec = codec
        """The codec the stream agreed on (None: any, but one per tensor): a frame in another is refused."""
        self.chunk_steps = 0
        """Chunk records looked at to place the frames so far: one per frame, in any order."""
        self._tensors: dict[str, _Pending] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._total_elements = 0
        self._failed: str | None = None
        self._finished = False

    def feed(self, frame: bytes | bytearray | memoryview) -> None:
        self._check_usable()
        try:
            self._feed(frame)
        except FrameError as exc:
            self._failed = str(exc)
            raise

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        f = decode_frame(data, self.limits, self.codec)
        if self.expected is not None:
            if f.name not in self.expected:
                raise FrameError(f"name: unexpected tensor {f.name!r}")
            shape, dtype = self.expected[f.name]
            if f.shape != shape:
                raise FrameError(f"shape: {f.name!r} has shape {f.shape}, expected {shape}")
            if f.dtype != dtype:
                raise FrameError(f"dtype: {f.name!r} has dtype {f.dtype}, expected {dtype}")
        per_chunk = chunk_size(f)
        pending = self._tensors.get(f.name)
        if pending is None:
            if len(self._tensors) >= self.limits.max_tensors:
                raise FrameError(f"name: more than {self.limits.max_tensors} tensors in one stream")
            if self._total_elements + f.numel > self.limits.max_total_elements:
                raise FrameError(f"shape: stream exceeds {self.limits.max_total_elements} elements in total")
            self._allocate(f)
            pending = self._tensors[f.name] = _Pending(f, per_chunk)
            self._total_elements += f.numel
        pending.check_consistent(f, per_chunk)
        self._take(f, data)
        pending.add(f)
        self.chunk_steps += 1

    def _allocate(self, f: Frame) -> None:
        """The first frame of a tensor passed every check: make room for the whole tensor."""
        try:
            self._buffers[f.name] = torch.empty(f.numel, dtype=f.dtype)
        except RuntimeError as exc:  # the allocator refused: within the limits, but not on this machine
            raise FrameError(f"shape: cannot allocate {f.numel} elements for {f.name!r}") from exc

    def _take(self, f: Frame, data: bytes | bytearray | memoryview) -> None:
        """A checked frame: decode it into its tensor."""
        decode_chunk(f, self._buffers[f.name][f.offset : f.offset + f.count], self.limits)

    def finish(self) -> dict[str, torch.Tensor]:
        """All tensors, complete; FrameError if any tensor or chunk is missing."""
        self._complete()
        return {name: self._buffers[name].reshape(p.shape) for name, p in self._tensors.items()}

    def _complete(self) -> None:
        """End the stream: FrameError (and the decoder is spent) unless every tensor is whole."""
        self._check_usable()
        self._finished = True
        missing = set(self.expected or ()) - set(self._tensors)
        if missing:
            self._failed = f"name: missing tensors {sorted(missing)}"
            raise FrameError(self._failed)
        for name, p in self._tensors.items():
            if not p.whole():
                self._failed = (
                    f"chunk count: {name!r} got {len(p.chunks)}/{p.num_chunks} chunks, "
                    f"{p.received}/{p.numel} elements"
                )
                raise FrameError(self._failed)

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise FrameError(f"stream: decoder already failed ({self._failed})")
        if self._finished:
            raise FrameError("stream: decoder already finished")


def decode_chunk(f: Frame, out: torch.Tensor, limits: DecodeLimits) -> None:
    """Decode the checked frame ``f`` into ``out`` (its ``count`` elements, in the frame's dtype)."""
    decode_values(f.codec, f.name, f.payload, f.count, out, limits)


def decode_values(
    codec: Codec, name: str, payload: memoryview, count: int, out: torch.Tensor, limits: DecodeLimits
) -> None:
    """Decode ``count`` values of ``name`` (a checked payload) into ``out``, in ``out``'s dtype."""
    if out.dtype == torch.float32:
        codec.decode_payload(payload, count, out, limits.allow_nonfinite)
    else:
        values = torch.empty(count, dtype=torch.float32)
        codec.decode_payload(payload, count, values, limits.allow_nonfinite)
        out.copy_(values)
        if not limits.allow_nonfinite and not bool(torch.isfinite(out).all()):
            raise FrameError(f"payload: values of {name!r} overflow its dtype {out.dtype}")
