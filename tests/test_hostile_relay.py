"""The relay is metered (issue #28, finding 8): slots counted with the check, and per-stream caps.

The relay runs in-process on a fake daemon: each forwarded stream's two ends are in-memory pipes, and
the fake daemon's ``list_peers`` yields to the loop, which is where the old relay checked its limits
before it counted them.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Coroutine, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.p2p import PeerID

from swarm.p2p import RelayForwarder, RelayLimits
from swarm.p2p import _forwarder as forwarder_module
from swarm.p2p._forward import ForwardKind, read_control, send_control

RUN = "hostile-relay"
TARGET = PeerID(secrets.token_bytes(34))
HANDLER = "swarm.test.echo"


def _peer() -> str:
    return PeerID(secrets.token_bytes(34)).to_base58()


class Pipe:
    """A writer whose bytes come out of ``reader``; closing it ends the reader."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()
        self.closed = False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()


class FakeDaemon:
    """Enough of hivemind's P2P for the relay: one connected target whose service the test plays."""

    def __init__(self) -> None:
        self.peer_id = PeerID(secrets.token_bytes(34))
        self.opened: list[tuple[Pipe, Pipe]] = []  # (relay -> target, target -> relay) per stream

    async def add_binary_stream_handler(self, *args: Any) -> None:
        pass

    async def remove_binary_stream_handler(self, *args: Any) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def list_peers(self) -> list[Any]:
        await asyncio.sleep(0)
        return [SimpleNamespace(peer_id=TARGET)]

    async def call_binary_stream_handler(self, peer: PeerID, handler: str) -> tuple[Any, Any, Any]:
        to_target, from_target = Pipe(), Pipe()
        self.opened.append((to_target, from_target))
        return None, from_target.reader, to_target


@pytest.fixture
def daemon() -> FakeDaemon:
    return FakeDaemon()


