"""swarm.pipeline's stage server over real p2p daemons in this process: the answers equal local autograd,
a micro-batch counts only once committed and at most once, and hostile requests and frames are refused
while the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
import zlib
from collections.abc import Callable, Iterator

import pytest
import torch

from swarm.compression import encode_tensors, get_codec
from swarm.config import load_config
from swarm.p2p import dial, read_message, write_message
from swarm.pipeline import StageClient, StageError, StageServer, StageWorker, build_stage, plan_stages
from swarm.pipeline._compute import DeviceClock
from swarm.pipeline._protocol import IO_TIMEOUT_S, Kind, Request, ServerLimits, encode_targets, handler_name
from tests._processes import wait_until

BATCH, MICRO, TOKENS = 8, 4, 16
CONFIG = [
    "model.n_layer=3",
    "model.n_embd=32",
    "model.n_head=2",
    "model.block_size=16",
    f"train.batch_size={BATCH}",
    f"pipeline.microbatch_size={MICRO}",
    "pipeline.num_stages=3",
    "pipeline.activation_codec=fp32",
]


class _Stage:
    """A stage server of a 3-stage model, with its compute thread, and a client connected to it."""

    def __init__(self, stage: int) -> None:
        from hivemind.p2p import P2P

        self.config = load_config(None, overrides=CONFIG, env={})
        self.specs = plan_stages(self.config)
        self.module = build_stage(self.config.model, self.specs[stage], seed=0)
        self.limits = [ServerLimits.of(self.config, k, 3) for k in range(3)]
        self.stage = stage
        self.worker = StageWorker(
            self.module,
            torch.device("cpu"),
            batch_size=BATCH,
            max_queue=8,
            clock=DeviceClock(0.0, 1.0, BATCH),
        )
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._compute, daemon=True)
        self._thread.start()
        self.holders: set[str] = set()  # the client, once it exists: the only data holder
        self.server = StageServer(
            self.worker,
            self.limits[stage],
            "pp",
            data_holders=self.holders.__contains__,
            p2p_factory=P2P.create,
            request_timeout_s=10,
        )
        maddrs = self.server._loop.run(self.server._p2p.get_visible_maddrs(), timeout=10)

        async def connected() -> P2P:
            return await P2P.create(initial_peers=maddrs)

        self.client = StageClient("pp", self.limits, p2p_factory=connected)
        self.holders.add(self.client.peer_id)

    def _compute(self) -> None:
        while not self._stop.is_set():
            self.worker.process(0.02)
            if self.worker.step_ready:  # a stand-in for the inner step: keep the gradient, start a batch
                self.steps += 1
                self.worker.stepped()

    def call(self, request: Request, tensors, targets=None):
        return self.client.run(
            self.client.call(self.server.peer_id, self.stage, request, tensors, targets, timeout=20),
            timeout=30,
        )

    def raw(self, talk: Callable) -> object:
        """Run ``talk(reader, writer)`` on a fresh stream to the server (a hand-written client)."""

        async def go():
            handler = handler_name("pp", self.stage)
            reader, writer = await dial(self.client._p2p, self.server.peer_id, handler, None, 10)
            try:
                return await talk(reader, writer)
            finally:
                writer.close()

        return self.client.run(go(), timeout=30)

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in self.module.named_parameters()
        }

    def close(self) -> None:
        self.client.close()
        self.server.close()
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def stage() -> Iterator[Callable[[int], _Stage]]:
    made: list[_Stage] = []

    def make(index: int) -> _Stage:
        made.append(_Stage(index))
        return made[-1]

    yield make
    for s in made:
        s.close()


def _mb(i: int) -> str:
    return f"{i:032x}"


def test_forward_then_backward_equal_local_autograd_and_count_once_committed(stage) -> None:
    s = stage(1)  # a middle stage: forward caches, backward recomputes
    reference = build_stage(s.config.model, s.specs[1], seed=0)
    x = torch.randn(MICRO, TOKENS, 32)
    g = torch.randn(MICRO, TOKENS, 32) * 1e-3
    y = s.call(Request("forward", _mb(1), MICRO, TOKENS, False, False, True, 0), [("x", x)])
    xr = x.clone().requires_grad_(True)
    yr = reference(xr)
    assert torch.allclose(y.tensor, yr.detach(), atol=1e-5)
    dx = s.call(Request("backward", _mb(1), MICRO, TOKENS, False, False, True, 0), [("g", g)])
    yr.backward(g)
    assert torch.allclose(dx.tensor, xr.grad, atol=1e-6)
    wait_until(lambda: s.worker.stats.committed == 1, 10, "the commit")
    for name, param in reference.named_parameters():
        assert torch.allclose(s.grads()[name], param.grad, atol=1e-6), name
    # the same micro-batch again: refused, nothing added
    with pytest.raises(StageError, match="already applied"):
        s.call(Request("backward", _mb(1), MICRO, TOKENS, False, False, True, 0), [("g", g)])
    with pytest.raises(StageError, match="already applied"):
        s.call(Request("forward", _mb(1), MICRO, TOKENS, False, True, True, 0), [("x", x), ("g", g)])
    assert s.worker.committed_log == [(s.client.peer_id, _mb(1))]


def test_last_stage_answers_loss_and_input_gradient_and_an_uncommitted_one_is_taken_back(stage) -> None:
    s = stage(2)
    reference = build_stage(s.config.model, s.specs[2], seed=0)
    x, targets = torch.randn(MICRO, TOKENS, 32), torch.randint(0, 256, (MICRO, TOKENS))
    reply = s.call(Request("forward", _mb(2), MICRO, TOKENS, True, False, True, 0), [("x", x)], targets)
    xr = x.clone().requires_grad_(True)
    loss = reference.loss(xr, targets)
    (loss * MICRO / BATCH).backward()
    assert reply.loss == pytest.approx(float(loss.detach()), rel=1e-5)
    assert torch.allclose(reply.tensor, xr.grad, atol=1e-7)
    wait_until(lambda: s.worker.stats.committed == 1, 10, "the commit")
    committed = s.grads()

    async def without_commit(reader, writer):  # a client that reads the answer and leaves without COMMIT
        request = Request("forward", _mb(3), MICRO, TOKENS, True, False, True, 1)
        frames = list(encode_tensors([("x", x)], get_codec("fp32"), 1 << 20))
        await write_message(writer, Kind.REQUEST, request.to_json(), IO_TIMEOUT_S)
        await write_message(writer, Kind.TENSOR, frames[0], IO_TIMEOUT_S)
        await write_message(writer, Kind.TARGETS, encode_targets(targets), IO_TIMEOUT_S)
        kind, _ = await read_message(reader, Kind, lambda _: 1 << 20, IO_TIMEOUT_S)
        return kind

    assert s.raw(without_commit) is Kind.RESULT
    wait_until(lambda: s.worker.stats.rolled_back == 1, 20, "the rollback of the uncommitted micro-batch")
    for name, grad in s.grads().items():
        assert torch.allclose(grad, committed[name], atol=1e-7), name
    assert s.worker.stats.committed == 1 and s.worker.samples_since_step == MICRO
    # evaluation: the loss only, nothing applied
    evaluated = s.call(
        Request("forward", _mb(4), 32, TOKENS, True, False, False, 0),
        [("x", torch.randn(32, TOKENS, 32))],
        torch.randint(0, 256, (32, TOKENS)),
    )
    assert evaluated.tensor is None and evaluated.loss > 0
    assert s.worker.stats.committed == 1


def _frame(tensor: torch.Tensor, name: str = "x", codec: str = "fp32") -> bytes:
    return next(iter(encode_tensors([(name, tensor)], get_codec(codec), 1 << 20)))


def _nan_frame(shape: tuple[int, ...]) -> bytes:
    """A well-formed fp32 frame (valid crc) whose payload holds a NaN."""
    data = bytearray(_frame(torch.zeros(shape)))
    struct.pack_into("<f", data, len(data) - 4, float("nan"))
    crc = zlib.crc32(bytes(data[56:]), zlib.crc32(bytes(data[:48])))
    struct.pack_into("<I", data, 48, crc)
    return bytes(data)


def _hostile_requests() -> list[tuple[str, list[tuple[Kind, bytes]]]]:
    ok = Request("forward", _mb(9), MICRO, TOKENS, False, False, True, 1)
    shape = (MICRO, TOKENS, 32)
    good = _frame(torch.randn(shape))
    flipped = bytearray(good)
    flipped[-3] ^= 0xFF
    return [
        ("not JSON", [(Kind.REQUEST, b"\xff{garbage")]),
        ("a field missing", [(Kind.REQUEST, b'{"op": "forward"}')]),
        ("unknown op", [(Kind.REQUEST, ok.to_json().replace(b'"forward"', b'"explode"'))]),
        ("too many samples", [(Kind.REQUEST, ok.to_json().replace(b'"samples":4', b'"samples":5000'))]),
        (
            "targets on a middle stage",
            [(Kind.REQUEST, ok.to_json().replace(b'"targets":false', b'"targets":true'))],
        ),
        ("a TENSOR first", [(Kind.TENSOR, good)]),
        (
            "wrong shape",
            [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, _frame(torch.randn(MICRO, TOKENS, 31)))],
        ),
        (
            "wrong dtype",
            [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, _frame(torch.randn(shape).half(), codec="fp16"))],
        ),
        ("wrong name", [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, _frame(torch.randn(shape), name="w"))]),
        ("NaN", [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, _nan_frame(shape))]),
        ("huge values", [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, _frame(torch.full(shape, 1e9)))]),
        ("corrupt payload", [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, bytes(flipped))]),
        ("truncated frame", [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, good[:-7])]),
        ("oversized message", [(Kind.REQUEST, ok.to_json()), (Kind.TENSOR, b"\0" * ((1 << 20) + 1))]),
        (
            "backward of an unknown micro-batch",
            [
                (Kind.REQUEST, Request("backward", _mb(10), MICRO, TOKENS, False, False, True, 1).to_json()),
                (Kind.TENSOR, _frame(torch.randn(shape), name="g")),
            ],
        ),
    ]


def test_hostile_requests_get_an_error_and_the_server_keeps_serving(stage) -> None:
    s = stage(1)
    x = torch.randn(MICRO, TOKENS, 32)
    for index, (name, messages) in enumerate(_hostile_requests()):

        async def hostile(reader, writer, messages=messages):
            for kind, payload in messages:
                writer.write(bytes([kind]) + len(payload).to_bytes(4, "big") + payload)
            with contextlib.suppress(
                ConnectionError
            ):  # the server may answer and close before we sent it all
                await asyncio.wait_for(writer.drain(), IO_TIMEOUT_S)
            try:
                return await read_message(reader, Kind, lambda _: 1 << 16, IO_TIMEOUT_S)
            except (ConnectionError, asyncio.IncompleteReadError):
                # it answered and closed while our oversized message was in flight: the stream was
                # reset, and its answer with it (seen as a reset or as an end of stream)
                return None, b""

        kind, payload = s.raw(hostile)
        assert kind is Kind.ERROR or (kind is None and name == "oversized message"), (name, payload)
        assert s.worker.stats.committed == 0 and not s.worker.provisional, name
        assert all(torch.count_nonzero(g) == 0 for g in s.grads().values()), f"{name} changed a gradient"
        served = s.call(
            Request("forward", _mb(100 + index), MICRO, TOKENS, False, False, True, 0), [("x", x)]
        )
        assert served.tensor.shape == x.shape, name
    assert s.server.stats.rejected >= len(_hostile_requests()) - 2  # (the last two are refused by the worker)
