"""FrameStore: the payloads of received frames, kept in the agreed codec and decoded when read.

A :class:`~swarm.compression.TensorStreamDecoder` turns a stream into float32 tensors as it arrives:
four bytes per element, however compact the wire was. An exchange of a large model needs what a
partner sent several times (to validate it, to clip it, to mix it) but never all of it at once, so
the gossip engine keeps the partner's payloads instead: one byte per element and a scale per block for
int8, and decodes one tensor at a time, whenever it is read.

What a store keeps is bounded by what the agreed schema and codec need, never by what the partner
sends: every frame must be in the store's codec, a tensor comes in at most as many chunks as
``DecodeLimits.min_chunk_bytes`` allows, and each frame's payload is copied into its tensor's buffer,
``codec.payload_nbytes(numel)`` bytes reserved (not yet written) at the tensor's first frame. No
object outlives the frame it came in: a million one-element frames cost what one frame of a million
elements costs, if the limits let them in at all.

Every frame is checked when it arrives exactly as the decoder checks it (header, checksum, limits,
the expected schema, the codec, chunks on one grid that do not repeat), and :meth:`FrameStore.complete`
checks that every tensor is whole. Only the values are decoded later: a NaN, an Inf or an
out-of-range scale surfaces as :class:`~swarm.compression.FrameError` from :meth:`FrameStore.tensor`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swarm.compression._codecs import Codec, tensor_bytes
from swarm.compression._errors import DecodeLimits, FrameError
from swarm.compression._frames import Frame, wire_codec
from swarm.compression._stream import TensorStreamDecoder, decode_values


class FrameStore(TensorStreamDecoder):
    """Checks frames fed one at a time (in any order) and keeps their payloads; decodes on demand."""

    def __init__(
        self,
        expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        limits: DecodeLimits = DecodeLimits(),
        *,
        codec: Codec,
        keep: bool = True,
    ) -> None:
        super().__init__(expected, limits, codec=codec)
        self._wire = wire_codec(codec.name, codec.block_size)
        self._payloads: dict[str, torch.Tensor] = {}
        self._nbytes = 0
        self.keep = keep
        """False: check every frame, keep none (a stream that is read only to be checked)."""

    def _allocate(self, f: Frame) -> None:
        if not self.keep:
            return
        size = f.codec.payload_nbytes(f.numel)  # the agreed codec's (decode_frame refused any other)
        try:
            self._payloads[f.name] = torch.empty(size, dtype=torch.uint8)  # untouched until written
        except RuntimeError as exc:
            raise FrameError(f"shape: cannot allocate {size} payload bytes for {f.name!r}") from exc

    def _take(self, f: Frame, data: bytes | bytearray | memoryview) -> None:
        if not self.keep:
            return
        whole = tensor_bytes(self._payloads[f.name])
        for src, dst, length in f.codec.payload_spans(f.numel, f.offset, f.count):
            whole[dst : dst + length] = f.payload[src : src + length]
        self._nbytes += len(f.payload)

    @property
    def nbytes(self) -> int:
        """Payload bytes kept: at most the payload of the expected tensors in the store's codec."""
        return self._nbytes

    def finish(self) -> dict[str, torch.Tensor]:
        """Not available: a store hands out one tensor at a time (:meth:`complete`, :meth:`tensor`)."""
        raise TypeError("a FrameStore decodes one tensor at a time: call complete(), then tensor(name)")

    def complete(self) -> None:
        """End the stream; FrameError unless every expected tensor arrived whole."""
        self._complete()

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor(self, name: str) -> torch.Tensor:
        """A fresh tensor of ``name`` decoded from its payload, in the dtype it was sent with;
        FrameError for values the limits refuse (NaN, Inf, bad scales)."""
        if not self._finished or self._failed is not None or not self.keep:
            raise FrameError("stream: the store is not complete, or keeps no frames")
        pending = self._tensors[name]
        out = torch.empty(pending.numel, dtype=pending.dtype)
        payload = tensor_bytes(self._payloads[name])
        decode_values(self._wire, name, payload, pending.numel, out, self.limits)
        return out.reshape(pending.shape)