def _relay(daemon: FakeDaemon, limits: RelayLimits | None = None) -> RelayForwarder:
    async def factory() -> FakeDaemon:
        return daemon

    kwargs = {} if limits is None else {"limits": limits}
    return RelayForwarder(RUN, p2p_factory=factory, swarm_key=None, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def relay_of(daemon: FakeDaemon) -> Iterator[Any]:
    made: list[RelayForwarder] = []

    def make(limits: RelayLimits | None = None) -> RelayForwarder:
        made.append(_relay(daemon, limits))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


async def _until(condition: Any, what: str, deadline_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not condition():
        assert loop.time() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


class Dialler:
    """One forwarded stream as the dialler sees it: ``to_relay`` goes to the relay, ``back`` comes back
    (served as the relay serves any stream, which closes it at the end)."""

    def __init__(self, relay: RelayForwarder, peer: str) -> None:
        self.to_relay, self.back = Pipe(), Pipe()
        self.task = asyncio.ensure_future(relay._serve_peer(peer, self.to_relay.reader, self.back))  # type: ignore[arg-type]

    async def ask(self) -> None:
        await send_control(
            self.to_relay, ForwardKind.FORWARD, {"to": TARGET.to_base58(), "handler": HANDLER}, 5
        )  # type: ignore[arg-type]

    @classmethod
    async def forwarded(cls, relay: RelayForwarder, peer: str, daemon: FakeDaemon) -> Dialler:
        """A dialler that asked for the forward, once the relay opened it to the target."""
        dialler = cls(relay, peer)
        await dialler.ask()
        await _until(lambda: daemon.opened, "the forward")
        return dialler


def _on_loop(relay: RelayForwarder, coro: Coroutine[Any, Any, Any]) -> Any:
    return relay._loop.run(coro, timeout=60)


def test_a_hundred_concurrent_forwards_from_one_dialler_get_at_most_its_share(daemon, relay_of) -> None:
    relay = relay_of()
    peer = _peer()

    async def scenario() -> tuple[int, list[str]]:
        diallers = [Dialler(relay, peer) for _ in range(100)]
        await asyncio.gather(*(d.ask() for d in diallers))
        await _until(lambda: len(daemon.opened) + sum(d.task.done() for d in diallers) >= 100, "answers")
        refusals = []
        for d in diallers:
            if d.task.done():
                kind, body = await read_control(d.back.reader, 5)
                assert kind is ForwardKind.REFUSED
                refusals.append(body["reason"])
        forwarded = len(daemon.opened)
        for d in diallers:
            d.to_relay.close()
        for _, from_target in daemon.opened:
            from_target.close()
        await asyncio.wait_for(asyncio.gather(*(d.task for d in diallers), return_exceptions=True), 30)
        return forwarded, refusals

    forwarded, refusals = _on_loop(relay, scenario())
    assert forwarded == forwarder_module.MAX_PER_DIALLER
    assert len(refusals) == 100 - forwarded
    assert all("for you already" in r for r in refusals)
    assert not relay._per_dialler and relay._forwarding == 0, "every slot is given back"


def test_a_stream_past_the_byte_cap_is_closed(daemon, relay_of) -> None:
    relay = relay_of(RelayLimits(stream_bytes=100_000))

    async def scenario() -> int:
        d = await Dialler.forwarded(relay, _peer(), daemon)
        to_target, _ = daemon.opened[0]
        for _ in range(50):
            if d.task.done():
                break
            d.to_relay.write(secrets.token_bytes(10_000))
            await asyncio.sleep(0)
        await asyncio.wait_for(d.task, 20)
        assert to_target.closed and d.back.closed
        return len(to_target.reader._buffer)  # type: ignore[attr-defined]

    carried = _on_loop(relay, scenario())
    assert carried <= 100_000 + 10_000 + 1024, f"the relay passed on {carried} bytes"


def test_a_busy_stream_is_closed_at_its_lifetime(daemon, relay_of) -> None:
    relay = relay_of(RelayLimits(stream_lifetime_s=0.5))

    async def scenario() -> None:
        d = await Dialler.forwarded(relay, _peer(), daemon)
        while not d.task.done():  # never idle: only the lifetime ends it
            d.to_relay.write(b"x")
            await asyncio.sleep(0.01)
        await d.task
        assert daemon.opened[0][0].closed and d.back.closed

    _on_loop(relay, scenario())


def test_a_dialler_past_its_byte_budget_is_cut_off_and_refused_until_the_window_ends(
    daemon, relay_of
) -> None:
    relay = relay_of(RelayLimits(dialler_bytes=50_000, dialler_window_s=3600))
    peer, other = _peer(), _peer()

    async def scenario() -> tuple[str, int]:
        d = await Dialler.forwarded(relay, peer, daemon)
        while not d.task.done():
            d.to_relay.write(secrets.token_bytes(10_000))
            await asyncio.sleep(0)
        again = Dialler(relay, peer)
        await again.ask()
        await asyncio.wait_for(again.task, 20)
        kind, body = await read_control(again.back.reader, 5)
        assert kind is ForwardKind.REFUSED
        fresh = Dialler(relay, other)
        await fresh.ask()
        await _until(lambda: len(daemon.opened) == 2, "another dialler's forward")
        fresh.to_relay.close()
        await asyncio.wait_for(fresh.task, 20)
        return body["reason"], len(daemon.opened)

    reason, opened = _on_loop(relay, scenario())
    assert "you moved 50000 bytes" in reason
    assert opened == 2


def test_the_rate_cap_slows_a_stream_to_its_rate() -> None:
    limits = RelayLimits(stream_rate=1000.0)
    meter = forwarder_module.StreamMeter("a", forwarder_module._Budgets(limits), now=100.0)
    assert meter.take(500, now=100.0) == pytest.approx(0.5)
    assert meter.take(500, now=101.5) == 0.0  # already slower than the cap
    assert meter.take(3000, now=101.5) == pytest.approx(2.5)


@pytest.mark.parametrize("name", ["max_forwards", "stream_bytes", "stream_rate", "stream_lifetime_s"])
def test_limits_that_allow_nothing_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        RelayLimits(**{name: 0})


def test_a_full_relay_gives_a_quiet_streams_slot_to_a_new_dialler(daemon, relay_of) -> None:
    """Throwaway ids that fill every slot and then move nothing do not keep the relay from others."""
    relay = relay_of(RelayLimits(max_forwards=4, max_per_dialler=1, evict_quiet_s=0.2))

    async def scenario() -> tuple[list[str], int]:
        sybils = [Dialler(relay, _peer()) for _ in range(4)]
        await asyncio.gather(*(d.ask() for d in sybils))
        await _until(lambda: len(daemon.opened) == 4, "the sybils' four forwards")
        honest_id, reasons = _peer(), []
        while len(daemon.opened) == 4:  # asked again until a quiet slot is given up, within the deadline
            honest = Dialler(relay, honest_id)
            await honest.ask()
            await _until(lambda d=honest: d.task.done() or len(daemon.opened) > 4, "an answer")
            if honest.task.done():
                kind, body = await read_control(honest.back.reader, 5)
                assert kind is ForwardKind.REFUSED
                reasons.append(body["reason"])
                assert len(reasons) < 1000, "the full relay never gave up a quiet slot"
        await _until(lambda: sum(d.task.done() for d in sybils) == 1, "the evicted sybil's stream closing")
        forwarding = relay._forwarding
        for d in [*sybils, honest]:
            d.to_relay.close()
        for _, from_target in daemon.opened:
            from_target.close()
        await asyncio.wait_for(
            asyncio.gather(*(d.task for d in [*sybils, honest]), return_exceptions=True), 30
        )
        return reasons, forwarding

    reasons, forwarding = _on_loop(relay, scenario())
    assert all("streams already" in r for r in reasons)
    assert forwarding == 4, "the evicted slot was handed over, not added"
    assert not relay._per_dialler and relay._forwarding == 0, "every slot is given back"
