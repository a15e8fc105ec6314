"""FrameStore: received frames kept as they came, each tensor decoded only when it is read.

A :class:`~swarm.compression.TensorStreamDecoder` turns a stream into float32 tensors as it arrives:
four bytes per element, however compact the wire was. An exchange of a large model needs what a
partner sent several times (to validate it, to clip it, to mix it) but never all of it at once, so
the gossip engine keeps the partner's frames instead: one byte per element and a scale per block for
int8, and decodes one tensor at a time, whenever it is read.

Every frame is checked when it arrives exactly as the decoder checks it (header, checksum, limits,
the expected schema, chunks that neither repeat nor overlap), and :meth:`FrameStore.finish` checks
that every tensor is whole. Only the values are decoded later: a NaN, an Inf or an out-of-range
scale surfaces as :class:`~swarm.compression.FrameError` from :meth:`FrameStore.tensor`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from swarm.compression._errors import DecodeLimits, FrameError
from swarm.compression._frames import Frame
from swarm.compression._stream import TensorStreamDecoder, decode_chunk


class FrameStore(TensorStreamDecoder):
    """Checks frames fed one at a time (in any order) and keeps their bytes; decodes on demand."""

    def __init__(
        self,
        expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        limits: DecodeLimits = DecodeLimits(),
        *,
        keep: bool = True,
    ) -> None:
        super().__init__(expected, limits)
        self._frames: dict[str, list[Frame]] = {}
        self._nbytes = 0
        self.keep = keep
        """False: check every frame, keep none (a stream that is read only to be checked)."""

    def _allocate(self, f: Frame) -> None:
        self._frames[f.name] = []

    def _take(self, f: Frame, data: bytes | bytearray | memoryview) -> None:
        if self.keep:
            self._frames[f.name].append(f)  # its payload is a view of ``data``: the bytes as received
            self._nbytes += len(data)

    @property
    def nbytes(self) -> int:
        """Bytes of the frames kept."""
        return self._nbytes

    def finish(self) -> dict[str, torch.Tensor]:
        """Not available: a store hands out one tensor at a time (:meth:`complete`, :meth:`tensor`)."""
        raise TypeError("a FrameStore decodes one tensor at a time: call complete(), then tensor(name)")

    def complete(self) -> None:
        """End the stream; FrameError unless every expected tensor arrived whole."""
        self._complete()

    def names(self) -> list[str]:
        return list(self._frames)

    def tensor(self, name: str) -> torch.Tensor:
        """A fresh tensor of ``name`` decoded from its frames, in the dtype it was sent with;
        FrameError for values the limits refuse (NaN, Inf, bad scales)."""
        if not self._finished or self._failed is not None or not self.keep:
            raise FrameError("stream: the store is not complete, or keeps no frames")
        first = self._tensors[name].frame
        out = torch.empty(first.numel, dtype=first.dtype)
        for f in self._frames[name]:
            decode_chunk(f, out[f.offset : f.offset + f.count], self.limits)
        return out.reshape(first.shape)
