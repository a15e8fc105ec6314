"""The stage server's wire protocol: one request per hivemind binary stream, ``swarm.p2p`` framing.

Handler ``swarm.pipeline.v{PROTOCOL_VERSION}.{run_id}.stage{k}``. Every message is ``kind (1 byte) |
length (4 bytes BE) | payload``::

    client                                                      stage server
    REQUEST {"op", "mb", "samples", "tokens", "targets", "grad", "train", "frames"}  ──▶
    TENSOR x frames   (swarm.compression frames: "x" the input activations, "g" a gradient)  ──▶
    TARGETS           (samples x tokens little-endian int32, last stage only)  ──▶
                                    ◀── RESULT {"loss", "queue", "compute_s", "frames"}, TENSOR x frames
                                    ◀── or ERROR {"error", "retry"}
    COMMIT  (requests that apply a gradient: the client used the result)  ──▶

Operations:

* ``forward`` of ``x``: the output activations ``y``; a middle stage caches ``x`` for the backward.
  With ``targets`` (last stage): the loss, and with ``train`` also the input gradient ``dx`` (forward
  and backward at once). With ``grad`` (a middle stage, whose cached input was lost): forward and
  backward at once with the output gradient ``g``, answering ``dx``.
* ``backward`` with ``g``: recomputes the forward from the cached input, answers ``dx``.
* ``train: false`` (evaluation): no cache, no gradient; the last stage answers the loss only.

A request that computes parameter gradients (:attr:`Request.applies`) adds them to the server's
accumulator *provisionally*: only a COMMIT on the same stream makes them count; a stream that ends
without it takes them back. So a client that gave up on a server (timeout) and retried elsewhere
never has a micro-batch applied twice, and a server applies a micro-batch id at most once.
"""

from __future__ import annotations

import asyncio
import enum
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from swarm._protocol import protocol_id
from swarm.compression import DecodeLimits, FrameError, TensorStreamDecoder, encode_tensors, get_codec
from swarm.config import RunConfig
from swarm.p2p import HEADER_LEN, ProtocolError, dump_json, parse_json, read_message, write_message

IO_TIMEOUT_S = 20.0
"""Each message read and each write drain (both sides)."""
REQUEST_MAX_BYTES = 4096
RESULT_MAX_BYTES = 4096
ERROR_MAX_BYTES = 4096
MAX_ABS = 65504.0
"""Largest magnitude an activation or gradient may have (float16's range); anything larger is hostile."""
EVAL_SAMPLES = 32
"""Windows an evaluation request may carry (a training micro-batch: ``pipeline.microbatch_size``)."""
MB_ID = re.compile(r"^[0-9a-f]{32}$")


