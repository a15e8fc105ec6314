"""Membership spread over several DHT keys (``run.member_shards``): where records go, what a read of one
shard returns, and a trainer's bounded view, which reads one shard at a time and still finds partners."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm import NetworkOptions, NodeInfo, PeerRecord, SwarmNode
from swarm.config import ConfigError, load_config
from swarm.membership import (
    MAX_MEMBER_SHARDS,
    Member,
    MemberView,
    list_members,
    membership_validators,
    record_key,
    shard_of,
)
from swarm.membership._signed import StrictSchemaValidator
from swarm.membership._view import FIRST_READ_SHARDS, SHARD_READ_EVERY, SHARD_READ_LIMIT
from swarm.network import ensure_identity, peer_id_of_identity
from tests._processes import wait_until
from tests.test_trainer import _Runner
from tests.workers.tiny import TINY

RUN = "test-shards"
SHARDS = 4
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def _peer_id(rng: random.Random) -> str:
    return "".join(rng.choice(_BASE58) for _ in range(46))


def _member(peer_id: str, expires_at: float) -> Member:
    record = PeerRecord(
        peer_id=peer_id, protocol_version=1, package_version="x", config_hash="ab", role="trainer"
    )
    return Member(peer_id=peer_id, record=record, expires_at=expires_at)


def _of_shard(shard: int, shards: int, count: int, rng: random.Random) -> list[str]:
    found: list[str] = []
    while len(found) < count:
        peer_id = _peer_id(rng)
        if shard_of(peer_id, shards) == shard:
            found.append(peer_id)
    return found


def test_shards_are_a_stable_hash_within_range() -> None:
    rng = random.Random(0)
    ids = [_peer_id(rng) for _ in range(400)]
    counts = [0] * SHARDS
    for peer_id in ids:
        shard = shard_of(peer_id, SHARDS)
        assert shard == shard_of(peer_id, SHARDS)
        counts[shard] += 1
    assert min(counts) > 400 / SHARDS / 2, counts  # spread, not piled on one key
    assert {shard_of(peer_id, 1) for peer_id in ids} == {0}
    assert record_key(RUN) == record_key(RUN, 0) == f"{RUN}_members"  # one shard: the key as before
    assert record_key(RUN, 3) == f"{RUN}_members_3"
    with pytest.raises(ValueError, match="outside"):
        record_key(RUN, MAX_MEMBER_SHARDS)


def test_the_record_validators_of_every_shard_pickle_into_the_dht_process() -> None:
    """``DHT.add_validators`` (a monitor that learns its run late) pickles them to the DHT's process."""
    validators = membership_validators(RUN, RSASignatureValidator(RSAPrivateKey()))
    schema = next(v for v in pickle.loads(pickle.dumps(validators)) if isinstance(v, StrictSchemaValidator))
    keys = {DHTID.generate(source=record_key(RUN, s)).to_bytes() for s in range(MAX_MEMBER_SHARDS)}
    assert keys <= set(schema._key_id_to_field_name)


def test_a_view_reads_one_shard_at_a_time_and_visits_every_shard() -> None:
    shards = 16
    view = MemberView(shards, random.Random(1))
    first = view.next_shards()
    assert len(first) == len(set(first)) == FIRST_READ_SHARDS
    view.update({shard: [] for shard in first}, now=0.0)
    later = [view.next_shards() for _ in range(3 * shards)]
    assert all(len(read) == 1 for read in later)
    # every shard comes round once in each rotation of ``shards`` refreshes
    for start in range(0, 2 * shards, shards):
        rotation = [read[0] for read in later[start + shards - len(first) : start + 2 * shards - len(first)]]
        assert sorted(rotation) == list(range(shards)), rotation


def test_a_run_of_one_shard_reads_it_all_every_refresh_and_more_shards_read_less_often() -> None:
    whole = MemberView.for_run(1, interval_s=3.0)
    assert [whole.next_shards() for _ in range(4)] == [[0]] * 4
    assert whole.latest  # the schedule orders the whole list: every holder is asked for its newest
    rng = random.Random(4)
    view = MemberView.for_run(SHARDS, interval_s=3.0, rng=rng)
    assert not view.latest  # a view of a few shards takes the first holder's copy
    view.update({s: [] for s in view.next_shards()}, now=0.0)
    reads = [view.next_shards() for _ in range(4 * SHARD_READ_EVERY)]
    assert sum(map(len, reads)) == 4 and all(len(r) <= 1 for r in reads)
    # what was read is kept one read period past its record's expiry, not longer
    [a] = _of_shard(1, SHARDS, 1, rng)
    view.update({1: [_member(a, 10.0)]}, now=0.0)
    assert [m.peer_id for m in view.members(10.0 + SHARD_READ_EVERY * 3.0 - 0.1)] == [a]
    assert view.members(10.0 + SHARD_READ_EVERY * 3.0 + 0.1) == []


