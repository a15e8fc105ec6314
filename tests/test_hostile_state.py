"""Hostile donors and readers of state transfer (issue 28, findings 2 and 7), in process.

Real :class:`StateServer` handlers serve real snapshots to the real downloader (``fetch_state``) over
in-memory streams (``MemorySwarm``): what is faked is only the transport. Covered: two Sybil donors
announcing one digest, one or two donors (never copied), a trusted initial peer (taken as is, or
passed over when it fails), hostile progress counters (the median, never the maximum), per-peer
stream caps and the progress floor of the server, checkpoint names of huge steps, the bootstrap's
mirror (same robust path, never saves poison, never frozen by an inflated copy), and slow donors
(issue 41: the receive floor on bytes over windows, the chunk cap, endgame, the median's quorum,
stage deadlines; a silent trainer does not freeze the mirror).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import swarm.state._server as server_module
import swarm.state._transfer_protocol as protocol_module
from swarm.membership import Member, PeerRecord
from swarm.state import (
    MAX_PROGRESS,
    ServedState,
    StateMirror,
    StateServer,
    StateSnapshot,
    StateTransferError,
    download_state,
    fetch_state,
    list_checkpoints,
    make_snapshot,
    progress_of,
    read_checkpoint,
    save_checkpoint,
    spool_state,
)
from swarm.state._merge import merge_meta
from swarm.state._schedule import START_WINDOWS, Budget, Scheduler
from swarm.state._transfer_protocol import MAX_RECV_CHUNK_BYTES, FloorSpec, Kind, handler_name
from tests._faults import faulty_snapshot
from tests.test_bootstrap_status import mirror_node
from tests.workers.fuzz import FakeP2P, FakeWriter, jmsg, parse_messages, peer_id
from tests.workers.state_transfer import flip_byte, make_state

RUN = "hostile-state"
CHUNK = 16384
HONEST_SAMPLES = (320, 352, 384)


# ---------------------------------------------------------------------------- in-memory swarm


class PipeWriter:
    """The writing half of an in-memory stream: what is written is fed to the other side's reader.
    With ``trickle = (size, seconds)`` what is written reaches it ``size`` bytes every ``seconds``
    (a drain waits for all of it); ``sent`` counts the bytes that reached it."""

    def __init__(
        self, other: asyncio.StreamReader, delay: float = 0.0, trickle: tuple[int, float] | None = None
    ) -> None:
        self._other, self._delay, self._trickle = other, delay, trickle
        self._pending = bytearray()
        self.closed = False
        self.sent = 0

    def write(self, chunk: bytes | bytearray | memoryview) -> None:
        if self.closed:
            raise ConnectionResetError("write to a closed stream")
        if self._trickle is not None:
            self._pending += chunk
            return
        self._other.feed_data(bytes(chunk))
        self.sent += len(chunk)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("drain on a closed stream")
        if self._trickle is not None:
            size, seconds = self._trickle
            while self._pending and not self.closed:
                piece, self._pending = bytes(self._pending[:size]), self._pending[size:]
                self._other.feed_data(piece)
                self.sent += len(piece)
                await asyncio.sleep(seconds)
            return
        await asyncio.sleep(self._delay)  # how long the other side takes to read each piece

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._other.feed_eof()

    def is_closing(self) -> bool:
        return self.closed

    async def wait_closed(self) -> None:
        return None


class MemorySwarm:
    """The surface of ``hivemind.p2p.P2P`` a downloader dials through, joined in memory to the handlers
    of real StateServers (run on the downloader's loop). Records which donors were dialled; a donor
    in ``delays`` takes that many seconds to hand on each piece it sends (a slow link), one in
    ``trickles`` hands on ``size`` bytes every ``seconds`` (:class:`PipeWriter`); ``links`` holds the
    writer of each stream a donor answered on."""

    def __init__(self) -> None:
        self.peer_id = peer_id("joiner")
        self.donors: dict[str, FakeP2P] = {}
        self.servers: dict[str, StateServer] = {}
        self.delays: dict[str, float] = {}
        self.trickles: dict[str, tuple[int, float]] = {}
        self.links: dict[str, list[PipeWriter]] = {}
        self.dialled: list[str] = []
        self.serving: list[asyncio.Task[None]] = []
        self.after: list[Callable[[], None]] = []  # called when a download ended

    async def call_binary_stream_handler(self, peer: Any, name: str) -> tuple[Any, Any, PipeWriter]:
        donor = self.donors.get(peer.to_base58())
        if donor is None:
            raise ConnectionRefusedError(f"no donor {peer.to_base58()}")
        self.dialled.append(peer.to_base58())
        ours, theirs = asyncio.StreamReader(), asyncio.StreamReader()
        handler = donor.handlers[name]
        info = SimpleNamespace(peer_id=self.peer_id)
        label = peer.to_base58()
        slow = PipeWriter(ours, self.delays.get(label, 0.0), self.trickles.get(label))
        self.links.setdefault(label, []).append(slow)
        self.serving.append(asyncio.create_task(handler(info, theirs, slow)))
        return SimpleNamespace(peer_id=peer), ours, PipeWriter(theirs)

    def fetch(self, donors: list[tuple[str, str]], **options: Any) -> StateSnapshot:
        """``fetch_state`` over this swarm (blocking); the donors' handlers are ended before returning."""
        options = {"timeout_s": 30, **options}

        async def run() -> StateSnapshot:
            try:
                return await fetch_state(self, donors, run_id=RUN, **options)
            finally:
                for release in self.after:
                    release()
                for task in self.serving:
                    task.cancel()
                await asyncio.gather(*self.serving, return_exceptions=True)
                self.serving.clear()

        return asyncio.run(run())


@pytest.fixture
def swarm() -> Iterator[tuple[MemorySwarm, Callable[..., tuple[str, StateSnapshot]]]]:
    """A memory swarm and ``donor(label, tensors, meta, announce=None)``: a started StateServer that
    serves the snapshot of ``tensors`` and ``meta`` (or ``announce``, when it lies about what it
    serves); returns its peer id and the snapshot. Every server is closed at the end."""
    memory = MemorySwarm()
    servers: list[StateServer] = []

    def donor(
        label: str, tensors: dict, meta: dict, serve: StateSnapshot | ServedState | None = None
    ) -> tuple[str, StateSnapshot]:
        fake = FakeP2P(label)
        server = StateServer(run_id=RUN, p2p_factory=fake.factory)
        servers.append(server)
        snapshot = make_snapshot(tensors, meta, chunk_bytes=CHUNK)
        server.publish(serve or snapshot)
        memory.donors[server.peer_id] = fake
        memory.servers[server.peer_id] = server
        return server.peer_id, snapshot

    yield memory, donor
    for server in servers:
        server.close()


def frame_count(snapshot: StateSnapshot) -> int:
    with spool_state(snapshot.tensors, snapshot.meta, snapshot.chunk_bytes) as served:
        return served.frame_count


def honest_states() -> list[tuple[dict[str, torch.Tensor], dict[str, int]]]:
    """Three honest donors: one base state, each with its own small drift (in values bf16 holds: what
    each serves), and its own progress."""
    base, _ = make_state(1)
    states = []
    for i, samples in enumerate(HONEST_SAMPLES):
        generator = torch.Generator().manual_seed(100 + i)
        drift = {n: 0.01 * torch.randn(t.shape, generator=generator) for n, t in base.items()}
        drifted = {n: (t + drift[n]).bfloat16().float() for n, t in base.items()}  # as the donor serves it
        states.append((drifted, {"round": 3 + i, "step": 10 + i, "samples_total": samples}))
    return states


def poison() -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    base, _ = make_state(1)
    return {n: t + 1000.0 for n, t in base.items()}, {
        "round": 10**12,
        "step": 10**12,
        "samples_total": 10**15,
    }


def assert_within_honest(result: StateSnapshot, honest: list[dict[str, torch.Tensor]]) -> None:
    """Every coordinate between the smallest and the largest honest value of that coordinate."""
    for name in honest[0]:
        stacked = torch.stack([h[name] for h in honest])
        low, high = stacked.min(0).values, stacked.max(0).values
        assert bool(((result.tensors[name] >= low) & (result.tensors[name] <= high)).all()), name


# ---------------------------------------------------------------------------- which state a joiner takes


def test_two_sybil_donors_announcing_one_digest_do_not_replace_the_state(swarm) -> None:
    memory, donor = swarm
    honest = honest_states()[:2]
    bad = poison()
    donors = [donor(f"sybil-{i}", *bad) for i in range(2)] + [
        donor(f"honest-{i}", *s) for i, s in enumerate(honest)
    ]
    assert donors[0][1].digest == donors[1][1].digest  # the Sybils agree: one digest, two records
    result = memory.fetch([(peer, snap.digest) for peer, snap in donors])
    assert_within_honest(result, [t for t, _ in honest])
    assert result.meta["samples_total"] <= max(m["samples_total"] for _, m in honest)
    assert result.digest not in {snap.digest for _, snap in donors}  # a merged state, no donor's


@pytest.mark.parametrize("count", [1, 2])
def test_one_or_two_untrusted_donors_are_never_copied(swarm, count: int) -> None:
    memory, donor = swarm
    donors = [donor(f"donor-{i}", *s) for i, s in enumerate(honest_states()[:count])]
    announced = [(peer, snap.digest) for peer, snap in donors]
    with pytest.raises(
        StateTransferError, match=f"announce {count} distinct state.*needs 3 distinct donors or a trusted"
    ):
        memory.fetch(announced)
    assert memory.dialled == []  # nothing was even asked for
    with pytest.raises(StateTransferError, match="needs 3 distinct donors"):
        download_state(object(), announced, run_id=RUN)  # refused before any replica is opened


def test_a_trusted_initial_peer_is_taken_as_is_against_a_sybil_majority(swarm) -> None:
    memory, donor = swarm
    organizer, kept = donor("organizer", *honest_states()[0])
    helper, _ = donor("joined-from-it", kept.tensors, kept.meta)  # a joiner serving what it took over
    bad = poison()
    sybils = [donor(f"sybil-{i}", *bad) for i in range(4)]  # the most common digest, four times
    announced = [(peer, snap.digest) for peer, snap in sybils] + [
        (helper, kept.digest),
        (organizer, kept.digest),
    ]
    result = memory.fetch(announced, trusted={organizer})
    assert result.digest == kept.digest
    assert all(torch.equal(result.tensors[n], t) for n, t in kept.tensors.items())
    assert set(result.sources) <= {organizer, helper} and organizer in result.sources


def test_a_trusted_peer_that_fails_is_passed_over_for_the_median(swarm) -> None:
    memory, donor = swarm
    honest = honest_states()
    elsewhere = make_snapshot(*poison(), chunk_bytes=CHUNK)
    tensors, meta = honest[0]
    # it announces a state of its own, and serves another
    organizer, claimed = donor("organizer", tensors, {**meta, "step": 99}, serve=elsewhere)
    donors = [donor(f"honest-{i}", *s) for i, s in enumerate(honest)]
    announced = [(organizer, claimed.digest)] + [(peer, snap.digest) for peer, snap in donors]
    result = memory.fetch(announced, trusted={organizer})
    assert_within_honest(result, [t for t, _ in honest])
    assert organizer not in result.sources and len(result.sources) == 3


def test_a_median_donor_that_fails_half_way_is_resumed_by_another_holder_of_its_state(swarm) -> None:
    """The median's donor of one state sends a corrupt frame half-way: another donor of the same state
    takes over and sends only the frames that did not arrive; no frame of any state comes twice."""
    memory, donor = swarm
    honest = honest_states()
    kept = make_snapshot(*honest[0], chunk_bytes=CHUNK)
    frames, first_bad = frame_count(kept), frame_count(kept) // 2
    flaky_state = faulty_snapshot(
        kept, corrupt=lambda i, frame: flip_byte(i, frame) if i >= first_bad else frame
    )
    flaky, _ = donor("flaky", *honest[0], serve=flaky_state)
    backup, _ = donor("backup", *honest[0])
    others = [donor(f"honest-{i}", *state) for i, state in enumerate(honest[1:], start=1)]
    announced = [(flaky, kept.digest), (backup, kept.digest)] + [(p, snap.digest) for p, snap in others]
    result = memory.fetch(announced)
    assert flaky not in result.sources and backup in result.sources
    assert memory.servers[backup].stats().frames_sent == frames - first_bad
    sizes = []
    for tensors, meta in honest:
        with spool_state(tensors, meta, CHUNK) as served:
            sizes.append(served.nbytes)
    assert result.received_bytes == sum(sizes)
    assert_within_honest(result, [t for t, _ in honest])


def test_a_donor_with_hostile_progress_is_dropped_and_the_rest_give_the_median(swarm) -> None:
    memory, donor = swarm
    honest = honest_states()
    tensors, _ = honest[0]
    liar, lie = donor("liar", tensors, {"round": 1, "step": 1, "samples_total": 2**63 - 1})
    donors = [donor(f"honest-{i}", *s) for i, s in enumerate(honest)]
    result = memory.fetch([(liar, lie.digest)] + [(peer, snap.digest) for peer, snap in donors], parallel=4)
    assert liar not in result.sources
    assert result.meta["samples_total"] == sorted(HONEST_SAMPLES)[1]
    assert_within_honest(result, [t for t, _ in honest])


def test_progress_is_merged_by_the_median_and_bounded() -> None:
    metas = [{"round": 2, "step": 20, "samples_total": s} for s in (100, 200)]
    metas.append({"round": 2**40, "step": 2**40, "samples_total": MAX_PROGRESS})
    assert merge_meta(metas) == {"round": 2, "step": 20, "samples_total": 200}
    for huge in (MAX_PROGRESS + 1, 2**63 - 1):
        with pytest.raises(StateTransferError, match="samples_total"):
            progress_of({"samples_total": huge})


# ---------------------------------------------------------------------------- deadlines that follow progress


def test_a_slow_but_progressing_download_outlives_its_timeout_and_a_stalled_one_does_not(swarm) -> None:
    memory, donor = swarm
    organizer, kept = donor("organizer", *honest_states()[0])
    assert frame_count(kept) >= 8
    memory.delays[organizer] = 0.4  # a frame per 0.4 s: the whole state takes several timeouts
    result = memory.fetch([(organizer, kept.digest)], trusted={organizer}, timeout_s=1.0)
    assert result.digest == kept.digest
    memory.delays[organizer] = 3600.0  # the header, then nothing
    with pytest.raises(StateTransferError, match=r"made no progress for 1.0s"):
        memory.fetch([(organizer, kept.digest)], trusted={organizer}, timeout_s=1.0)


def test_a_donor_below_the_receive_floor_loses_its_part(swarm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol_module, "IO_TIMEOUT_S", 1.0)  # the client's grace and read timeout
    monkeypatch.setattr(protocol_module, "MIN_RECV_BYTES_PER_S", 256 << 10, raising=False)
    memory, donor = swarm
    tensors, meta = honest_states()[0]
    slow, kept = donor("slow", tensors, meta)
    fast, _ = donor("fast", tensors, meta)
    memory.delays[slow] = 0.5  # 16 KiB per 0.5 s, below 256 KiB/s; each read well within its 1 s
    result = memory.fetch([(slow, kept.digest), (fast, kept.digest)], trusted={slow, fast}, parallel=2)
    assert result.digest == kept.digest
    assert slow not in result.sources and fast in result.sources  # its part went to the fast donor


# ---------------------------------------------------------------------------- slow donors (issue 41, N5)

FLOOR = {"min_rate": 32 << 10, "window_s": 1.0}
"""A receive floor small enough for quick tests: 32 KiB per 1 s window, the first within 2 s."""
NEED = FLOOR["min_rate"] * FLOOR["window_s"]
TRICKLE = (1024, 0.125)
"""8 KiB/s, a quarter of the floor: a 78 KB state takes about 10 s."""


@pytest.fixture
def hold(swarm) -> Iterator[Callable[[int], None]]:
    """A ``before_frame`` that never lets a frame go (a donor that sends its header, then nothing),
    until the download ended (its worker thread is let go then, or the loop could not close)."""
    memory, _ = swarm
    release = threading.Event()
    memory.after.append(release.set)

    def never(index: int) -> None:
        release.wait(30)

    yield never
    release.set()


def test_a_trickling_donor_with_a_large_declared_chunk_is_snubbed_and_its_part_resumed(swarm, caplog) -> None:
    """The trusted organizer declares the largest chunk a joiner takes and trickles its bytes at a
    quarter of the floor (each read well within its own timeout): it is dropped at its first window,
    before it sent one window's worth, and another holder of the digest resumes its part."""
    memory, donor = swarm
    tensors, meta = honest_states()[0]
    big = make_snapshot(tensors, meta, chunk_bytes=MAX_RECV_CHUNK_BYTES)
    organizer, _ = donor("organizer", tensors, meta, serve=big)
    helper, _ = donor("helper", tensors, meta, serve=big)
    memory.trickles[organizer] = TRICKLE
    announced = [(organizer, big.digest), (helper, big.digest)]
    result = memory.fetch(announced, trusted={organizer}, parallel=1, **FLOOR)
    assert result.digest == big.digest and result.sources == (helper,)
    assert "below the receive floor" in caplog.text
    (link,) = memory.links[organizer]
    assert 0 < link.sent < NEED  # cut at its first deadline, not after its part
    with spool_state(tensors, meta, MAX_RECV_CHUNK_BYTES) as served:
        assert result.received_bytes == served.nbytes  # the helper sent only what had not arrived


def test_a_chunk_larger_than_a_joiner_takes_is_refused(swarm) -> None:
    memory, donor = swarm
    tensors, meta = honest_states()[0]
    huge = make_snapshot(tensors, meta, chunk_bytes=MAX_RECV_CHUNK_BYTES + 1)
    organizer, _ = donor("organizer", tensors, meta, serve=huge)
    with pytest.raises(StateTransferError, match=r"chunk_bytes .* is not in"):
        memory.fetch([(organizer, huge.digest)], trusted={organizer})


def test_endgame_a_sybil_announcing_the_trusted_digest_costs_only_the_rest_of_its_part(swarm) -> None:
    """A Sybil whose signed record announces the trusted digest gets a part and sends it slowly, above
    the floor (never snubbed): a window after the organizer's part is done, the organizer is asked
    for the rest of it too, and wins. Every byte the Sybil sent was verified against the digest."""
    memory, donor = swarm
    tensors, meta = honest_states()[0]
    organizer, kept = donor("organizer", tensors, meta)
    sybil, _ = donor("sybil", tensors, meta)
    memory.trickles[sybil] = (1024, 0.1)  # 10 KiB/s: above the floor, four seconds for its part
    announced = [(organizer, kept.digest), (sybil, kept.digest)]  # part 0 from the organizer
    result = memory.fetch(announced, trusted={organizer}, parallel=2, min_rate=4 << 10, window_s=1.0)
    assert result.digest == kept.digest and result.sources == (organizer,)
    (link,) = memory.links[sybil]
    frames = _frames(kept)
    assert link.sent < sum(len(frames[i]) for i in range(1, len(frames), 2))  # not its whole part


def _frames(snapshot: StateSnapshot) -> list[bytes]:
    with spool_state(snapshot.tensors, snapshot.meta, snapshot.chunk_bytes) as served:
        return [served.frame(i) for i in range(served.frame_count)]


def test_the_median_finishes_despite_a_donor_that_never_sends(swarm, hold) -> None:
    """Four distinct states, one donor sends its header and then nothing: the median of the other
    three is taken, long before the download's progress timeout."""
    memory, donor = swarm
    honest = honest_states()
    silent_state = make_snapshot(*poison(), chunk_bytes=CHUNK)
    silent, _ = donor("silent", *poison(), serve=faulty_snapshot(silent_state, before_frame=hold))
    donors = [donor(f"honest-{i}", *state) for i, state in enumerate(honest)]
    announced = [(silent, silent_state.digest)] + [(peer, snap.digest) for peer, snap in donors]
    result = memory.fetch(announced, parallel=4, timeout_s=10, **FLOOR)
    assert silent not in result.sources and len(result.sources) == 3
    assert_within_honest(result, [t for t, _ in honest])


def test_a_median_state_slower_than_the_others_is_not_waited_for(swarm) -> None:
    """A donor above the floor but far slower than the others (the only holder of its state): once
    three states are in, it has as long again as they took, then the median of the three is taken."""
    memory, donor = swarm
    honest = honest_states()
    slow_state = make_snapshot(*poison(), chunk_bytes=CHUNK)
    slow, _ = donor("slow", *poison())
    memory.trickles[slow] = (1024, 0.1)  # 10 KiB/s, above a floor of 4 KiB/s: 8 s for its state
    donors = [donor(f"honest-{i}", *state) for i, state in enumerate(honest)]
    announced = [(slow, slow_state.digest)] + [(peer, snap.digest) for peer, snap in donors]
    result = memory.fetch(announced, parallel=4, min_rate=4 << 10, window_s=1.0)
    assert slow not in result.sources and len(result.sources) == 3
    assert_within_honest(result, [t for t, _ in honest])
    (link,) = memory.links[slow]
    assert link.sent < sum(len(f) for f in _frames(slow_state))


def test_a_stage_past_its_deadline_fails_and_one_past_its_quorum_stops() -> None:
    """The deadline of a stage: START_WINDOWS windows before its state's size is known, then twice
    its bytes at the floor; a stage that needs every part fails past it, a median with its quorum stops."""

    class Stuck:
        """Keys 0 and 1 complete at once; every other attempt never ends."""

        def replacement(self, key: int, failed: set[str], busy: set[str]) -> str | None:
            return None

        def spare(self, key: int, failed: set[str], busy: set[str]) -> str | None:
            return None

        def left(self, key: int) -> int:
            return 1

        async def attempt(self, key: int, donor: str) -> None:
            if key >= 2:
                await asyncio.Event().wait()

    async def run(quorum: int | None) -> set[int]:
        budget = Budget(FloorSpec(rate=1 << 20, window_s=0.05), quorum or 1)
        assert budget.deadline == pytest.approx(budget.start + START_WINDOWS * 0.05)
        scheduler = Scheduler(Stuck(), budget, quorum)
        await asyncio.wait_for(scheduler.run([(key, f"donor-{key}") for key in range(3)]), 30)
        return scheduler.complete

    with pytest.raises(StateTransferError, match=r"parts \[2\] not complete within the deadline"):
        asyncio.run(run(None))
    assert asyncio.run(run(2)) == {0, 1}


def test_a_header_sets_the_deadline_from_the_quorum_th_smallest_state() -> None:
    async def deadlines() -> list[float]:
        budget = Budget(FloorSpec(rate=1000.0, window_s=1.0), quorum=2)
        found = []
        for digest, frames, chunk in (("a", 10, 100), ("b", 10**6, 4 << 20), ("c", 20, 100)):
            header = SimpleNamespace(digest=digest, hashes=[b""] * frames, chunk_bytes=chunk)
            budget.on_header(header)  # type: ignore[arg-type]
            found.append(budget.deadline - budget.start)
        return found

    # fewer states than the quorum: the largest (a hostile one), then the quorum-th smallest
    assert asyncio.run(deadlines()) == [5.0, 3.0 + 2 * 10**6 * (4 << 20) / 1000, 3.0 + 2 * 2000 / 1000]


# ---------------------------------------------------------------------------- the state server


def _request(snapshot: StateSnapshot) -> bytes:
    return jmsg(Kind.REQUEST, {"digest": snapshot.digest, "part": 0, "parts": 1, "skip": 0})


async def _stream(fake: FakeP2P, peer: str, request: bytes, writer: FakeWriter | None = None) -> list:
    reader = asyncio.StreamReader()
    reader.feed_data(request)
    writer = writer or FakeWriter()
    await fake.handlers[handler_name(RUN)](SimpleNamespace(peer_id=peer_id(peer)), reader, writer)
    return parse_messages(bytes(writer.data))


async def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def test_one_peer_cannot_take_more_than_two_streams_of_a_donor() -> None:
    release = threading.Event()
    first_frames: list[int] = []  # one entry per stream that reached its first frame

    def hold(index: int) -> None:
        if index == 0:
            first_frames.append(index)
        assert release.wait(30)

    snapshot = make_snapshot(*make_state(1), chunk_bytes=CHUNK)
    fake = FakeP2P("donor")
    with StateServer(run_id=RUN, p2p_factory=fake.factory) as server:
        server.publish(faulty_snapshot(snapshot, before_frame=hold))

        async def scenario() -> None:
            held = [asyncio.create_task(_stream(fake, "attacker", _request(snapshot))) for _ in range(2)]
            other = None
            try:
                await _until(lambda: len(first_frames) == 2, "two streams being served")
                third = await asyncio.wait_for(_stream(fake, "attacker", _request(snapshot)), 5)
                assert [kind for kind, _ in third] == [Kind.ERROR] and b"busy" in third[0][1]
                other = asyncio.create_task(_stream(fake, "honest", _request(snapshot)))
                await _until(lambda: len(first_frames) == 3, "another peer's stream being served")
            finally:
                release.set()
            replies = await asyncio.gather(*held, *([other] if other else []))
            assert len(replies) == 3 and all(len(reply) == 1 + frame_count(snapshot) for reply in replies)

        asyncio.run(scenario())
        assert server.stats().refused == 1


class SlowReader(FakeWriter):
    """A reader that takes ``delay`` seconds for every piece: it keeps each write's own timeout."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    async def drain(self) -> None:
        await asyncio.sleep(self.delay)
        await super().drain()


def test_a_slow_reader_is_dropped_below_the_progress_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "IO_TIMEOUT_S", 2.0)  # the grace, and each write's own timeout
    monkeypatch.setattr(server_module, "MIN_SEND_BYTES_PER_S", 256 << 10, raising=False)
    snapshot = make_snapshot(*make_state(1), chunk_bytes=2048)
    frames = frame_count(snapshot)
    assert frames > 30
    fake = FakeP2P("donor")
    with StateServer(run_id=RUN, p2p_factory=fake.factory) as server:
        server.publish(snapshot)
        # 2 KiB per 0.2 s: 10 KiB/s, below the floor; every write completes well within 2 s
        slow = asyncio.run(asyncio.wait_for(_stream(fake, "slow", _request(snapshot), SlowReader(0.2)), 30))
        assert 1 < len(slow) < 1 + frames
        assert server.stats().too_slow == 1 and server.stats().parts_served == 0
        fast = asyncio.run(_stream(fake, "fast", _request(snapshot)))
        assert len(fast) == 1 + frames and server.stats().parts_served == 1


# ---------------------------------------------------------------------------- checkpoint names


def test_every_checkpoint_name_the_writer_produces_is_listed_and_pruned(tmp_path: Path) -> None:
    for step in (10**12, 10**12 + 1, 10**17):
        save_checkpoint(tmp_path, {"step": step}, step=step, keep=1)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10**17]
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 1  # nothing escaped pruning
    for step in (10**18, 2**63 - 1, -1):
        with pytest.raises(ValueError, match="checkpoint step"):
            save_checkpoint(tmp_path, {"step": step}, step=step, keep=1)
    assert len(list(tmp_path.iterdir())) == 1


# ---------------------------------------------------------------------------- the bootstrap's mirror


def _member(peer: str, digest: str) -> Member:
    record = PeerRecord(
        peer_id=peer,
        protocol_version=1,
        package_version="0",
        config_hash="ab",
        role="trainer",
        state_hash=digest,
    )
    return Member(peer_id=peer, record=record, expires_at=time.time() + 60)


@pytest.fixture
def mirror_of(swarm, tmp_path: Path) -> Iterator[Callable[[list[Member]], StateMirror]]:
    """``mirror_of(members)``: a StateMirror that sees ``members`` and downloads over the memory swarm."""
    memory, _ = swarm
    made: list[StateMirror] = []

    def download(source: Any, donors: list[tuple[str, str]], **options: Any) -> StateSnapshot:
        return memory.fetch(donors, **{k: v for k, v in options.items() if k != "run_id"})

    def make(members: list[Member], **options: Any) -> StateMirror:
        node = mirror_node(members, RUN)
        server = StateServer(run_id=RUN, p2p_factory=FakeP2P("mirror").factory)
        made.append(StateMirror(node, state_dir=str(tmp_path), server=server, download=download, **options))
        return made[-1]

    yield make
    for mirror in made:
        mirror.close()


def test_the_mirror_never_copies_or_saves_two_sybils_and_takes_the_median(swarm, mirror_of, tmp_path) -> None:
    _, donor = swarm
    bad = poison()
    members = [_member(peer, snap.digest) for peer, snap in (donor(f"sybil-{i}", *bad) for i in range(2))]
    honest = honest_states()
    peer, snap = donor("honest-0", *honest[0])
    members.append(_member(peer, snap.digest))
    mirror = mirror_of(members)
    assert mirror.refresh() is False  # two distinct states (the Sybils count once): nothing copied
    assert mirror.snapshot is None and list_checkpoints(tmp_path) == []
    for i, state in enumerate(honest[1:], start=1):
        peer, snap = donor(f"honest-{i}", *state)
        members.append(_member(peer, snap.digest))
    assert mirror.refresh() is True
    assert_within_honest(mirror.snapshot, [t for t, _ in honest])
    ((step, path),) = list_checkpoints(tmp_path)
    saved = read_checkpoint(path)
    assert step == saved["meta"]["samples_total"] <= max(HONEST_SAMPLES)


def test_an_inflated_kept_state_does_not_freeze_the_mirror(swarm, mirror_of, tmp_path) -> None:
    _, donor = swarm
    inflated = make_snapshot(*poison())  # as the mirror rebuilds a saved state
    save_checkpoint(tmp_path, {"tensors": inflated.tensors, "meta": inflated.meta, "config_hash": ""}, 10**15)
    members: list[Member] = []
    mirror = mirror_of(members)
    mirror.start()  # serves the saved copy (the first refresh, at once, finds no trainer)
    assert mirror.digest == inflated.digest
    honest = honest_states()
    taken = []
    for attempt in range(3):
        members[:] = []
        for i, (tensors, meta) in enumerate(honest):
            peer, snap = donor(f"honest-{attempt}-{i}", tensors, {**meta, "step": meta["step"] + attempt})
            members.append(_member(peer, snap.digest))
        taken.append(mirror.refresh())
    assert taken == [False, False, True]
    assert mirror.snapshot.meta["samples_total"] <= max(HONEST_SAMPLES)


def test_a_silent_trainer_does_not_freeze_the_mirror(swarm, mirror_of, hold) -> None:
    """The mirror's refresh is a bounded download too: a trainer that sends its header and then
    nothing is left out, and the median of the other three is kept."""
    _, donor = swarm
    silent_state = make_snapshot(*poison(), chunk_bytes=CHUNK)
    silent, _ = donor("silent", *poison(), serve=faulty_snapshot(silent_state, before_frame=hold))
    members = [_member(silent, silent_state.digest)]
    honest = honest_states()
    for i, state in enumerate(honest):
        peer, snap = donor(f"honest-{i}", *state)
        members.append(_member(peer, snap.digest))
    mirror = mirror_of(members, download_options={**FLOOR, "timeout_s": 10, "parallel": 4})
    assert mirror.refresh() is True
    assert silent not in mirror.snapshot.sources
    assert_within_honest(mirror.snapshot, [t for t, _ in honest])
