"""FrameStore: frames checked as they arrive like the stream decoder checks them, kept as received,
and decoded one tensor at a time."""

from __future__ import annotations

import pytest
import torch

from swarm.compression import FrameError, FrameStore, TensorStreamDecoder, encode_tensors, get_codec
from tests._faults import NanCodec

TENSORS = {"w": torch.randn(40, 50, generator=torch.Generator().manual_seed(0)), "b": torch.randn(7)}
SCHEMA = {name: (tuple(t.shape), t.dtype) for name, t in TENSORS.items()}


def _frames(codec: str = "int8") -> list[bytes]:
    return list(encode_tensors(list(TENSORS.items()), get_codec(codec, 64), chunk_bytes=512))


@pytest.mark.parametrize("codec", ["int8", "bf16", "fp32"])
def test_a_store_decodes_what_the_stream_decoder_decodes_and_keeps_only_the_frames(codec: str) -> None:
    frames = _frames(codec)
    store, decoder = FrameStore(expected=SCHEMA), TensorStreamDecoder(expected=SCHEMA)
    for frame in reversed(frames):  # any order
        store.feed(frame)
        decoder.feed(frame)
    store.complete()
    decoded = decoder.finish()
    for name in TENSORS:
        assert torch.equal(store.tensor(name), decoded[name])
    assert store.nbytes == sum(len(f) for f in frames)  # the wire's size, not four bytes an element
    if codec == "int8":
        assert store.nbytes < 0.4 * sum(4 * t.numel() for t in TENSORS.values())


def test_a_store_refuses_what_the_decoder_refuses_as_the_frame_arrives() -> None:
    frames = _frames()
    store = FrameStore(expected=SCHEMA)
    store.feed(frames[0])
    with pytest.raises(FrameError, match="duplicate chunk"):
        store.feed(frames[0])
    with pytest.raises(FrameError, match="already failed"):  # poisoned, as the decoder is
        store.feed(frames[1])
    other = FrameStore(expected={"w": ((40, 51), torch.float32), "b": SCHEMA["b"]})
    with pytest.raises(FrameError, match="shape"):
        other.feed(frames[0])
    corrupt = bytearray(frames[0])
    corrupt[-1] ^= 0xFF
    with pytest.raises(FrameError, match="checksum"):
        FrameStore(expected=SCHEMA).feed(bytes(corrupt))


def test_a_store_is_read_only_once_complete_and_a_missing_chunk_is_named() -> None:
    frames = _frames()
    store = FrameStore(expected=SCHEMA)
    for frame in frames[1:]:
        store.feed(frame)
    with pytest.raises(FrameError, match="not complete"):
        store.tensor("b")
    with pytest.raises(FrameError, match="chunk count"):
        store.complete()
    with pytest.raises(TypeError, match="one tensor at a time"):
        FrameStore().finish()


def test_nan_in_a_frame_is_refused_when_its_tensor_is_read() -> None:
    """Values are decoded when read: a non-finite value in fp32 frames is a FrameError then."""
    store = FrameStore(expected=SCHEMA)
    for frame in encode_tensors([("w", TENSORS["w"])], NanCodec(get_codec("fp32")), chunk_bytes=512):
        store.feed(frame)
    for frame in encode_tensors([("b", TENSORS["b"])], get_codec("fp32"), chunk_bytes=512):
        store.feed(frame)
    store.complete()
    assert torch.equal(store.tensor("b"), TENSORS["b"])
    with pytest.raises(FrameError, match="NaN"):
        store.tensor("w")


def test_a_store_that_keeps_nothing_still_checks_every_frame() -> None:
    frames = _frames()
    store = FrameStore(expected=SCHEMA, keep=False)
    for frame in frames:
        store.feed(frame)
    store.complete()
    assert store.nbytes == 0
    with pytest.raises(FrameError, match="keeps no frames"):
        store.tensor("w")
    checking = FrameStore(expected=SCHEMA, keep=False)
    checking.feed(frames[0])
    with pytest.raises(FrameError, match="duplicate chunk"):
        checking.feed(frames[0])
