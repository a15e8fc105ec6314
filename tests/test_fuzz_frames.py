"""Fuzzing the parsers under every protocol: message framing, control JSON, tensor frames and streams,
and the membership record schema. Only the documented rejections, quickly, with bounded memory.

tests/test_compression_frames.py already fuzzes single frames with random and mutated bytes; this file
adds what those do not reach: crafted headers with a valid checksum, reordered / duplicated / dropped
frames of a real stream, values that overflow the announced dtype, and the layers around the frames.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
import tracemalloc

import pydantic.v1 as pydantic
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hypothesis import event, given
from hypothesis import strategies as st

from swarm.compression import (
    CODEC_NAMES,
    HEADER_SIZE,
    DecodeLimits,
    FrameError,
    TensorStreamDecoder,
    encode_frame,
    encode_tensors,
    get_codec,
)
from swarm.membership import PeerRecord, membership_validators, record_key
from swarm.p2p._framing import (
    HEADER_LEN,
    MAX_JSON_DEPTH,
    ProtocolError,
    parse_json,
    read_message,
    write_message,
)
from tests.workers.fuzz import FakeWriter, Kind, bounded, crafted_frames, fuzz_settings, with_crc

FUZZ = fuzz_settings(120)
FEW = fuzz_settings(40)

# ------------------------------------------------------------------------------- message framing


async def _read(data: bytes, eof: bool, limit: int = 1 << 16, timeout: float = 0.02) -> tuple[Kind, bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return await read_message(reader, Kind, lambda kind: limit, timeout)


@FUZZ
@given(data=st.binary(max_size=64), eof=st.booleans())
def test_fuzz_read_message_only_rejects_cleanly(data: bytes, eof: bool) -> None:
    """Arbitrary bytes: a message, or ProtocolError / a short read / the read timeout; nothing else."""
    try:
        kind, payload = bounded(_read(data, eof))
    except (ProtocolError, asyncio.IncompleteReadError, TimeoutError):
        return
    length = int.from_bytes(data[1:HEADER_LEN], "big")
    assert kind == data[0] and payload == data[HEADER_LEN : HEADER_LEN + length]


@FUZZ
@given(kind=st.sampled_from(Kind), payload=st.binary(max_size=300), extra=st.binary(max_size=20))
def test_fuzz_framing_roundtrip(kind: Kind, payload: bytes, extra: bytes) -> None:
    """What write_message puts on a stream reads back unchanged, and leaves what follows unread."""

    async def roundtrip() -> tuple[Kind, bytes, bytes]:
        writer = FakeWriter()
        sent = await write_message(writer, kind, payload, 1.0)
        assert sent == len(writer.data) == HEADER_LEN + len(payload)
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(writer.data) + extra)
        reader.feed_eof()
        got = await read_message(reader, Kind, lambda k: len(payload), 1.0)
        return (*got, await reader.read())

    assert bounded(roundtrip()) == (kind, payload, extra)


@pytest.mark.parametrize("eof", [True, False])
def test_claimed_huge_length_allocates_only_what_arrives(eof: bool) -> None:
    """A header announcing 4 GiB (within a permissive limit) followed by 64 KiB and EOF or silence."""
    header = bytes([Kind.DATA]) + (2**32 - 1).to_bytes(4, "big")
    tracemalloc.start()
    try:
        with pytest.raises(asyncio.IncompleteReadError if eof else TimeoutError):
            bounded(_read(header + b"\0" * 65536, eof, limit=2**32, timeout=0.3))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, f"peak {peak} bytes for a message that never arrived"


def test_oversized_length_is_refused_from_the_header() -> None:
    header = bytes([Kind.HELLO]) + (70_000).to_bytes(4, "big")
    with pytest.raises(ProtocolError, match="exceeds the limit of 65536"):
        bounded(_read(header, eof=False))
    with pytest.raises(ProtocolError, match="unknown message kind 0"):
        bounded(_read(b"\0" * HEADER_LEN, eof=False))


# -------------------------------------------------------------------------------- control JSON

_json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70) | st.sampled_from([2**64, -(2**63) - 1, 10**400, -(10**400)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
)
_hostile_json = st.sampled_from(
    [
        b"[" * 100_000,
        b'{"a":' + b"[" * 40 + b"]" * 40 + b"}",
        b'{"a":' + b"9" * 5000 + b"}",
        b'{"a":NaN}',
        b'{"a":-Infinity}',
        b'{"a":1e400}',
        b'{"a":"\\ud800"}',
        b"\xff\xfe",
        b"",
        b"[]",
        b"null",
    ]
)


def _finite_and_shallow(obj: object, depth: int = 1) -> bool:
    if isinstance(obj, float):
        return math.isfinite(obj)
    if isinstance(obj, int):
        return -(2**63) <= obj < 2**64
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list):
        return depth <= MAX_JSON_DEPTH and all(_finite_and_shallow(x, depth + 1) for x in obj)
    return True


@FUZZ
@given(st.one_of(st.binary(max_size=200), _hostile_json, _json_value.map(lambda v: json.dumps(v).encode())))
def test_fuzz_parse_json_only_protocol_error(payload: bytes) -> None:
    """Control messages: a plain, finite, shallow JSON object with 64-bit integers, or ProtocolError
    (never ValueError, RecursionError, a NaN that a later json.dumps(allow_nan=False) would choke on,
    or an integer that float() cannot convert)."""
    try:
        obj = parse_json(payload)
    except ProtocolError:
        return
    assert isinstance(obj, dict) and _finite_and_shallow(obj)
    json.dumps(obj, allow_nan=False)


# -------------------------------------------------------------------- tensor frames and streams


@FUZZ
@given(frames=st.lists(crafted_frames(), min_size=1, max_size=3), expected=st.booleans())
def test_fuzz_crafted_headers_only_frame_error(frames: list[bytes], expected: bool) -> None:
    """Lying headers with a valid checksum: FrameError, or data that decodes to finite values inside
    the announced shape; never another exception, and no allocation past the limits."""
    limits = DecodeLimits(max_elements=1 << 16, max_total_elements=1 << 17)
    schema = {"w": ((64,), torch.float32)} if expected else None
    decoder = TensorStreamDecoder(schema, limits)
    try:
        for frame in frames:
            decoder.feed(frame)
        tensors = decoder.finish()
    except FrameError as exc:
        event(str(exc).split(":")[0])  # which check caught it (see --hypothesis-show-statistics)
        return
    event("accepted")
    for name, t in tensors.items():
        assert t.numel() <= limits.max_elements and torch.isfinite(t.float()).all(), name


def _stream(codec: str) -> tuple[list[bytes], dict[str, torch.Tensor], dict]:
    g = torch.Generator().manual_seed(7)
    named = [
        ("a", torch.randn(40, 9, generator=g)),
        ("b", torch.randn(130, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(3, generator=g)),
    ]
    c = get_codec(codec, 16)
    frames = list(encode_tensors(named, c, chunk_bytes=HEADER_SIZE + 8 * 2 + 1 + 4 * 64))
    reference = {name: c.roundtrip(t).to(t.dtype) for name, t in named}
    return frames, reference, {name: (tuple(t.shape), t.dtype) for name, t in named}


_STREAMS = {codec: _stream(codec) for codec in CODEC_NAMES}


@FUZZ
@given(codec=st.sampled_from(CODEC_NAMES), data=st.data())
def test_fuzz_reordered_duplicated_dropped_frames(codec: str, data: st.DataObject) -> None:
    """Any selection of a real stream's frames, in any order: it decodes (to exactly the reference)
    if and only if it is a permutation of all frames; otherwise FrameError."""
    frames, reference, schema = _STREAMS[codec]
    picks = data.draw(st.lists(st.integers(0, len(frames) - 1), max_size=2 * len(frames)))
    if data.draw(st.booleans()):
        picks = data.draw(st.permutations(range(len(frames))))
    decoder = TensorStreamDecoder(schema)
    try:
        for i in picks:
            decoder.feed(frames[i])
        out = decoder.finish()
    except FrameError:
        assert sorted(picks) != list(range(len(frames)))
        return
    assert sorted(picks) == list(range(len(frames)))
    for name, t in reference.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


@FEW
@given(
    dtype=st.sampled_from([torch.float16, torch.bfloat16]),
    value=st.floats(min_value=6.6e4, max_value=3.4e38) | st.floats(max_value=-6.6e4, min_value=-3.4e38),
)
def test_fuzz_values_that_overflow_the_announced_dtype_are_rejected(dtype: torch.dtype, value: float) -> None:
    """An fp32 payload for a tensor announced as fp16/bf16 must not turn into Inf in the buffer."""
    c = get_codec("fp32")
    encoded = c.encode(torch.tensor([value, 1.0]))
    frame = encode_frame("w", encoded, c)
    body = bytearray(frame)
    body[6] = {torch.float16: 2, torch.bfloat16: 3}[dtype]
    decoder = TensorStreamDecoder({"w": ((2,), dtype)})
    try:
        decoder.feed(with_crc(body))
        out = decoder.finish()
    except FrameError as exc:
        assert "finite" in str(exc) or "overflow" in str(exc)
        return
    assert torch.isfinite(out["w"]).all()


# -------------------------------------------------------------------------- membership records

_RUN = "fuzzrun"
_PEER = "Qm" + "a" * 44


def _valid_record() -> dict:
    return PeerRecord(
        peer_id=_PEER, protocol_version=1, package_version="0.1", config_hash="ab", role="trainer"
    ).dict()


_garbage = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**80), 2**80),
    st.floats(),
    st.text(max_size=300),
    st.binary(max_size=20),
    st.lists(st.text(max_size=300), max_size=20),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@FUZZ
@given(changes=st.dictionaries(st.sampled_from([*PeerRecord.__fields__, "extra"]), _garbage, max_size=4))
def test_fuzz_peer_record_garbage(changes: dict) -> None:
    """Garbage field values: pydantic's ValidationError, or a record that keeps every bound."""
    value = {**_valid_record(), **changes}
    try:
        record = PeerRecord.parse_obj(value)
    except pydantic.ValidationError:
        return
    for name, field in record.dict().items():
        if isinstance(field, float):
            assert math.isfinite(field) and 0 <= field <= 1e18, name
        elif isinstance(field, int) and not isinstance(field, bool):
            assert 0 <= field < 2**63, name
        elif isinstance(field, str):
            assert len(field) <= 256, name
    assert len(record.addresses) <= 16
    assert PeerRecord.parse_obj(record.dict()) == record


