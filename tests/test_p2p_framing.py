"""swarm.p2p framing: a timeout bounds progress, not a message's size (slow links vs stalled peers)."""

from __future__ import annotations

import asyncio
import enum
import socket

import pytest

from swarm.p2p import StalledError, read_message, write_message
from swarm.p2p._framing import HEADER_LEN, PROGRESS_BYTES

TIMEOUT_S = 0.5
PACE_S = 0.05
"""Pieces arrive this often: a steady link, slower in total than one timeout."""


class Kind(enum.IntEnum):
    DATA = 1


def _message(payload: bytes) -> bytes:
    return bytes([Kind.DATA]) + len(payload).to_bytes(4, "big") + payload


def _payload() -> bytes:
    # 16 pieces at PACE_S each: the whole message takes longer than TIMEOUT_S
    return bytes(range(256)) * (16 * PROGRESS_BYTES // 256)


async def _feed(reader: asyncio.StreamReader, data: bytes, *, stop_after: int | None = None) -> None:
    """Hand ``data`` to ``reader`` piece by piece, as a slow link would (optionally stalling for good)."""
    for n, start in enumerate(range(0, len(data), PROGRESS_BYTES)):
        if stop_after is not None and n == stop_after:
            return
        reader.feed_data(data[start : start + PROGRESS_BYTES])
        await asyncio.sleep(PACE_S)
    reader.feed_eof()


def test_a_large_message_over_a_slow_steady_link_arrives_whole() -> None:
    async def run() -> tuple[Kind, bytes, float]:
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        started = loop.time()
        feeding = asyncio.ensure_future(_feed(reader, _message(_payload())))
        kind, payload = await read_message(reader, Kind, lambda _: 1 << 24, TIMEOUT_S)
        await feeding
        return kind, payload, loop.time() - started

    kind, payload, took = asyncio.run(run())
    assert kind is Kind.DATA and payload == _payload()
    assert took > TIMEOUT_S  # the condition under test: one message outlasted one timeout


def test_a_sender_that_stalls_mid_message_is_dropped() -> None:
    async def run() -> None:
        reader = asyncio.StreamReader()
        feeding = asyncio.ensure_future(_feed(reader, _message(_payload()), stop_after=3))
        try:
            await read_message(reader, Kind, lambda _: 1 << 24, TIMEOUT_S)
        finally:
            await feeding

    with pytest.raises(StalledError, match=r"nothing received for 0\.5 s"):
        asyncio.run(run())


async def _socket_pair() -> tuple[asyncio.StreamWriter, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    _, writer = await asyncio.open_connection(sock=ours)
    return writer, theirs


async def _read_slowly(sock: socket.socket, total: int) -> int:
    loop = asyncio.get_running_loop()
    got = 0
    while got < total:
        got += len(await loop.sock_recv(sock, PROGRESS_BYTES))
        await asyncio.sleep(PACE_S / 4)
    return got


def test_writing_to_a_slow_reader_completes_and_to_a_stalled_one_fails() -> None:
    big = bytes(8 * 1024 * 1024)  # far beyond the socket buffers: the writer must wait for the reader

    async def slow() -> tuple[int, int, float]:
        writer, theirs = await _socket_pair()
        loop = asyncio.get_running_loop()
        started = loop.time()
        reading = asyncio.ensure_future(_read_slowly(theirs, HEADER_LEN + len(big)))
        sent = await write_message(writer, Kind.DATA, big, TIMEOUT_S)
        got = await reading
        writer.close()
        theirs.close()
        return sent, got, loop.time() - started

    sent, got, took = asyncio.run(slow())
    assert sent == got == HEADER_LEN + len(big)
    assert took > TIMEOUT_S

    async def stalled() -> None:
        writer, theirs = await _socket_pair()
        try:
            await write_message(writer, Kind.DATA, big, TIMEOUT_S)  # nobody reads
        finally:
            writer.close()
            theirs.close()

    with pytest.raises(StalledError, match="nothing sent"):
        asyncio.run(stalled())


def test_a_cancellation_that_arrives_as_the_data_does_is_not_swallowed() -> None:
    """Aborting an exchange cancels its task; the read must end with CancelledError even when its data
    arrived in the same instant (Python 3.11's ``wait_for`` would return the data and swallow the
    cancellation, and the aborted exchange would run on)."""

    async def scenario() -> None:
        reader = asyncio.StreamReader()
        task = asyncio.ensure_future(read_message(reader, Kind, lambda _: 1 << 20, timeout=10.0))
        await asyncio.sleep(0)  # the read is now waiting for the header
        reader.feed_data(_message(b"late"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
