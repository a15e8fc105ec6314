"""StageServer: answers FORWARD and BACKWARD requests for one pipeline stage on a hivemind P2P stream.

Built on :class:`swarm.p2p.StreamService` like the gossip averager and the state server, so it gets the
swarm key handshake of private swarms, bounded and timed framing, and uniform fault logging. Every
request is decoded and validated on the service's loop thread (fields, sizes derived from the run config,
activation frames: shape, dtype, finiteness, magnitude); a bad one gets an ERROR and the server goes on.
The compute happens on the peer's training thread (:class:`~swarm.pipeline.StageWorker`); applying
requests wait for the client's COMMIT (see :mod:`swarm.pipeline._protocol`). Only the run's data
holders (``data_holders``: the roster's stage-0 trainers) may send a request that applies gradients;
anyone else is refused before its tensors are read, and its training forwards are served as evaluation
forwards (answered, nothing cached: it could never send the BACKWARD).

Why not ``hivemind.moe`` (SWARM's reference built on its Server / ModuleBackend / RemoteExpert): its
RPCs carry pickled-free but unbounded protobuf tensors with no per-run size limits, no swarm key, no
commit step, and its backends run their own optimizer steps per expert; our stream services already
bound every message, authenticate private swarms and are fuzz-tested, and the commit protocol needs a
stream that stays open after the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from swarm.compression import FrameError
from swarm.p2p import P2PFactory, ProtocolError, StreamService, read_message, write_message
from swarm.pipeline._compute import Outcome, StageWorker, Work
from swarm.pipeline._protocol import (
    IO_TIMEOUT_S,
    Kind,
    Request,
    ServerLimits,
    decode_targets,
    encode,
    error_json,
    handler_name,
    parse_request,
    read_tensors,
    result_json,
    send_frames,
)

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.network import SwarmKey

logger = logging.getLogger(__name__)


@dataclass
class ServerStats:
    """What the stream side saw: requests answered, refused for a bad request or frame, bytes (a request
    refused for a full queue is counted once, by the compute worker's ``busy``)."""

    answered: int = 0
    rejected: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0


class NotADataHolder(ProtocolError):
    """An applying request from a peer that is not one of the run's data holders."""


class StageServer(StreamService):
    """Serves stage ``limits.stage`` of ``run_id`` on ``swarm.pipeline.v{P}.{run_id}.stage{k}``.

    ``data_holders(peer_id)`` says whether a peer is one of the run's data holders; only they may send
    requests that apply gradients (a forward or evaluation changes nothing and is served to anyone).
    """

    what = "stage request"

    def __init__(
        self,
        worker: StageWorker,
        limits: ServerLimits,
        run_id: str,
        *,
        data_holders: Callable[[str], bool],
        dht: DHT | None = None,
        p2p_factory: P2PFactory | None = None,
        swarm_key: SwarmKey | None = None,
        request_timeout_s: float = 30.0,
    ) -> None:
        super().__init__(
            run_id,
            handler_name(run_id, limits.stage),
            dht=dht,
            p2p_factory=p2p_factory,
            swarm_key=swarm_key,
            auth_timeout_s=IO_TIMEOUT_S,
        )
        self.worker, self.limits = worker, limits
        self._data_holders = data_holders
        self._timeout = request_timeout_s
        self.stats = ServerStats()
        self._start(f"stage{limits.stage}-{run_id}")

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request, tensors, targets = await self._read_request(peer, reader)
        except NotADataHolder as exc:
            self.stats.rejected += 1
            logger.info("refused a stage request from %s: %s", peer, exc)
            await write_message(writer, Kind.ERROR, error_json(str(exc), retry=True), IO_TIMEOUT_S)
            return
        except (ProtocolError, FrameError) as exc:
            self.stats.rejected += 1
            logger.info("refused a stage request from %s: %s", peer, exc)
            await write_message(
                writer, Kind.ERROR, error_json(f"bad request: {exc}", retry=False), IO_TIMEOUT_S
            )
            return
        outcome = await self._compute(peer, request, tensors, targets)
        if outcome is None or outcome.error is not None:
            message = "timed out" if outcome is None else outcome.error or "failed"
            retry = True if outcome is None else outcome.retry
            await write_message(writer, Kind.ERROR, error_json(message, retry), IO_TIMEOUT_S)
            return
        committed = False
        try:
            frames = await asyncio.to_thread(encode, outcome.tensors, self.limits)
            queue = self.worker.queue_length
            reply = result_json(outcome.loss, queue, outcome.compute_s, len(frames))
            self.stats.bytes_sent += await write_message(writer, Kind.RESULT, reply, IO_TIMEOUT_S)
            self.stats.bytes_sent += await send_frames(writer, frames)
            self.stats.answered += 1
            if request.applies:
                kind, _ = await read_message(reader, Kind, lambda _: 0, IO_TIMEOUT_S)
                committed = kind is Kind.COMMIT
        finally:
            if request.applies:
                if not committed:
                    logger.info(
                        "micro-batch %s of %s was not committed: taking it back", request.mb[:8], peer
                    )
                self.worker.resolve((peer, request.mb), committed)

    async def _read_request(self, peer: str, reader: asyncio.StreamReader) -> tuple[Request, dict, object]:
        limits = self.limits
        kind, payload = await read_message(reader, Kind, limits.message_limit, IO_TIMEOUT_S)
        if kind is not Kind.REQUEST:
            raise ProtocolError(f"expected REQUEST, got {kind.name}")
        request = parse_request(payload, limits)
        shape = (request.samples, request.tokens, limits.n_embd)
        tensors, received = await read_tensors(reader, request.frames, request.tensor_names(), shape, limits)
        self.stats.bytes_received += len(payload) + received
        targets = None
        if request.targets:
            kind, payload = await read_message(reader, Kind, limits.message_limit, IO_TIMEOUT_S)
            if kind is not Kind.TARGETS:
                raise ProtocolError(f"expected TARGETS, got {kind.name}")
            targets = decode_targets(payload, request.samples, request.tokens, limits.vocab_size)
            self.stats.bytes_received += len(payload)
        # checked after the whole request is read (it is bounded like any forward, which anyone may send):
        # refusing mid-request would reset a stream the client is still writing, and it would see a
        # broken pipe instead of the reason
        if request.applies and not self._data_holders(peer):
            raise NotADataHolder("only this run's data holders may apply gradients here")
        if request.caches and not self._data_holders(peer):
            request = replace(request, train=False)  # it may not BACKWARD here: caching its input is waste
        return request, tensors, targets

    async def _compute(self, peer: str, request: Request, tensors: dict, targets: object) -> Outcome | None:
        """Hand the request to the compute thread; None when it did not answer in time."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()

        def done(outcome: Outcome) -> None:
            with contextlib.suppress(RuntimeError):  # the server closed meanwhile: nobody waits for it
                loop.call_soon_threadsafe(_settle, future, outcome)

        work = Work(peer, request, tensors, targets, time.monotonic() + self._timeout, done)
        if not self.worker.submit(work):
            return Outcome(error="busy: queue full", retry=True)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self._timeout)
        except TimeoutError:
            work.cancelled = True
            if request.applies:
                self.worker.resolve(work.key, commit=False)
            return None


def _settle(future: asyncio.Future, outcome: Outcome) -> None:
    if not future.done():
        future.set_result(outcome)