_SIGNER = RSASignatureValidator()
_SCHEMA_VALIDATOR = membership_validators(_RUN, _SIGNER)[1]
_KEY = DHTID.generate(source=record_key(_RUN)).to_bytes()
_OWNER = DHTProtocol.serializer.dumps(_SIGNER.local_public_key)
_msgpack_garbage = _garbage.filter(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**64)


def _validate(subkey: bytes, value: bytes) -> bool:
    return _SCHEMA_VALIDATOR.validate(DHTRecord(key=_KEY, subkey=subkey, value=value, expiration_time=1e12))


@FUZZ
@given(
    value=st.one_of(
        st.binary(max_size=60),
        st.dictionaries(st.sampled_from([*PeerRecord.__fields__, "x"]), _msgpack_garbage, max_size=5).map(
            lambda changes: DHTProtocol.serializer.dumps({**_valid_record(), **changes})
        ),
    ),
    subkey=st.one_of(st.just(_OWNER), st.binary(max_size=20).map(DHTProtocol.serializer.dumps)),
)
def test_fuzz_dht_schema_validator_answers_a_bool(value: bytes, subkey: bytes) -> None:
    """The DHT-side schema check on raw (msgpack) record bytes never raises; garbage is refused."""
    ok = _validate(subkey, value)
    assert isinstance(ok, bool)
    if ok:
        PeerRecord.parse_obj(DHTProtocol.serializer.loads(value))


