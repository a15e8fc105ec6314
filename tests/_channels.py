"""An in-memory stream between two gossip channels, for tests that run the data phase without p2p."""

from __future__ import annotations

import asyncio
import socket

from swarm.gossip._protocol import Channel


async def channel_pair(max_data: int = 1 << 20, chunk_timeout_s: float = 5.0) -> tuple[Channel, Channel]:
    """Two connected :class:`Channel` ends over a socket pair (call on a running loop)."""
    left, right = socket.socketpair()
    ends = [await asyncio.open_connection(sock=sock) for sock in (left, right)]
    a, b = (Channel(*end, chunk_timeout_s=chunk_timeout_s, max_data_bytes=max_data) for end in ends)
    return a, b
