"""FrameStore: frames checked as they arrive like the stream decoder checks them, their payloads kept
in the agreed codec (and no more than the schema needs), and decoded one tensor at a time."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from swarm.compression import (
    HEADER_SIZE,
    DecodeLimits,
    FrameError,
    FrameStore,
    TensorStreamDecoder,
    encode_tensors,
    get_codec,
)
from tests._faults import NanCodec

TENSORS = {"w": torch.randn(40, 50, generator=torch.Generator().manual_seed(0)), "b": torch.randn(7)}
SCHEMA = {name: (tuple(t.shape), t.dtype) for name, t in TENSORS.items()}
INT8 = get_codec("int8", 64)


def _frames(codec: str = "int8", chunk_bytes: int = 512) -> list[bytes]:
    return list(encode_tensors(list(TENSORS.items()), get_codec(codec, 64), chunk_bytes=chunk_bytes))


def _payload_nbytes(codec: str, schema: dict = SCHEMA) -> int:
    """What the schema's tensors need in ``codec``: the most a store may keep."""
    return sum(get_codec(codec, 64).payload_nbytes(torch.Size(shape).numel()) for shape, _ in schema.values())


@pytest.mark.parametrize("codec", ["int8", "bf16", "fp32"])
def test_a_store_decodes_what_the_stream_decoder_decodes_and_keeps_only_the_frames(codec: str) -> None:
    frames = _frames(codec)
    store, decoder = FrameStore(expected=SCHEMA, codec=get_codec(codec, 64)), TensorStreamDecoder(SCHEMA)
    for frame in reversed(frames):  # any order
        store.feed(frame)
        decoder.feed(frame)
    store.complete()
    decoded = decoder.finish()
    for name in TENSORS:
        assert torch.equal(store.tensor(name), decoded[name])
    assert store.nbytes == _payload_nbytes(codec)  # the payloads' size, not four bytes an element
    if codec == "int8":
        assert store.nbytes < 0.4 * sum(4 * t.numel() for t in TENSORS.values())


def test_a_store_refuses_what_the_decoder_refuses_as_the_frame_arrives() -> None:
    frames = _frames()
    store = FrameStore(expected=SCHEMA, codec=INT8)
    store.feed(frames[0])
    with pytest.raises(FrameError, match="duplicate chunk"):
        store.feed(frames[0])
    with pytest.raises(FrameError, match="already failed"):  # poisoned, as the decoder is
        store.feed(frames[1])
    other = FrameStore(expected={"w": ((40, 51), torch.float32), "b": SCHEMA["b"]}, codec=INT8)
    with pytest.raises(FrameError, match="shape"):
        other.feed(frames[0])
    corrupt = bytearray(frames[0])
    corrupt[-1] ^= 0xFF
    with pytest.raises(FrameError, match="checksum"):
        FrameStore(expected=SCHEMA, codec=INT8).feed(bytes(corrupt))


def test_a_store_is_read_only_once_complete_and_a_missing_chunk_is_named() -> None:
    frames = _frames()
    store = FrameStore(expected=SCHEMA, codec=INT8)
    for frame in frames[1:]:
        store.feed(frame)
    with pytest.raises(FrameError, match="not complete"):
        store.tensor("b")
    with pytest.raises(FrameError, match="chunk count"):
        store.complete()
    with pytest.raises(TypeError, match="one tensor at a time"):
        FrameStore(codec=INT8).finish()


def test_nan_in_a_frame_is_refused_when_its_tensor_is_read() -> None:
    """Values are decoded when read: a non-finite value in fp32 frames is a FrameError then."""
    store = FrameStore(expected=SCHEMA, codec=get_codec("fp32"))
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
    store = FrameStore(expected=SCHEMA, codec=INT8, keep=False)
    for frame in frames:
        store.feed(frame)
    store.complete()
    assert store.nbytes == 0
    with pytest.raises(FrameError, match="keeps no frames"):
        store.tensor("w")
    checking = FrameStore(expected=SCHEMA, codec=INT8, keep=False)
    checking.feed(frames[0])
    with pytest.raises(FrameError, match="duplicate chunk"):
        checking.feed(frames[0])


def test_tiny_fp32_frames_under_an_int8_agreement_are_refused_before_anything_is_kept() -> None:
    """A partner that agreed on int8 and sends one-element fp32 frames (65 bytes each, four payload
    bytes): the first is refused from its header, as is int8 in another block size; nothing is kept."""
    tiny = list(encode_tensors([("b", TENSORS["b"])], get_codec("fp32"), chunk_bytes=HEADER_SIZE + 8 + 1 + 4))
    assert len(tiny) == 7 and {len(f) for f in tiny} == {HEADER_SIZE + 8 + 1 + 4}
    store = FrameStore(expected=SCHEMA, codec=INT8)
    with pytest.raises(FrameError, match=r"codec: a frame in fp32 .* agreed on int8"):
        store.feed(tiny[0])
    assert store.nbytes == 0
    other_block = next(iter(encode_tensors([("b", TENSORS["b"])], get_codec("int8", 16))))
    with pytest.raises(FrameError, match=r"codec: a frame in int8 \(block size 16\)"):
        FrameStore(expected=SCHEMA, codec=INT8).feed(other_block)


def test_a_flood_of_frames_beyond_what_the_schema_needs_is_refused_before_it_is_kept() -> None:
    """In the agreed codec, but one block a frame: 256 frames where chunks of 4096 bytes need 5. The
    first frame's chunk count is refused, and the store's bytes never pass what the schema needs."""
    schema = {"w": ((64 * 256,), torch.float32)}
    x = {"w": torch.randn(64 * 256)}
    limits = DecodeLimits(min_chunk_bytes=4096)
    honest = FrameStore(schema, limits, codec=INT8)
    for frame in encode_tensors(x, INT8, chunk_bytes=4096):
        honest.feed(frame)
    honest.complete()
    assert honest.nbytes == _payload_nbytes("int8", schema)
    flood = list(encode_tensors(x, INT8, chunk_bytes=HEADER_SIZE + 8 + 1 + INT8.block_nbytes()))
    assert len(flood) == 256
    store = FrameStore(schema, limits, codec=INT8)
    for frame in flood:
        with pytest.raises(FrameError, match=r"chunk count: 256 not in \[1, 5\]|already failed"):
            store.feed(frame)
        assert store.nbytes == 0


def test_a_kept_frame_costs_its_payload_and_no_object_of_its_own() -> None:
    """Each payload is copied into its tensor's buffer: nothing of a frame outlives its feed (a Frame,
    memoryviews and a codec object per frame, holding the received bytes, were over 1 KiB a frame).
    Python objects are traced; the buffer (torch's allocator) is what ``nbytes`` accounts for."""
    x = {"w": torch.randn(64 * 1000)}
    frames = list(encode_tensors(x, INT8, chunk_bytes=HEADER_SIZE + 8 + 1 + INT8.block_nbytes()))
    store = FrameStore({"w": ((64 * 1000,), torch.float32)}, codec=INT8)
    tracemalloc.start()
    try:
        for frame in frames:
            store.feed(frame)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    store.complete()
    assert held < 150 * len(frames), f"{held / len(frames):.0f} bytes of Python objects a frame"
    assert store.nbytes == INT8.payload_nbytes(64 * 1000)
    assert torch.equal(store.tensor("w"), INT8.roundtrip(x["w"]))
