"""The serving side: a protocol handler on a peer's p2p daemon, with its own replica and loop thread.

Gossip, state transfer and the reachability check each serve one raw hivemind binary stream per
request. :class:`StreamService` is what they share: it opens its own P2P replica of the daemon (or
takes one from a factory) on its own :class:`~swarm.p2p.LoopThread`, registers the handler, runs the
swarm key handshake before the subclass reads anything, logs what a peer did wrong uniformly, closes
the stream, and shuts everything down once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ClassVar, Self

from swarm._protocol import protocol_id
from swarm.p2p._auth import AuthError, StreamKey, authenticate_stream, swarm_key_of
from swarm.p2p._forward import RELAYED_SUFFIX, read_preamble, send_ready
from swarm.p2p._framing import ProtocolError
from swarm.p2p._loop import LoopThread
from swarm.p2p._relay import RELAYED, is_trusted_relay
from swarm.p2p._setup import check_run_id, daemon_maddr, replicate

if TYPE_CHECKING:
    from hivemind.dht import DHT
    from hivemind.p2p import P2P

logger = logging.getLogger(__name__)

PEER_FAULTS = (ProtocolError, AuthError, ConnectionError, OSError, TimeoutError, asyncio.IncompleteReadError)
"""What a peer can make a stream fail with (broken protocol or handshake, a dropped connection, a
stall): expected, logged briefly, never with a traceback. Anything else is a bug on our side."""

P2PFactory = Callable[[], Awaitable["P2P"]]
"""An async callable returning a ``hivemind.p2p.P2P`` dedicated to one service (e.g. ``P2P.create``)."""


class StreamService:
    """Serves one handler on our own P2P replica; subclasses implement :meth:`_handle`.

    Exactly one of ``dht`` (a running ``hivemind.DHT``: we open our own client to its daemon) or
    ``p2p_factory`` must be given. In a private swarm (``swarm_key``, by default the key ``dht`` was
    started with) every stream starts with the swarm key handshake (:mod:`swarm.p2p._auth`), bounded by
    ``auth_timeout_s``; a peer that fails it never reaches :meth:`_handle`. With ``client_mode`` no
    handler is registered: the service only dials out, and needs neither ``handler`` nor
    ``auth_timeout_s``.

    Construction is two-phase: ``__init__`` checks and records the arguments, and :meth:`_start` opens
    the replica and registers the handler. Serving begins there, so a subclass calls it last, once
    everything its handler touches exists. :meth:`close` is idempotent; the service is a context manager.
    """

    what: ClassVar[str] = "stream"
    """What one stream is, for log lines ("refused state request from ...")."""
    serves_relayed: ClassVar[bool] = True
    """Also serve streams a relay forwards (``handler`` + ``.relayed``, swarm/p2p/_forward.py)."""
    protocol: ClassVar[str] = ""
    """The service's name in its handler's protocol id (``swarm._protocol.protocol_id``), used when no
    ``handler`` is given: ``state`` serves ``swarm.state.v<P>.<run_id>``."""
    io_timeout_s: ClassVar[float | None] = None
    """The swarm key handshake's timeout when no ``auth_timeout_s`` is given."""
    open_timeout_s: ClassVar[float | None] = 60.0
    close_timeout_s: ClassVar[float] = 30.0

    def __init__(
        self,
        run_id: str,
        handler: str | None = None,
        *,
        dht: DHT | None,
        p2p_factory: P2PFactory | None,
        swarm_key: StreamKey | None,
        auth_timeout_s: float | None = None,
        client_mode: bool = False,
    ) -> None:
        check_run_id(run_id)
        handler = handler or (protocol_id(self.protocol, run_id) if self.protocol else None)
        auth_timeout_s = self.io_timeout_s if auth_timeout_s is None else auth_timeout_s
        if (dht is None) == (p2p_factory is None):
            raise ValueError("give exactly one of dht= or p2p_factory=")
        if not client_mode and (handler is None or auth_timeout_s is None):
            raise ValueError("a service that serves needs its handler and auth_timeout_s=")
        self.client_mode = client_mode
        self._handler = handler or ""  # "" only in client mode, where nothing is registered or served
        self._swarm_key = swarm_key if swarm_key is not None else swarm_key_of(dht)
        self._auth_timeout = auth_timeout_s or 0.0
        self._dht, self._p2p_factory = dht, p2p_factory
        self._active = 0  # streams being served now; only touched on the loop thread
        self._closed = False

    def _start(self, thread_name: str) -> None:
        """Open our replica on a new loop thread named ``thread_name`` and start serving."""
        maddr = daemon_maddr(self._dht) if self._dht is not None else None
        self._loop = LoopThread(name=thread_name)
        try:
            self._p2p: P2P = self._loop.run(self._open_replica(maddr), timeout=self.open_timeout_s)
        except BaseException:
            self._loop.stop()
            raise

    async def _open_replica(self, maddr: Any) -> P2P:
        p2p = await replicate(maddr) if self._p2p_factory is None else await self._p2p_factory()
        self.peer_id: str = p2p.peer_id.to_base58()  # before serving: the handshake names both peers
        try:
            if not self.client_mode:
                await p2p.add_binary_stream_handler(self._handler, self._serve)
                if self.serves_relayed:
                    await p2p.add_binary_stream_handler(self._handler + RELAYED_SUFFIX, self._serve_relayed)
        except BaseException:
            await p2p.shutdown()
            raise
        return p2p

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._serve_peer(info.peer_id.to_base58(), reader, writer)

    async def _serve_relayed(
        self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A stream a relay forwards (:mod:`swarm.p2p._forward`): believe its preamble only from a relay
        we trust, then serve it as the dialler's own."""
        relay = info.peer_id.to_base58()
        try:
            if not is_trusted_relay(relay):
                raise AuthError(f"peer {relay} forwarded a stream, and it is not one of our relays")
            peer = await read_preamble(reader, max(self._auth_timeout, 10.0))
            await send_ready(writer, max(self._auth_timeout, 10.0))
        except PEER_FAULTS as exc:  # AuthError among them
            logger.warning("refused forwarded %s from relay %s: %s", self.what, relay, exc)
            writer.close()
            return
        RELAYED.meter(reader, writer)
        await self._serve_peer(peer, reader, writer)

    async def _serve_peer(
        self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._active += 1
        try:
            if self._swarm_key is not None:
                await authenticate_stream(
                    reader,
                    writer,
                    key=self._swarm_key,
                    initiator=False,
                    protocol=self._handler,
                    local_peer=self.peer_id,
                    remote_peer=peer,
                    timeout=self._auth_timeout,
                )
            await self._handle(peer, reader, writer)
        except AuthError as exc:
            logger.warning("refused %s from %s: %s", self.what, peer, exc)
        except PEER_FAULTS as exc:
            logger.info("%s from %s failed: %s: %s", self.what, peer, type(exc).__name__, exc)
        except Exception:
            logger.exception("%s from %s failed unexpectedly", self.what, peer)
        finally:
            self._active -= 1
            writer.close()

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one stream from ``peer`` (authenticated already); the base class closes it afterwards."""
        raise NotImplementedError

    def _stop_work(self) -> None:
        """Called once by :meth:`close` before the replica shuts down: stop what the subclass runs."""

    def close(self) -> None:
        """Stop serving, shut our replica down and stop the loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_work()
        with contextlib.suppress(Exception):
            self._loop.run(self._close_replica(), timeout=self.close_timeout_s)
        self._loop.stop()

    async def _close_replica(self) -> None:
        if not self.client_mode:
            relayed = [self._handler + RELAYED_SUFFIX] if self.serves_relayed else []
            for handler in (self._handler, *relayed):
                with contextlib.suppress(Exception):
                    await self._p2p.remove_binary_stream_handler(handler)
        await self._p2p.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
