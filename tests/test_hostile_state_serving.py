"""Hostile readers of a donor's published states (issue 41, finding N6), in process.

A published state is a full copy on disk (an unnamed spool file that ``ls`` and ``du`` do not show),
so readers that pin old states across publications must not multiply it: a real
:class:`StateServer`'s handler is fed requests from several reader ids whose streams stall, while
the donor publishes again and again. The open spool files are counted in ``/proc/self/fd`` (not only
through the server's own accounting). Also: a stream that holds a replaced state past its pin
lifetime is cut.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

import swarm.state._server as server_module
from swarm.state import MAX_STATES, ServedState, StateServer, spool_state
from swarm.state._transfer_protocol import Kind, handler_name
from tests.workers.fuzz import FakeP2P, FakeWriter, jmsg, parse_messages, peer_id
from tests.workers.state_transfer import make_state

RUN = "hostile-serving"
CHUNK = 16384


class StalledReader(FakeWriter):
    """A reader that takes what is written and then reads nothing more until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def drain(self) -> None:
        await self.release.wait()
        await super().drain()


def open_spools(directory: Path) -> tuple[int, int]:
    """Files under ``directory`` this process holds open (the spools: unlinked), and their bytes."""
    count = size = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith(f"{directory}/"):
                size += os.stat(f"/proc/self/fd/{name}").st_size
                count += 1
        except OSError:  # closed meanwhile (listdir's own fd among them)
            continue
    return count, size


def spooled(seed: int, directory: Path) -> ServedState:
    tensors, meta = make_state(seed, step=10 * seed)
    return spool_state(tensors, meta, CHUNK, spool_dir=str(directory))


def stream(fake: FakeP2P, reader: str, digest: str, writer: FakeWriter) -> asyncio.Task[None]:
    """A stream from ``reader`` asking for the whole state ``digest``, served by the real handler."""
    request = asyncio.StreamReader()
    request.feed_data(jmsg(Kind.REQUEST, {"digest": digest, "part": 0, "parts": 1, "skip": 0}))
    info = SimpleNamespace(peer_id=peer_id(reader))
    return asyncio.create_task(fake.handlers[handler_name(RUN)](info, request, writer))


async def until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_stalled_readers_across_publications_never_pin_more_than_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four reader ids each open a part of every new state and stop reading, across eight
    publications: before the fix every stream pinned its own copy (9 open spools, all 8 slots
    taken). Now at most MAX_STATES spools stay open (and one more only until the cut streams of the
    evicted state have unwound), whatever the readers do."""
    monkeypatch.setattr(server_module, "IO_TIMEOUT_S", 600.0)  # stalls stay stalls on a loaded machine
    fake = FakeP2P("donor")
    server = StateServer(run_id=RUN, p2p_factory=fake.factory, spool_dir=str(tmp_path))
    publications, readers = 8, [f"reader-{i}" for i in range(4)]
    one_copy = 0
    most_seen = 0

    async def scenario() -> None:
        nonlocal one_copy, most_seen
        held: list[tuple[asyncio.Task[None], StalledReader]] = []
        try:
            for index in range(publications):
                state = spooled(index + 1, tmp_path)
                one_copy = max(one_copy, state.nbytes)
                server.publish(state)
                most_seen = max(most_seen, open_spools(tmp_path)[0])
                writer = StalledReader()
                held.append((stream(fake, readers[index % len(readers)], state.digest, writer), writer))
                await until(lambda w=writer: bool(w.data), f"stream {index} pinned its state")
                await until(lambda: open_spools(tmp_path)[0] <= MAX_STATES, "cut streams to unwind")
                assert server.spooled()[0] <= MAX_STATES
            count, size = open_spools(tmp_path)
            assert count == MAX_STATES and size <= MAX_STATES * one_copy
            assert server.spooled() == (count, size)
            live = [task for task, _ in held if not task.done()]
            assert len(live) == MAX_STATES  # the streams of the two open states; the rest were cut
            assert server.stats().cut == publications - MAX_STATES
            for _, writer in held:
                writer.release.set()
            await asyncio.gather(*(task for task, _ in held))
            served = [parse_messages(bytes(w.data)) for _, w in held[-MAX_STATES:]]
            assert all(kinds[-1][0] == Kind.FRAME and len(kinds) > 2 for kinds in served)
        finally:
            for task, writer in held:
                writer.release.set()
                task.cancel()
            await asyncio.gather(*(task for task, _ in held), return_exceptions=True)

    try:
        asyncio.run(scenario())
        assert most_seen <= MAX_STATES + 1
    finally:
        server.close()
    assert open_spools(tmp_path) == (0, 0)


def test_a_reader_that_holds_a_replaced_state_past_its_pin_lifetime_is_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream on a replaced state is closed once the state has been replaced for the pin lifetime
    ("snapshot too old"); the spool is then closed and the donor may publish again. A stream on the
    state served now has no such end."""
    monkeypatch.setattr(server_module, "IO_TIMEOUT_S", 600.0)
    fake = FakeP2P("donor")
    server = StateServer(
        run_id=RUN, p2p_factory=fake.factory, spool_dir=str(tmp_path), keep_replaced_s=0, pin_lifetime_s=0.5
    )
    old, new = spooled(1, tmp_path), spooled(2, tmp_path)

    async def scenario() -> None:
        on_old, on_new = StalledReader(), StalledReader()
        server.publish(old)
        holding_old = stream(fake, "holder", old.digest, on_old)
        await until(lambda: bool(on_old.data), "the old state pinned")
        server.publish(new)
        holding_new = stream(fake, "reader", new.digest, on_new)
        await until(lambda: bool(on_new.data), "the new state pinned")
        assert not server.can_publish()  # the old one is still read
        await until(holding_old.done, "the stream on the replaced state cut at its pin lifetime")
        assert on_old.closed and old.closed and server.stats().cut == 1
        assert server.can_publish() and server.spooled()[0] == 1
        assert not holding_new.done()
        on_new.release.set()
        await holding_new
        assert parse_messages(bytes(on_new.data))[-1][0] == Kind.FRAME and server.stats().parts_served == 1

    try:
        asyncio.run(scenario())
    finally:
        server.close()
    assert new.closed and open_spools(tmp_path) == (0, 0)
