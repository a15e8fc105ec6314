"""State transfer (swarm.state: _server, _download, _merge): snapshot digests, parallel verified
downloads of a trusted donor's state, the median of distinct donors, corrupt and wrong donors, and
publish during a download. Hostile donors and readers: tests/test_hostile_state.py."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from swarm.state import StateServer, StateTransferError, download_state, make_snapshot, spool_state
from tests._faults import faulty_snapshot
from tests._processes import PeerProcess, wait_until
from tests.workers.state_transfer import SCHEMA, make_state

RUN = "st-test"
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
WORKER = [sys.executable, "-m", "tests.workers.state_transfer", "--run-id", RUN]


# ---------------------------------------------------------------------------- helpers


Donor = tuple[PeerProcess, str, str, str]


@pytest.fixture
def start_donors(spawn: Callable[..., PeerProcess]) -> Iterator[Callable[..., list[Donor]]]:
    """Start donor processes (all at once) and wait for each READY: (process, peer id, maddr, digest).
    At the end each is stopped with SIGTERM and waited for, so its DHT and p2pd shut down cleanly."""
    processes: list[PeerProcess] = []

    def start(*argvs: list[str]) -> list[Donor]:
        started = [spawn([*WORKER, *argv]) for argv in argvs]
        processes.extend(started)
        donors = []
        for process in started:
            _, peer, maddr, digest = process.wait_for_line(lambda line: line.startswith("READY"), 60).split()
            donors.append((process, peer, maddr, digest))
        return donors

    yield start
    for process in processes:
        process.signal(signal.SIGTERM)
    codes = [process.wait(30) for process in processes]
    assert codes == [0] * len(processes), [process.output()[-2000:] for process in processes]


@pytest.fixture
def client_dht() -> Iterator[Callable[[list[str]], object]]:
    """A hivemind DHT in this process, connected to the given maddrs; shut down at the end."""
    import hivemind

    made = []

    def make(initial_peers: list[str]) -> object:
        dht = hivemind.DHT(initial_peers=initial_peers or None, host_maddrs=[LOOPBACK], start=True)
        made.append(dht)
        return dht

    yield make
    for dht in made:
        dht.shutdown()


@pytest.fixture
def client_p2p() -> Iterator[Callable[[list[str]], object]]:
    """A bare hivemind P2P (own p2pd, no DHT) on a private loop, connected to the given maddrs."""
    from hivemind.p2p import P2P

    from swarm.p2p import LoopThread

    loop = LoopThread("test-client")
    made = []

    def make(initial_peers: list[str]) -> object:
        made.append(loop.run(P2P.create(initial_peers=initial_peers, host_maddrs=[LOOPBACK]), 60))
        return made[-1]

    yield make
    for p2p in made:
        loop.run(p2p.shutdown(), 30)
    loop.stop()


def frame_count(tensors: dict[str, torch.Tensor], meta: dict, chunk_bytes: int = 16384) -> int:
    with spool_state(tensors, meta, chunk_bytes) as served:
        return served.frame_count


def frames_served(process: PeerProcess, parts: int = 1) -> int:
    """Frames this donor reports having sent once it reports ``parts`` complete parts served."""
    line = process.wait_for_line(lambda line: f" parts={parts} " in line, 30)
    return int(re.search(r"frames=(\d+)", line).group(1))


def assert_same_state(snapshot: object, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    assert snapshot.meta == meta
    assert sorted(snapshot.tensors) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(snapshot.tensors[name], tensor), name


# ---------------------------------------------------------------------------- in process


def test_snapshot_digest_is_deterministic_and_sensitive() -> None:
    generator = torch.Generator().manual_seed(1)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in SCHEMA.items()}  # full fp32
    meta = {"round": 1, "step": 10, "samples_total": 320}
    first = make_snapshot(tensors, meta, chunk_bytes=16384)
    assert first.digest == make_snapshot(tensors, dict(meta), chunk_bytes=16384).digest
    with spool_state(tensors, meta, chunk_bytes=16384) as served:
        assert served.digest == first.digest  # the published form names the same state
        assert served.frame_count > len(tensors)  # several chunks per tensor
    for name in tensors:
        changed = {**tensors, name: tensors[name].clone()}
        changed[name].view(-1)[-1] *= 1.01  # a change bf16 resolves (it has 8 bits of precision)
        assert make_snapshot(changed, meta, chunk_bytes=16384).digest != first.digest, name
        held = tensors[name].view(-1)[-1].bfloat16().float()  # what the wire carries of it
        changed[name].view(-1)[-1] = held * (1 + 2**-12)  # a change bf16 does not resolve
        assert make_snapshot(changed, meta, chunk_bytes=16384).digest == first.digest, name
    assert (
        make_snapshot(tensors, {**meta, "step": meta["step"] + 1}, chunk_bytes=16384).digest != first.digest
    )
    renamed = {("param/v" if k == "param/w" else k): v for k, v in tensors.items()}
    assert make_snapshot(renamed, meta, chunk_bytes=16384).digest != first.digest
    assert make_snapshot(tensors, meta, chunk_bytes=32768).digest != first.digest
    rounded = tensors["param/b"].bfloat16().float()
    assert torch.equal(first.tensors["param/b"], rounded) and not torch.equal(rounded, tensors["param/b"])
    tensors["param/b"].add_(1.0)  # snapshots hold copies
    assert torch.equal(first.tensors["param/b"], rounded)
    with pytest.raises(ValueError):
        make_snapshot(tensors, {"loss": float("nan")})


def test_a_published_state_lives_in_a_spool_file_without_a_name(tmp_path, monkeypatch) -> None:
    """The frames go to a file that has no name from the start (nothing is left behind even after
    SIGKILL), are read back one by one and checked on the way out; a state that cannot be spooled
    leaves no file open."""
    import swarm.state._served as served_module

    tensors, meta = make_state(1)
    with spool_state(tensors, meta, chunk_bytes=4096, spool_dir=str(tmp_path)) as served:
        assert list(tmp_path.iterdir()) == []
        status = os.fstat(served.spool.fileno())
        assert status.st_nlink == 0 and status.st_size == served.nbytes
        assert served.nbytes < sum(t.numel() for t in tensors.values()) * 2 + served.frame_count * 256
        assert_same_state(served.decode(), tensors, meta)
        at = served.offsets[3] + 100
        flipped = bytes([os.pread(served.spool.fileno(), 1, at)[0] ^ 1])
        os.pwrite(served.spool.fileno(), flipped, at)  # the disk changes a byte of frame 3
        with pytest.raises(OSError, match=r"frame 3 .* no longer matches"):
            served.frame(3)
    assert served.closed
    with pytest.raises(ValueError):
        served.frame(0)
    opened = []
    real = served_module.tempfile.TemporaryFile
    monkeypatch.setattr(
        served_module.tempfile, "TemporaryFile", lambda **kw: opened.append(real(**kw)) or opened[-1]
    )
    nan = {**tensors, "param/b": torch.full((300,), float("nan"))}  # the third tensor: frames were written
    with pytest.raises(ValueError, match="NaN"):
        spool_state(nan, meta, chunk_bytes=4096)
    monkeypatch.setattr(served_module, "MAX_FRAMES", 5)
    with pytest.raises(ValueError, match="more than 5 frames"):
        spool_state(tensors, meta, chunk_bytes=4096)
    assert len(opened) == 2 and all(f.closed for f in opened)
    for bad in (0, 65 << 20):
        with pytest.raises(ValueError, match="chunk_bytes"):
            spool_state(tensors, meta, chunk_bytes=bad)
    assert len(opened) == 2  # checked before anything is opened


def test_publish_during_download_never_mixes_states(client_dht: Callable[[list[str]], object]) -> None:
    """The server pins the state a request started on, keeping its spool open until the stream ends
    (then closing it); with no keep window a later request for it is refused. Closing the server
    closes what it serves."""
    reached, release = threading.Event(), threading.Event()

    def gate(index: int) -> None:
        if not reached.is_set():
            reached.set()
            assert release.wait(30)

    server_dht = client_dht([])
    old = make_snapshot(*make_state(1), chunk_bytes=16384)
    new = make_snapshot(*make_state(2, step=20), chunk_bytes=16384)
    old_served = faulty_snapshot(old, before_frame=gate)
    new_served = spool_state(new.tensors, new.meta, chunk_bytes=16384)
    with StateServer(server_dht, RUN, keep_replaced_s=0) as server:
        assert server.digest is None
        server.publish(old_served)
        assert server.digest == old.digest
        client = client_dht([str(m) for m in server_dht.get_visible_maddrs()])
        donors, trusted = [(server.peer_id, old.digest)], {server.peer_id}
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(download_state, client, donors, run_id=RUN, trusted=trusted, timeout_s=30)
            assert reached.wait(30)
            server.publish(new_served)  # mid-stream: the stream in flight keeps serving the old state
            assert not old_served.closed
            release.set()
            result = pending.result(60)
        wait_until(lambda: old_served.closed, 30, "the replaced state closed once its stream ended")
        assert result.digest == old.digest
        assert_same_state(result, old.tensors, old.meta)
        with pytest.raises(StateTransferError, match=f"{server.peer_id}.*digest mismatch"):
            download_state(client, donors, run_id=RUN, trusted=trusted, timeout_s=30)
        fresh = download_state(
            client, [(server.peer_id, new.digest)], run_id=RUN, trusted=trusted, timeout_s=30
        )
        assert fresh.digest == new.digest
        assert server.stats().refused == 1
        assert not new_served.closed
    assert new_served.closed


def test_a_donor_keeps_serving_the_state_its_record_still_names(
    client_dht: Callable[[list[str]], object], tmp_path
) -> None:
    """A trainer publishes after every round and a joiner reads the digest from a record a round old
    (before, it always got "digest mismatch"): the donor publishes a new state only once the server
    has let the one before go, and the replaced one answers requests while a record may name it. So
    the digest of the older, still announced state is served while the trainer goes on, and the
    donor never holds more than two spooled copies."""
    from swarm.learning import OuterOptimizer
    from swarm.trainer._joining import publish_state
    from swarm.trainer._progress import Progress

    outer = OuterOptimizer(torch.nn.Linear(64, 32), lr=0.7, momentum=0.9)
    server_dht = client_dht([])
    with StateServer(server_dht, RUN, spool_dir=str(tmp_path), keep_replaced_s=600) as server:
        announced = publish_state(server, outer, Progress(step=1), None, str(tmp_path))
        later = [
            publish_state(server, outer, Progress(step=step), None, str(tmp_path)) for step in range(2, 6)
        ]
        assert announced is not None and later[0] not in (None, announced)
        assert later[1:] == [None] * 3  # the record naming `announced` may still be read: kept
        assert server.digest == later[0] and server.spooled()[0] == 2
        client = client_dht([str(m) for m in server_dht.get_visible_maddrs()])
        for digest in (announced, later[0]):
            donors, trusted = [(server.peer_id, digest)], {server.peer_id}
            result = download_state(client, donors, run_id=RUN, trusted=trusted, timeout_s=30)
            assert result.digest == digest
        assert server.stats().refused == 0


def test_argument_checks() -> None:
    with pytest.raises(ValueError, match="run_id"):
        StateServer(object(), "bad id!")
    with pytest.raises(ValueError, match="keep_replaced_s"):
        StateServer(object(), RUN, pin_lifetime_s=0)
    with pytest.raises(ValueError, match="exactly one"):
        StateServer(None, RUN)
    with pytest.raises(StateTransferError, match="no donor"):
        download_state(object(), [("peer", "not-a-digest")], run_id=RUN)


# ---------------------------------------------------------------------------- donor processes


@pytest.mark.multipeer
def test_parallel_download_from_three_donors(start_donors, client_p2p) -> None:
    donors = start_donors(["--seed", "1"], ["--seed", "1"], ["--seed", "1"])
    tensors, meta = make_state(1)
    expected = make_snapshot(tensors, meta, chunk_bytes=16384)
    assert {digest for *_, digest in donors} == {expected.digest}
    client = client_p2p([maddr for _, _, maddr, _ in donors])
    announced = [(peer, digest) for _, peer, _, digest in donors]
    result = download_state(client, announced, run_id=RUN, trusted={donors[0][1]}, timeout_s=60)
    assert result.digest == expected.digest
    assert_same_state(result, tensors, meta)
    served = [frames_served(process) for process, *_ in donors]
    assert all(count > 0 for count in served), served
    assert sum(served) == frame_count(tensors, meta)  # disjoint shares: every frame exactly once


@pytest.mark.multipeer
def test_corrupt_donor_part_is_reassigned_and_wrong_digest_is_named(start_donors, client_p2p) -> None:
    bad, good = start_donors(["--seed", "1", "--corrupt"], ["--seed", "1"])
    tensors, meta = make_state(1)
    client = client_p2p([bad[2], good[2]])
    donors, trusted = [(bad[1], bad[3]), (good[1], good[3])], {bad[1], good[1]}
    result = download_state(client, donors, run_id=RUN, trusted=trusted, timeout_s=60)
    assert_same_state(result, tensors, meta)
    assert frames_served(good[0], parts=2) == frame_count(tensors, meta)  # its part, then the corrupt one's
    with pytest.raises(StateTransferError, match=f"{bad[1]}.*does not match its announced hash"):
        download_state(client, [(bad[1], bad[3])], run_id=RUN, trusted=trusted, timeout_s=60)
    wrong = make_snapshot(*make_state(7), chunk_bytes=16384).digest
    with pytest.raises(StateTransferError, match=f"{good[1]}.*digest mismatch"):
        download_state(client, [(good[1], wrong)], run_id=RUN, trusted=trusted, timeout_s=60)


@pytest.mark.multipeer
def test_a_donor_that_takes_over_a_part_sends_only_what_did_not_arrive(start_donors, client_p2p) -> None:
    """Donor A fails at frame ``first_bad`` (a corrupt frame) half-way through its part: donor B, which
    takes the part over, is asked for and sends only the frames of it A had not delivered."""
    chunk = ["--chunk-bytes", "4096"]
    tensors, meta = make_state(1)
    frames = frame_count(tensors, meta, chunk_bytes=4096)
    first_bad = frames // 2
    bad, good = start_donors(
        ["--seed", "1", "--corrupt-from", str(first_bad), *chunk], ["--seed", "1", *chunk]
    )
    client = client_p2p([bad[2], good[2]])
    donors = [(bad[1], bad[3]), (good[1], good[3])]  # part 0 (frames 0, 2, 4, ...) goes to A
    result = download_state(client, donors, run_id=RUN, trusted={bad[1], good[1]}, timeout_s=60)
    assert_same_state(result, tensors, meta)
    delivered_by_a = len(range(0, first_bad, 2))
    assert delivered_by_a > 0
    assert frames_served(good[0], parts=2) == frames - delivered_by_a  # not one frame twice
    with spool_state(tensors, meta, 4096) as served:
        assert result.received_bytes == served.nbytes


@pytest.mark.multipeer
def test_different_donors_give_their_verified_median(start_donors, client_p2p) -> None:
    steps = (10, 30, 20)
    donors = start_donors(
        *(["--seed", str(seed), "--step", str(step)] for seed, step in zip((1, 2, 3), steps, strict=True))
    )
    states = [make_state(seed, step) for seed, step in zip((1, 2, 3), steps, strict=True)]
    assert len({digest for *_, digest in donors}) == 3
    client = client_p2p([maddr for _, _, maddr, _ in donors])
    announced = [(peer, digest) for _, peer, _, digest in donors]
    with pytest.raises(StateTransferError, match=r"2 distinct state.*needs 3 distinct donors"):
        download_state(client, announced[:2], run_id=RUN, timeout_s=60)
    result = download_state(client, announced, run_id=RUN, timeout_s=60)
    # the median and the merged progress, computed here from the donors' seeds, not from the result
    median = {name: torch.stack([t[name] for t, _ in states]).median(0).values for name in states[0][0]}
    expected = make_snapshot(median, {"round": 2, "step": 20, "samples_total": 640}, chunk_bytes=16384)
    assert_same_state(result, expected.tensors, expected.meta)
    # the digest a joiner logs names exactly that merged state, no donor's
    assert result.digest == expected.digest
    assert result.digest not in {digest for *_, digest in donors}
    assert sorted(result.sources) == sorted(peer for peer, _ in announced)
    assert all(frames_served(process) == frame_count(*states[0]) for process, *_ in donors)


def test_median_of_three_donors_resists_one_hostile_state() -> None:
    """With 3+ distinct donors a hostile (but correctly announced) state cannot move any coordinate
    outside the honest ones; fewer than 3 distinct states (equal digests count once) are refused."""
    from swarm.state._merge import median_snapshot

    generator = torch.Generator().manual_seed(0)
    base = torch.randn(4096, generator=generator)
    honest = [(base + 0.01 * torch.randn(4096, generator=generator)).bfloat16().float() for _ in range(2)]
    hostile = base + 1000.0
    snapshots = [make_snapshot({"w": t}, {"step": i}) for i, t in enumerate([*honest, hostile])]
    result = median_snapshot(snapshots, 3).tensors["w"]
    low, high = torch.minimum(*honest), torch.maximum(*honest)
    assert bool(((result >= low) & (result <= high)).all())
    with pytest.raises(StateTransferError, match="only 2 distinct donor state"):
        median_snapshot([*snapshots[:2], snapshots[1]], 3)