def test_a_view_replaces_what_it_reads_and_keeps_the_rest_until_it_expires() -> None:
    rng = random.Random(2)
    view = MemberView(SHARDS, rng)
    a1, a2 = _of_shard(1, SHARDS, 2, rng)
    [b] = _of_shard(2, SHARDS, 1, rng)
    view.update({1: [_member(a1, 10.0), _member(a2, 10.0)], 2: [_member(b, 5.0)]}, now=0.0)
    assert [m.peer_id for m in view.members(0.0)] == sorted([a1, a2, b])
    # shard 1 read again without a2 (it left): a2 goes, b (shard 2, not read) stays
    view.update({1: [_member(a1, 12.0)]}, now=1.0)
    assert [m.peer_id for m in view.members(1.0)] == sorted([a1, b])
    # a failed read of shard 2 keeps what the view had of it, until those records expire
    view.update({2: None}, now=2.0)
    assert b in {m.peer_id for m in view.members(2.0)}
    assert b not in {m.peer_id for m in view.members(6.0)}


def test_one_shard_read_fills_at_most_its_part_of_a_view() -> None:
    rng = random.Random(3)
    crowd = _of_shard(0, SHARDS, 3 * SHARD_READ_LIMIT, rng)
    view = MemberView(SHARDS, rng)
    view.update({0: [_member(p, 10.0) for p in crowd]}, now=0.0)
    assert len(view.members(0.0)) == SHARD_READ_LIMIT
    whole = MemberView(1, rng)  # one shard is the whole list: nothing is left out
    whole.update({0: [_member(p, 10.0) for p in crowd]}, now=0.0)
    assert len(whole.members(0.0)) == len(crowd)


def test_a_sharded_run_refuses_the_hypercube_schedule() -> None:
    with pytest.raises(ConfigError, match=r"averaging\.partners: must be 'random'"):
        load_config(None, overrides=["run.member_shards=2"], env={})
    config = load_config(None, overrides=["run.member_shards=2", "averaging.partners=random"], env={})
    assert config.run.member_shards == 2
    assert (
        config.config_hash()
        != load_config(None, overrides=["averaging.partners=random"], env={}).config_hash()
    )
    allreduce = ["run.member_shards=2", "averaging.partners=random", "averaging.backend=allreduce"]
    with pytest.raises(ConfigError, match=r"averaging\.backend: cannot be 'allreduce'"):
        load_config(None, overrides=allreduce, env={})
    with pytest.raises(ConfigError, match=r"run\.member_shards"):
        load_config(None, overrides=[f"run.member_shards={MAX_MEMBER_SHARDS + 1}"], env={})


def _identities(tmp_path: Path, shards: list[int]) -> list[Path]:
    """Identity files whose peer ids hash to ``shards``, one each, so a test covers the shards it names."""
    found: list[Path] = []
    for index, shard in enumerate(shards):
        attempt = 0
        while True:
            path = ensure_identity(tmp_path / f"peer-{index}-{attempt}.key")
            if shard_of(peer_id_of_identity(path), SHARDS) == shard:
                found.append(path)
                break
            attempt += 1
    return found


@contextmanager
def _nodes(tmp_path: Path, shards: list[int]) -> Iterator[list[SwarmNode]]:
    """Nodes of a run of :data:`SHARDS` shards whose records go to ``shards``, one each; closed after."""
    nodes: list[SwarmNode] = []
    try:
        for identity in _identities(tmp_path, shards):
            initial_peers = nodes[0].visible_maddrs() if nodes else []
            network = NetworkOptions(initial_peers=initial_peers, identity_path=str(identity))
            info = NodeInfo(RUN, "ab12", "trainer", member_shards=SHARDS)
            nodes.append(SwarmNode(network, info, record_interval_s=0.5, record_ttl_s=20))
        yield nodes
    finally:
        for node in reversed(nodes):
            node.close()