class StageError(Exception):
    """A stage server answered with an error (``retry``: whether another peer of the stage may help)."""

    def __init__(self, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.retry = retry


class Kind(enum.IntEnum):
    REQUEST = 1
    TENSOR = 2
    TARGETS = 3
    RESULT = 4
    ERROR = 5
    COMMIT = 6


def handler_name(run_id: str, stage: int) -> str:
    return protocol_id("pipeline", f"{run_id}.stage{stage}")


@dataclass(frozen=True)
class ServerLimits:
    """What a stage server accepts; derived from the run config, the same on every peer of the run."""

    stage: int
    num_stages: int
    samples: int
    block_size: int
    n_embd: int
    vocab_size: int
    chunk_bytes: int
    codec: str
    codec_block: int

    @classmethod
    def of(cls, config: RunConfig, stage: int, num_stages: int) -> ServerLimits:
        m = config.model
        return cls(
            stage=stage,
            num_stages=num_stages,
            samples=config.pipeline.microbatch_size,
            block_size=m.block_size,
            n_embd=m.n_embd,
            vocab_size=m.vocab_size,
            chunk_bytes=config.compression.chunk_bytes,
            codec=config.pipeline.activation_codec,
            codec_block=config.compression.block_size,
        )

    @property
    def last(self) -> bool:
        return self.stage == self.num_stages - 1

    def max_frames(self, samples: int, tokens: int, tensors: int) -> int:
        """Frames ``tensors`` activations of this size can take at most (chunks start on codec blocks)."""
        return tensors * max(1, math.ceil(samples * tokens * self.n_embd / 16))

    def message_limit(self, kind: Kind) -> int:
        if kind is Kind.TENSOR:
            return self.chunk_bytes
        if kind is Kind.TARGETS:
            return 4 * max(self.samples, EVAL_SAMPLES) * self.block_size
        return REQUEST_MAX_BYTES if kind is Kind.REQUEST else 0


@dataclass(frozen=True)
class Request:
    op: str
    mb: str
    samples: int
    tokens: int
    targets: bool
    grad: bool
    train: bool
    frames: int

    @property
    def applies(self) -> bool:
        """Whether serving it computes parameter gradients (and so waits for a COMMIT)."""
        return self.train and (self.op == "backward" or self.targets or self.grad)

    @property
    def caches(self) -> bool:
        """A middle stage's training forward: keep the input for the backward."""
        return self.train and self.op == "forward" and not (self.targets or self.grad)

    def tensor_names(self) -> tuple[str, ...]:
        if self.op == "backward":
            return ("g",)
        return ("x", "g") if self.grad else ("x",)

    def to_json(self) -> bytes:
        return dump_json({k: getattr(self, k) for k in Request.__dataclass_fields__})


def parse_request(payload: bytes, limits: ServerLimits) -> Request:
    """A request from an untrusted client; ProtocolError naming what is wrong."""
    obj = parse_json(payload)
    fields = set(Request.__dataclass_fields__)
    if set(obj) != fields:
        raise ProtocolError(f"request fields {sorted(obj)} != {sorted(fields)}")
    flags = {k: obj[k] for k in ("targets", "grad", "train")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise ProtocolError("targets, grad and train must be booleans")
    ints = {k: obj[k] for k in ("samples", "tokens", "frames")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints.values()):
        raise ProtocolError("samples, tokens and frames must be integers")
    request = Request(op=obj["op"], mb=obj["mb"], **ints, **flags)
    _check(request, limits)
    return request


def _check(r: Request, limits: ServerLimits) -> None:
    if r.op not in ("forward", "backward"):
        raise ProtocolError(f"unknown op {str(r.op)[:20]!r}")
    if not isinstance(r.mb, str) or not MB_ID.match(r.mb):
        raise ProtocolError("mb must be 32 lowercase hex digits")
    most = limits.samples if r.train else max(limits.samples, EVAL_SAMPLES)
    if not 1 <= r.samples <= most:
        raise ProtocolError(f"samples {r.samples} not in [1, {most}]")
    if not 1 <= r.tokens <= limits.block_size:
        raise ProtocolError(f"tokens {r.tokens} not in [1, {limits.block_size}]")
    if r.targets != limits.last:
        raise ProtocolError("targets go with the last stage, and only there")
    if r.grad and (limits.last or r.op != "forward" or not r.train):
        raise ProtocolError("an output gradient goes with a training forward of a middle stage")
    if r.op == "backward" and (limits.last or not r.train):
        raise ProtocolError("backward is for middle stages in training (the last stage backprops at once)")
    most_frames = limits.max_frames(r.samples, r.tokens, len(r.tensor_names()))
    if not len(r.tensor_names()) <= r.frames <= most_frames:
        raise ProtocolError(f"frames {r.frames} not in [{len(r.tensor_names())}, {most_frames}]")


def encode(named: Sequence[tuple[str, torch.Tensor]], limits: ServerLimits) -> list[bytes]:
    """Frames of float32 CPU copies of ``named`` in the activation codec."""
    codec = get_codec(limits.codec, limits.codec_block)
    plain = [(name, t.detach().to("cpu", torch.float32).contiguous()) for name, t in named]
    return list(encode_tensors(plain, codec, limits.chunk_bytes))


async def send_frames(writer: asyncio.StreamWriter, frames: Sequence[bytes]) -> int:
    sent = 0
    for frame in frames:
        sent += await write_message(writer, Kind.TENSOR, frame, IO_TIMEOUT_S)
    return sent


async def read_tensors(
    reader: asyncio.StreamReader,
    frames: int,
    names: Sequence[str],
    shape: tuple[int, ...],
    limits: ServerLimits,
) -> tuple[dict[str, torch.Tensor], int]:
    """Read ``frames`` TENSOR messages holding exactly ``names``, each float32 of ``shape``; check values.

    Returns the tensors and the bytes read. FrameError (shape, dtype, finiteness, chunking, magnitude)
    or ProtocolError (framing)."""
    numel = math.prod(shape)
    decoder = TensorStreamDecoder(
        expected={name: (shape, torch.float32) for name in names},
        limits=DecodeLimits(
            max_elements=numel, max_total_elements=numel * len(names), max_tensors=len(names), max_ndim=3
        ),
    )
    received = 0
    for _ in range(frames):
        _, payload = await read_message(reader, _Tensor, lambda _: limits.chunk_bytes, IO_TIMEOUT_S)
        decoder.feed(payload)
        received += HEADER_LEN + len(payload)
    tensors = decoder.finish()
    for name, tensor in tensors.items():
        if bool((tensor.abs() > MAX_ABS).any()):
            raise FrameError(f"payload: values of {name!r} exceed {MAX_ABS:g} in magnitude")
    return tensors, received


class _Tensor(enum.IntEnum):
    TENSOR = Kind.TENSOR


def encode_targets(targets: torch.Tensor) -> bytes:
    return targets.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()


def decode_targets(payload: bytes, samples: int, tokens: int, vocab_size: int) -> torch.Tensor:
    """Token ids ``(samples, tokens)`` from a TARGETS payload; FrameError if the size or a value is wrong."""
    if len(payload) != 4 * samples * tokens:
        raise FrameError(f"targets: {len(payload)} bytes, expected {4 * samples * tokens}")
    values = torch.frombuffer(bytearray(payload), dtype=torch.int32).reshape(samples, tokens).long()
    if bool(((values < 0) | (values >= vocab_size)).any()):
        raise FrameError(f"targets: token ids outside [0, {vocab_size})")
    return values


def result_json(loss: float | None, queue: int, compute_s: float, frames: int) -> bytes:
    return dump_json({"loss": loss, "queue": queue, "compute_s": round(compute_s, 6), "frames": frames})


@dataclass(frozen=True)
class Result:
    loss: float | None
    queue: int
    compute_s: float
    frames: int


def parse_result(payload: bytes, most_frames: int) -> Result:
    """A server's RESULT; ProtocolError when a field is missing, of the wrong type or out of range."""
    obj = parse_json(payload)
    loss, queue, compute, frames = (obj.get(k) for k in ("loss", "queue", "compute_s", "frames"))
    if loss is not None and not (isinstance(loss, int | float) and 0 <= loss <= 1e6):
        raise ProtocolError("result loss out of range")
    if not (isinstance(queue, int) and 0 <= queue <= 1 << 20):
        raise ProtocolError("result queue out of range")
    if not (isinstance(compute, int | float) and 0 <= compute <= 1e6):
        raise ProtocolError("result compute_s out of range")
    if not (isinstance(frames, int) and 0 <= frames <= most_frames):
        raise ProtocolError(f"result frames not in [0, {most_frames}]")
    return Result(None if loss is None else float(loss), queue, float(compute), frames)


def error_json(message: str, retry: bool = True) -> bytes:
    return dump_json({"error": message[:500], "retry": retry})


def parse_error(payload: bytes) -> StageError:
    try:
        obj = parse_json(payload)
    except ProtocolError as exc:
        return StageError(f"malformed error: {exc}")
    return StageError(str(obj.get("error", "?"))[:500], retry=obj.get("retry") is not False)
