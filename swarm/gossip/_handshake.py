"""The HELLO / ACCEPT handshake of an exchange: what each side states, and the initiator's proposal.

Before any tensor data moves, the initiator dials the partner (in a private swarm the swarm key
handshake runs first, see :func:`swarm.p2p.dial`) and sends HELLO; the partner answers ACCEPT with
its own HELLO, BUSY, or REJECT with a reason. Both sides check that the other's HELLO describes the
same exchange (:meth:`Hello.mismatch`): protocol version, run, config, tensor schema and codec.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from swarm.gossip._options import GossipOptions
from swarm.gossip._protocol import (
    PROTOCOL_VERSION,
    Channel,
    Hello,
    MsgKind,
    ProtocolError,
    parse_json,
)
from swarm.p2p import StreamKey, dial

if TYPE_CHECKING:
    from hivemind.p2p import P2P

BANNED_REASON = "you are temporarily banned"
"""The REJECT reason of a peer that banned us: no evidence against it (see the reputation rules)."""


@dataclass(frozen=True)
class Reply:
    """A partner's answer to our HELLO: ``kind`` ACCEPT (with the open ``channel`` and the partner's
    own ``hello``), BUSY or REJECT (with its ``reason``), or None when the dial or the handshake itself
    failed (``reason`` says how)."""

    kind: MsgKind | None
    reason: str = ""
    channel: Channel | None = None
    hello: Hello | None = None

    def describe(self) -> str:
        return self.kind.name if self.kind is not None else self.reason


class Handshake:
    """One averager's side of the handshake: its HELLO, its channels, and proposals to partners."""

    def __init__(
        self, run_id: str, config_hash: str, handler: str, swarm_key: StreamKey | None, options: GossipOptions
    ) -> None:
        self._run_id, self._config_hash = run_id, config_hash
        self._handler, self._swarm_key = handler, swarm_key
        self._codec, self._block_size = options.codec, options.block_size
        self._timeout, self._max_data_bytes = options.chunk_timeout_s, options.max_data_bytes

    def hello(
        self,
        schema_hash: str,
        weight: float,
        probe: tuple[float, ...] = (),
        *,
        base: str = "",
        push: bool = False,
    ) -> Hello:
        """What we state about the tensors we are about to exchange (HELLO, or ACCEPT's body);
        ``base``: the shared base we propose (or take); ``push``: a base push instead of an exchange."""
        return Hello(
            version=PROTOCOL_VERSION,
            run_id=self._run_id,
            config_hash=self._config_hash,
            schema_hash=schema_hash,
            codec=self._codec,
            block_size=self._block_size,
            weight=weight,
            probe=probe,
            base=base,
            push=push,
        )

    def channel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Channel:
        """The framed, byte-counted view of one exchange's stream (either role)."""
        return Channel(reader, writer, chunk_timeout_s=self._timeout, max_data_bytes=self._max_data_bytes)

    async def propose(self, p2p: P2P, partner: str, ours: Hello, channels: list[Channel]) -> Reply:
        """Dial ``partner`` and send HELLO ``ours``; return its answer. Never raises but for cancellation.

        The channel of an accepted proposal stays open for the exchange; every channel opened is
        appended to ``channels`` (the caller closes them and counts their bytes).
        """
        try:
            async with asyncio.timeout(self._timeout):
                reader, writer = await dial(p2p, partner, self._handler, self._swarm_key, self._timeout)
                channel = self.channel(reader, writer)
                channels.append(channel)
                await channel.send_json(MsgKind.HELLO, ours.to_json())
                kind, payload = await channel.recv_expect(MsgKind.ACCEPT, MsgKind.BUSY, MsgKind.REJECT)
                body = parse_json(payload)
                if kind is MsgKind.ACCEPT:
                    return Reply(kind, channel=channel, hello=_accepted(ours, body))
        except Exception as exc:
            return Reply(None, f"{type(exc).__name__}: {exc}")
        channel.close()
        return Reply(kind, str(body.get("reason")))


def _accepted(ours: Hello, body: dict[str, Any]) -> Hello:
    """The partner's HELLO from its ACCEPT; ProtocolError if it describes another exchange."""
    theirs = Hello.from_json(body)
    mismatch = ours.mismatch(theirs)
    if mismatch is not None:
        raise ProtocolError(f"accepted with an incompatible handshake: {mismatch}")
    return theirs
