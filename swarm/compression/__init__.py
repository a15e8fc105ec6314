"""Quantized codecs, error feedback and the strict wire format (see docs/compression.md)."""

from swarm.compression._codecs import CODEC_NAMES, Codec, EncodedTensor, get_codec
from swarm.compression._errors import DecodeLimits, FrameError
from swarm.compression._feedback import ErrorFeedback
from swarm.compression._frames import FORMAT_VERSION, HEADER_SIZE, Frame, decode_frame, encode_frame
from swarm.compression._lazy import LazyTensors, Schema, schema_of
from swarm.compression._store import FrameStore
from swarm.compression._stream import TensorStreamDecoder, encode_tensors

__all__ = [
    "CODEC_NAMES",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "Codec",
    "DecodeLimits",
    "EncodedTensor",
    "ErrorFeedback",
    "Frame",
    "FrameError",
    "FrameStore",
    "LazyTensors",
    "Schema",
    "TensorStreamDecoder",
    "decode_frame",
    "encode_frame",
    "encode_tensors",
    "get_codec",
    "schema_of",
]
