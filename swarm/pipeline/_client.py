"""StageClient: a data holder's side of the stage protocol, on its own P2P replica and event loop.

:meth:`StageClient.call` sends one request to one stage peer and returns its answer, validated like
everything a peer sends (fields, frames, shape, finiteness, magnitude). For a request that applies
gradients it sends COMMIT only once the whole answer was read and checked: a call that failed before
that left nothing applied on the server (it takes its provisional gradient back), so the caller may
retry the micro-batch on another peer of the stage. If the COMMIT itself cannot be written the answer
is still used (and counted in ``commits_unconfirmed``): the caller never retries a hop it has an
answer for, so a micro-batch is applied at most once per stage, whatever fails. The COMMIT is sent
beside the caller, which goes on with the answer at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from swarm.p2p import PEER_FAULTS, P2PFactory, ProtocolError, StreamService, dial, read_message, write_message
from swarm.pipeline._protocol import (
    IO_TIMEOUT_S,
    RESULT_MAX_BYTES,
    Kind,
    Request,
    ServerLimits,
    StageError,
    encode,
    encode_targets,
    handler_name,
    parse_error,
    parse_result,
    read_tensors,
    send_frames,
)

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.network import SwarmKey

T = TypeVar("T")


@dataclass(frozen=True)
class Reply:
    """A stage peer's answer: the loss (last stage), the activations or input gradient, its queue."""

    loss: float | None
    tensor: torch.Tensor | None
    queue: int
    compute_s: float
    latency_s: float


class CallFailed(Exception):
    """The call did not produce an answer (network, timeout, a malformed answer); nothing was applied."""


class StageClient(StreamService):
    """Dials stage servers of ``run_id``; a service in client mode (its replica and loop, no handler)."""

    what = "stage call"

    def __init__(
        self,
        run_id: str,
        limits: Sequence[ServerLimits],
        *,
        dht: DHT | None = None,
        p2p_factory: P2PFactory | None = None,
        swarm_key: SwarmKey | None = None,
    ) -> None:
        super().__init__(run_id, dht=dht, p2p_factory=p2p_factory, swarm_key=swarm_key, client_mode=True)
        self._run_id = run_id
        self.limits = list(limits)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.commits_unconfirmed = 0
        """COMMITs whose stream broke before the server closed it: it may have taken the micro-batch back."""
        self._commits: set[asyncio.Task] = set()
        self._start(f"stage-client-{run_id}")

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the client's loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the client's loop and wait for it."""
        return self._loop.run(coro, timeout)

    async def call(
        self,
        peer: str,
        stage: int,
        request: Request,
        tensors: Sequence[tuple[str, torch.Tensor]],
        targets: torch.Tensor | None,
        timeout: float,
    ) -> Reply:
        """One request to ``peer``'s stage ``stage``; StageError (its refusal) or CallFailed."""
        started = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                limits = self.limits[stage]
                frames = await asyncio.to_thread(encode, tensors, limits)
                reader, writer = await dial(
                    self._p2p, peer, handler_name(self._run_id, stage), self._swarm_key, IO_TIMEOUT_S
                )
                request = replace(request, frames=len(frames))
                return await self._exchange(reader, writer, request, frames, targets, limits, started)
        except StageError:
            raise
        except Exception as exc:  # PEER_FAULTS, FrameError, hivemind's ControlFailure when a dial fails...
            raise CallFailed(f"{type(exc).__name__}: {str(exc)[:200]}") from None

    async def _exchange(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: Request,
        frames: list[bytes],
        targets: torch.Tensor | None,
        limits: ServerLimits,
        started: float,
    ) -> Reply:
        """The request, its answer and (beside the caller) the COMMIT on a dialled stream, which it closes."""
        committing = False
        try:
            self.bytes_sent += await write_message(writer, Kind.REQUEST, request.to_json(), IO_TIMEOUT_S)
            self.bytes_sent += await send_frames(writer, frames)
            if targets is not None:
                self.bytes_sent += await write_message(
                    writer, Kind.TARGETS, encode_targets(targets), IO_TIMEOUT_S
                )
            kind, payload = await read_message(reader, Kind, _answer_limit, IO_TIMEOUT_S)
            if kind is Kind.ERROR:
                raise parse_error(payload)
            if kind is not Kind.RESULT:
                raise ProtocolError(f"expected RESULT, got {kind.name}")
            shape = (request.samples, request.tokens, limits.n_embd)
            expects_tensor = not (request.targets and not request.train)
            result = parse_result(payload, limits.max_frames(request.samples, request.tokens, 1))
            tensor = None
            if expects_tensor:
                name = "dx" if request.applies else "y"
                received, nbytes = await read_tensors(reader, result.frames, (name,), shape, limits)
                self.bytes_received += nbytes
                tensor = received[name]
            elif result.frames or result.loss is None:
                raise ProtocolError("an evaluation answer carries the loss and no tensor")
            if request.applies and result.loss is None and request.targets:
                raise ProtocolError("the last stage's answer has no loss")
            if request.applies:
                task = asyncio.create_task(self._commit(reader, writer))
                self._commits.add(task)
                task.add_done_callback(self._commits.discard)
                committing = True
            latency = time.monotonic() - started
            return Reply(result.loss, tensor, result.queue, result.compute_s, latency)
        finally:
            if not committing:
                writer.close()

    async def _commit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """COMMIT, then keep the stream open until the server closes it (it has read the COMMIT by then).

        Runs beside the caller, who already uses the answer: the chain does not wait a round trip."""
        try:
            self.bytes_sent += await write_message(writer, Kind.COMMIT, b"", IO_TIMEOUT_S)
            await asyncio.wait_for(reader.read(1), IO_TIMEOUT_S)
        except PEER_FAULTS:
            self.commits_unconfirmed += 1
        finally:
            writer.close()

    def _stop_work(self) -> None:
        """Before the replica goes: let the COMMITs in flight arrive (bounded), or their servers take the
        micro-batches back."""
        with contextlib.suppress(Exception):
            self._loop.run(self._drain_commits(), timeout=IO_TIMEOUT_S + 1)

    async def _drain_commits(self) -> None:
        if self._commits:
            await asyncio.wait(list(self._commits), timeout=IO_TIMEOUT_S)


def _answer_limit(kind: Kind) -> int:
    return RESULT_MAX_BYTES if kind in (Kind.RESULT, Kind.ERROR) else 0
