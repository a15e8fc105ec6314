"""Wire frames: layout, limits, fuzzing (only FrameError, quickly), streaming."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.compression import (
    CODEC_NAMES,
    HEADER_SIZE,
    DecodeLimits,
    FrameError,
    TensorStreamDecoder,
    decode_frame,
    encode_frame,
    encode_tensors,
    get_codec,
)

FUZZ = settings(max_examples=150, deadline=200, suppress_health_check=[HealthCheck.too_slow])


def frame_of(name: str = "w", codec: str = "int8", n: int = 300, seed: int = 0) -> bytes:
    c = get_codec(codec, 64)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return encode_frame(name, c.encode(x), c)


def with_crc(frame: bytes | bytearray) -> bytes:
    """Recompute the checksum so a test reaches the field checks behind it."""
    body = bytearray(frame)
    crc = zlib.crc32(bytes(body[HEADER_SIZE:]), zlib.crc32(bytes(body[: HEADER_SIZE - 4])))
    body[HEADER_SIZE - 4 : HEADER_SIZE] = struct.pack("<I", crc)
    return bytes(body)


def patch(frame: bytes, offset: int, fmt: str, value: int) -> bytes:
    body = bytearray(frame)
    struct.pack_into(fmt, body, offset, value)
    return with_crc(body)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_single_frame_roundtrip(codec: str) -> None:
    c = get_codec(codec, 64)
    x = torch.randn(5, 67)
    f = decode_frame(encode_frame("layer.0.weight", c.encode(x), c))
    assert (f.name, f.shape, f.dtype, f.codec.name, f.count) == (
        "layer.0.weight",
        (5, 67),
        x.dtype,
        codec,
        335,
    )
    assert torch.equal(f.values().view(5, 67), c.roundtrip(x))


# offsets into the fixed header: version 4, codec 5, dtype 6, ndim 7, name len 8, flags 10, block 12,
# chunk index 16, chunk count 20, offset 24, count 32, payload len 40
@pytest.mark.parametrize(
    ("offset", "fmt", "value", "field"),
    [
        (4, "<B", 9, "version"),
        (5, "<B", 77, "codec id"),
        (6, "<B", 0, "dtype id"),
        (7, "<B", 9, "ndim"),
        (8, "<H", 0, "name length"),
        (8, "<H", 257, "name length"),
        (10, "<H", 1, "flags"),
        (12, "<I", 48, "block size"),
        (12, "<I", 1 << 20, "block size"),
        (16, "<I", 5, "chunk index"),
        (20, "<I", 0, "chunk count"),
        (24, "<Q", 64, "offset"),
        (32, "<Q", 299, "count"),
        (32, "<Q", 256, "payload length"),
        (40, "<Q", 1 << 40, "payload length"),
    ],
)
def test_each_bad_field_is_named(offset: int, fmt: str, value: int, field: str) -> None:
    with pytest.raises(FrameError, match=field):
        decode_frame(patch(frame_of(), offset, fmt, value))


def test_magic_checksum_and_length_are_checked() -> None:
    good = frame_of()
    with pytest.raises(FrameError, match="magic"):
        decode_frame(b"XXXX" + good[4:])
    flipped = bytearray(good)
    flipped[-1] ^= 1
    with pytest.raises(FrameError, match="checksum"):
        decode_frame(bytes(flipped))
    with pytest.raises(FrameError, match="frame length"):
        decode_frame(good[:-1])
    with pytest.raises(FrameError, match="frame length"):
        decode_frame(good + b"\0")
    with pytest.raises(FrameError, match="header"):
        decode_frame(good[:10])
    with pytest.raises(FrameError, match="expected bytes"):
        decode_frame(12345)  # type: ignore[arg-type]


def test_limits_are_enforced_before_allocation() -> None:
    big = frame_of(n=10_000)
    with pytest.raises(FrameError, match="shape"):
        decode_frame(big, DecodeLimits(max_elements=9_999))
    with pytest.raises(FrameError, match="payload length"):
        decode_frame(big, DecodeLimits(max_payload_bytes=1000))
    with pytest.raises(FrameError, match="name length"):
        decode_frame(frame_of(name="x" * 40), DecodeLimits(max_name_bytes=39))
    c = get_codec("fp32")
    with pytest.raises(FrameError, match="ndim"):
        decode_frame(encode_frame("t", c.encode(torch.zeros([1] * 5)), c), DecodeLimits(max_ndim=4))
    # a header claiming 2**62 elements is refused without trying to allocate them
    huge = patch(frame_of(n=64), HEADER_SIZE, "<Q", 1 << 62)
    with pytest.raises(FrameError, match="shape"):
        decode_frame(huge)


def test_payload_content_is_checked() -> None:
    c = get_codec("int8", 64)
    frame = bytearray(encode_frame("w", c.encode(torch.randn(64)), c))
    start = len(frame) - c.payload_nbytes(64)
    struct.pack_into("<f", frame, start, float("nan"))
    with pytest.raises(FrameError, match="scales"):
        decode_frame(with_crc(frame)).values()
    struct.pack_into("<f", frame, start, -1.0)
    with pytest.raises(FrameError, match="scales"):
        decode_frame(with_crc(frame)).values()
    c4 = get_codec("int4", 64)
    odd = bytearray(encode_frame("w", c4.encode(torch.randn(3)), c4))
    odd[-1] |= 0x0F
    with pytest.raises(FrameError, match="4-bit"):
        decode_frame(with_crc(odd)).values()
    fp = get_codec("fp16")
    nan = encode_frame("w", fp.encode(torch.ones(4)), fp)
    nan = bytearray(nan)
    struct.pack_into("<H", nan, len(nan) - 2, 0x7E00)  # fp16 NaN
    with pytest.raises(FrameError, match="NaN"):
        decode_frame(with_crc(nan)).values()
    assert decode_frame(with_crc(nan)).values(DecodeLimits(allow_nonfinite=True)).isnan().any()


@FUZZ
@given(st.binary(max_size=400))
def test_fuzz_random_bytes_only_raise_frame_error(data: bytes) -> None:
    with pytest.raises(FrameError):
        decode_frame(data).values()


@FUZZ
@given(
    codec=st.sampled_from(CODEC_NAMES),
    n=st.integers(0, 300),
    flips=st.lists(st.integers(0, 10_000), min_size=1, max_size=4),
    cut=st.integers(0, 2000),
    tail=st.binary(max_size=16),
    fix_crc=st.booleans(),
    mode=st.sampled_from(["flip", "truncate", "extend"]),
)
def test_fuzz_mutated_frames_only_raise_frame_error(
    codec: str, n: int, flips: list[int], cut: int, tail: bytes, fix_crc: bool, mode: str
) -> None:
    good = frame_of(codec=codec, n=n)
    if mode == "flip":
        body = bytearray(good)
        for bit in flips:
            body[(bit // 8) % len(body)] ^= 1 << (bit % 8)
        bad = bytes(body)
    elif mode == "truncate":
        bad = good[: cut % len(good)]
    else:
        bad = good + (tail or b"\0")
    if fix_crc and len(bad) >= HEADER_SIZE:
        bad = with_crc(bad)
    try:
        frame = decode_frame(bad, DecodeLimits(max_elements=1 << 20))
        out = frame.values()
    except FrameError:
        return
    # a mutation that survives every check (e.g. flipped payload bits + fixed crc) is still a
    # well-formed frame: it decodes to the announced number of finite values
    assert out.numel() == frame.count and torch.isfinite(out).all()


@FUZZ
@given(frames=st.lists(st.binary(max_size=120), max_size=4))
def test_fuzz_stream_decoder_only_raises_frame_error(frames: list[bytes]) -> None:
    decoder = TensorStreamDecoder()
    with pytest.raises(FrameError):
        for f in [*frames, b""]:
            decoder.feed(f)


# ------------------------------------------------------------------------------------ streaming


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("embed", torch.randn(300, 70, generator=g)),
        ("bias", torch.randn(5, generator=g)),
        ("empty", torch.zeros(0, 4)),
        ("scalar", torch.tensor(2.5)),
        ("half", torch.randn(999, generator=g).to(torch.bfloat16)),
    ]


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("chunk_bytes", [512, 1 << 20])
def test_stream_roundtrip_with_bounded_frames(codec: str, chunk_bytes: int) -> None:
    c = get_codec(codec, 64)
    tensors = named_tensors()
    frames = list(encode_tensors(tensors, c, chunk_bytes=chunk_bytes))
    assert all(len(f) <= chunk_bytes for f in frames)
    if chunk_bytes == 512:
        assert len(frames) > 20
    decoder = TensorStreamDecoder({name: (tuple(t.shape), t.dtype) for name, t in tensors})
    for f in frames[::-1]:  # any order
        decoder.feed(f)
    out = decoder.finish()
    for name, t in tensors:
        assert out[name].shape == t.shape and out[name].dtype == t.dtype
        assert torch.equal(out[name].float(), c.roundtrip(t).to(t.dtype).float()), name


def test_stream_errors() -> None:
    c = get_codec("int8", 64)
    tensors = named_tensors()
    frames = list(encode_tensors(tensors, c, chunk_bytes=512))
    expected = {name: (tuple(t.shape), t.dtype) for name, t in tensors}

    def run(seq: list[bytes], exp=expected) -> dict:
        d = TensorStreamDecoder(exp)
        for f in seq:
            d.feed(f)
        return d.finish()

    with pytest.raises(FrameError, match="chunk count"):
        run(frames[:3] + frames[4:])
    with pytest.raises(FrameError, match="duplicate"):
        run([frames[0], *frames])
    with pytest.raises(FrameError, match="missing tensors"):
        run([f for f in frames if decode_frame(f).name != "bias"])
    with pytest.raises(FrameError, match="unexpected tensor"):
        run(frames, {k: v for k, v in expected.items() if k != "bias"})
    with pytest.raises(FrameError, match="shape"):
        run(frames, {**expected, "bias": ((6,), torch.float32)})
    with pytest.raises(FrameError, match="dtype"):
        run(frames, {**expected, "bias": ((5,), torch.float16)})
    # overlapping chunks: the same range sent again under another chunk index is off the grid
    f0 = frames[0]
    overlap = patch(f0, 16, "<I", decode_frame(f0).chunk_index + 1)
    with pytest.raises(FrameError, match=r"offset: chunk 1 .* is not chunk 1 of"):
        run([f0, overlap])
    # chunks cut to two sizes overlap: each is on a grid, but not on the same one
    fp32, x = get_codec("fp32"), torch.randn(1000)
    cut_300 = encode_frame("x", fp32.encode(x), fp32, 0, 300, 0, 4)
    cut_250 = encode_frame("x", fp32.encode(x), fp32, 250, 250, 1, 4)
    with pytest.raises(
        FrameError, match="cut in chunks of 250 elements, its earlier chunks in chunks of 300"
    ):
        run([cut_300, cut_250], {"x": ((1000,), torch.float32)})
    # chunks of one tensor must agree on codec/shape; a failed decoder stays failed
    other = encode_frame("embed", get_codec("int4", 64).encode(torch.randn(300, 70)), get_codec("int4", 64))
    d = TensorStreamDecoder()
    d.feed(frames[0])
    with pytest.raises(FrameError, match="disagree"):
        d.feed(other)
    with pytest.raises(FrameError, match="already failed"):
        d.finish()


def test_out_of_order_chunks_are_placed_in_constant_work_each() -> None:
    """2000 one-element frames, every other one first, then the gaps from the end: each frame is
    placed by its chunk index on the grid, one chunk record looked at per frame (a sorted list of
    ranges moved up to the whole list for each)."""
    fp32, x = get_codec("fp32"), torch.randn(2000)
    frames = list(encode_tensors([("w", x)], fp32, chunk_bytes=HEADER_SIZE + 8 + 1 + 4))
    assert len(frames) == 2000
    decoder = TensorStreamDecoder({"w": ((2000,), torch.float32)})
    for frame in [*frames[1::2], *frames[::2][::-1]]:
        decoder.feed(frame)
    assert torch.equal(decoder.finish()["w"], x)
    assert decoder.chunk_steps == len(frames)


def test_min_chunk_bytes_bounds_the_chunk_count_from_the_header() -> None:
    """A tensor may come in no more chunks than frames of ``min_chunk_bytes`` need (5 for 16384 int8
    values in 4096-byte frames): the 256 chunks of one-block frames are refused from the first."""
    c, x = get_codec("int8", 64), torch.randn(64 * 256)
    honest = list(encode_tensors([("w", x)], c, chunk_bytes=4096))
    limits = DecodeLimits(min_chunk_bytes=4096)
    assert len(honest) == 5 and all(decode_frame(f, limits, c) for f in honest)
    tiny = next(iter(encode_tensors([("w", x)], c, chunk_bytes=HEADER_SIZE + 8 + 1 + c.block_nbytes())))
    assert decode_frame(tiny).num_chunks == 256
    with pytest.raises(FrameError, match=r"chunk count: 256 not in \[1, 5\]"):
        decode_frame(tiny, limits)
    with pytest.raises(FrameError, match=r"codec: a frame in int8 .* agreed on fp32"):
        decode_frame(tiny, codec=get_codec("fp32"))


def test_stream_limits() -> None:
    c = get_codec("fp16")
    frames = list(encode_tensors([("a", torch.ones(10)), ("b", torch.ones(10))], c))
    d = TensorStreamDecoder(limits=DecodeLimits(max_tensors=1))
    d.feed(frames[0])
    with pytest.raises(FrameError, match="more than 1 tensors"):
        d.feed(frames[1])
    d = TensorStreamDecoder(limits=DecodeLimits(max_total_elements=15))
    d.feed(frames[0])
    with pytest.raises(FrameError, match="15 elements"):
        d.feed(frames[1])


def test_encode_tensors_validates_chunk_size_eagerly() -> None:
    c = get_codec("int8", 64)
    with pytest.raises(ValueError, match="chunk_bytes"):
        encode_tensors([("w", torch.randn(100))], c, chunk_bytes=HEADER_SIZE + 8 + 1 + 60)
    assert next(iter(encode_tensors([("w", torch.randn(100))], c, chunk_bytes=HEADER_SIZE + 9 + 68)))
    with pytest.raises(ValueError, match="twice"):
        encode_tensors([("w", torch.randn(1)), ("w", torch.randn(1))], c)


def test_stream_memory_is_chunked() -> None:
    """A tensor far larger than the chunk size travels in many frames of at most chunk_bytes."""
    c = get_codec("int4", 64)
    x = torch.randn(1 << 20)
    sizes = [len(f) for f in encode_tensors([("big", x)], c, chunk_bytes=64 << 10)]
    assert max(sizes) <= 64 << 10 and len(sizes) >= 8
    assert sum(sizes) / x.numel() < 0.54