def test_membership_key_is_the_validated_one() -> None:
    """Guard for the fuzz test above: a valid record under that key and subkey passes the validator."""
    assert _validate(_OWNER, DHTProtocol.serializer.dumps(_valid_record()))
    assert not _validate(_OWNER, DHTProtocol.serializer.dumps({**_valid_record(), "step": -1}))


@pytest.mark.parametrize("subkey", [b"\x80", b"\x90"])
def test_unhashable_subkey_is_rejected_not_raised(subkey: bytes) -> None:
    assert not _validate(subkey, DHTProtocol.serializer.dumps(_valid_record()))


def test_an_allocation_the_machine_refuses_is_a_frame_error() -> None:
    """Limits set far too high: a header claiming 2**60 float64 elements (8 EiB) is still a
    FrameError, not the allocator's RuntimeError escaping the decoder."""
    c = get_codec("fp32")
    body = bytearray(encode_frame("w", c.encode(torch.ones(64)), c, count=8, num_chunks=8))
    struct.pack_into("<B", body, 6, 4)  # dtype id: float64
    # the last of 2**31 + 1 chunks of 2**29 elements: 8 elements at 2**60, on the grid of its tensor
    struct.pack_into("<IIQ", body, 16, 2**31, 2**31 + 1, 2**60)  # chunk index, chunk count, offset
    struct.pack_into("<Q", body, HEADER_SIZE, 2**60 + 8)  # shape
    limits = DecodeLimits(max_elements=2**62, max_total_elements=2**62)
    with pytest.raises(FrameError, match="cannot allocate"):
        TensorStreamDecoder(limits=limits).feed(with_crc(body))