def test_records_land_in_their_shard_and_a_misplaced_one_is_dropped(tmp_path) -> None:
    with _nodes(tmp_path, [0, 1, 1, 3]) as nodes:
        everyone = {node.peer_id for node in nodes}
        reader = nodes[0]
        wait_until(lambda: {m.peer_id for m in reader.members()} == everyone, 30, "all four records")
        for shard in range(SHARDS):
            listed = {m.peer_id for m in list_members(reader.dht, RUN, member_shards=SHARDS, shards=[shard])}
            assert listed == {n.peer_id for n in nodes if shard_of(n.peer_id, SHARDS) == shard}, shard
        # a peer that also stores its (valid, signed) record in a shard it does not hash to, to be read
        # by more peers, is listed only in its own
        forger = nodes[-1]
        forger.dht.store(
            record_key(RUN, 2),
            subkey=forger.signer.local_public_key,
            value=forger.record().dict(),
            expiration_time=get_dht_time() + 20,
        )
        assert forger.dht.get(record_key(RUN, 2), latest=True) is not None  # the node did store it
        assert list_members(reader.dht, RUN, member_shards=SHARDS, shards=[2]) == []


class _CountingGets:
    """Counts the member-shard keys a node's DHT reads, and its record stores."""

    def __init__(self, node: SwarmNode) -> None:
        self.reads = self.stores = 0
        get, store = node.dht.get, node.dht.store
        keys = {record_key(RUN, s) for s in range(SHARDS)}

        def counted_get(key, *args, **kwargs):
            self.reads += key in keys
            return get(key, *args, **kwargs)

        def counted_store(key, *args, **kwargs):
            self.stores += key in keys
            return store(key, *args, **kwargs)

        node.dht.get, node.dht.store = counted_get, counted_store


def test_a_trainers_view_reads_one_shard_at_a_time_and_finds_every_shard(tmp_path) -> None:
    with _nodes(tmp_path, [0, 1, 2, 3]) as nodes:
        viewer = nodes[0]
        counted = _CountingGets(viewer)
        viewer.recent_members()  # the first view: several shards at once
        first_reads = counted.reads
        assert first_reads == FIRST_READ_SHARDS
        others = {n.peer_id for n in nodes[1:]}
        # the announcer refreshes the view one shard at a time; within a rotation it has read them all,
        # and records (20 s) outlive a rotation (4 reads, a read every other 0.5 s refresh), so the view
        # holds every peer
        wait_until(
            lambda: others <= {m.peer_id for m in viewer.recent_members()}, 30, "a view of all four shards"
        )
        stores_before, reads_before = counted.stores, counted.reads
        wait_until(lambda: counted.stores >= stores_before + 6, 30, "six more announcements")
        refreshes = counted.stores - stores_before
        # one shard every SHARD_READ_EVERY refreshes (give or take the refresh in flight), not all four
        reads = counted.reads - reads_before
        assert reads <= refreshes // SHARD_READ_EVERY + 1, (reads, refreshes)


@pytest.mark.multipeer
@pytest.mark.timeout(300)
def test_trainers_of_a_sharded_run_find_each_other_and_exchange(tmp_path) -> None:
    """Three trainers in three different shards of four: each reads one shard at a time, yet every one
    exchanges with partners whose records it never reads in its own shard."""
    sets = [*TINY, "run.member_shards=4", "averaging.partners=random", "averaging.sync_every_steps=5"]
    config = load_config(None, overrides=[*sets, "train.max_steps=100000"], env={})
    identities = _identities(tmp_path, [0, 1, 3])
    runners: list[_Runner] = []
    try:
        for identity in identities:
            peers = runners[0].peer.node.visible_maddrs() if runners else []
            network = NetworkOptions(initial_peers=peers, identity_path=str(identity))
            runner = _Runner(config, network)
            runners.append(runner.start())
        ids = [runner.peer.node.peer_id for runner in runners]

        def partners_of(runner: _Runner) -> set[str]:
            return {r.partner for r in runner.reports if r.outcome == "ok" and r.partner in ids}

        # every trainer applied exchanges with partners of other shards (all partners are: one per shard)
        wait_until(
            lambda: (
                all(partners_of(r) for r in runners) and len(set().union(*map(partners_of, runners))) == 3
            ),
            timeout=200,
            what="each trainer to exchange, and every trainer to be someone's partner",
        )
    finally:
        for runner in reversed(runners):
            runner.close()
