"""What the hivemind-based baselines share: codecs, matchmaking times, wire byte counters and an averager
that keeps them.

hivemind counts no bytes, so an averager process (a forked ``mp.Process``) counts them itself: every
length-prefixed protobuf message its P2P streams send or receive (all-reduce parts, matchmaking,
state downloads), libp2p's own framing and encryption excluded. See :class:`WireCounters`.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import Any

from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.compression import (
    BlockwiseQuantization,
    CompressionBase,
    Float16Compression,
    NoCompression,
)
from hivemind.p2p import P2P

MATCHMAKING_TIME_S = 3.0
"""How long peers gather for an all-reduce: hivemind's advice for small local runs is 3-5 s."""
REQUEST_TIMEOUT_S = 2.0
"""Matchmaking requests must time out before the matchmaking time (hivemind warns otherwise)."""

HIVEMIND_CODECS: dict[str, type[CompressionBase]] = {
    "fp32": NoCompression,
    "fp16": Float16Compression,
    "bf16": Float16Compression,  # hivemind has no bf16 codec; fp16 is the same size
    "int8": BlockwiseQuantization,  # bitsandbytes' dynamic 8-bit, blocks of 4096
}


def hivemind_codec(name: str) -> CompressionBase:
    """hivemind's counterpart of one of our codec names."""
    if name not in HIVEMIND_CODECS:
        raise ValueError(
            f"compression.codec {name!r} has no hivemind counterpart; use one of {sorted(HIVEMIND_CODECS)}"
        )
    return HIVEMIND_CODECS[name]()


class WireCounters:
    """Bytes sent and received, all-reduce rounds and their group sizes, shared with forked processes."""

    SENT, RECEIVED, ROUNDS, PEERS = range(4)

    def __init__(self) -> None:
        self._values = [mp.Value(ctypes.c_int64, 0) for _ in range(4)]

    def add(self, index: int, amount: int) -> None:
        with self._values[index].get_lock():
            self._values[index].value += amount

    def snapshot(self) -> tuple[int, int, int, int]:
        sent, received, rounds, peers = (v.value for v in self._values)
        return sent, received, rounds, peers


def count_stream_bytes(wire: WireCounters) -> None:
    """In this process, count every message P2P streams send or receive (payload and length prefix).

    Only ever called inside an averager's own process, so nothing else there is counted.
    """
    send, receive = P2P.send_raw_data, P2P.receive_raw_data

    async def counted_send(data: bytes, writer, *, chunk_size: int = 2**16) -> None:
        wire.add(WireCounters.SENT, len(data) + P2P.HEADER_LEN)
        await send(data, writer, chunk_size=chunk_size)

    async def counted_receive(reader) -> bytes:
        data = await receive(reader)
        wire.add(WireCounters.RECEIVED, len(data) + P2P.HEADER_LEN)
        return data

    P2P.send_raw_data = staticmethod(counted_send)
    P2P.receive_raw_data = staticmethod(counted_receive)


class CountingAverager(DecentralizedAverager):
    """A hivemind averager that counts its wire bytes (in its own process) and each all-reduce round it
    completes, with its group size, in ``_wire``; a subclass sets ``_wire`` before calling ``__init__``
    (which may start the averager process)."""

    _wire: WireCounters

    def run(self) -> None:
        count_stream_bytes(self._wire)
        super().run()

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        self._wire.add(WireCounters.ROUNDS, 1)
        self._wire.add(WireCounters.PEERS, len(group_info.peer_ids))
        return gathered
