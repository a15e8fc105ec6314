"""swarm.membership: signed records, live member lists, expiry, and rejection of bad records."""

from __future__ import annotations

import signal
import sys
import threading
import time

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm import NetworkOptions, NodeInfo, PeerRecord, SwarmNode
from swarm._periodic import PeriodicTask
from swarm.membership import record_key
from swarm.network import ensure_identity, load_identity
from tests._processes import PeerProcess, wait_until

RUN = "test-run"
TTL_S = 4.0


def _start_worker(spawn, initial_peer: str | None) -> PeerProcess:
    args = [sys.executable, "-m", "tests.workers.membership", "--run-id", RUN, "--ttl", str(TTL_S)]
    return spawn(args + (["--initial-peer", initial_peer] if initial_peer else []))


def _ready(process: PeerProcess) -> tuple[str, str]:
    _, peer_id, maddr = process.wait_for_line(lambda line: line.startswith("READY"), timeout=90).split()
    return peer_id, maddr


def _sees(process: PeerProcess, expected: set[str], timeout: float) -> None:
    process.wait_for_line(
        lambda line: line.startswith("MEMBERS") and set(line[8:].split(",")) == expected, timeout
    )


@pytest.mark.multipeer
def test_five_peers_list_each_other_and_a_killed_one_expires(spawn) -> None:
    first = _start_worker(spawn, None)
    first_id, maddr = _ready(first)
    others = [_start_worker(spawn, maddr) for _ in range(4)]  # start together, then wait for each
    workers = [(first, first_id)] + [(process, _ready(process)[0]) for process in others]
    everyone = {peer_id for _, peer_id in workers}
    started = time.monotonic()
    for process, _ in workers:
        _sees(process, everyone, timeout=max(1.0, 15 - (time.monotonic() - started)))

    victim, victim_id = workers[-1]
    victim.signal(signal.SIGKILL)  # its main process only: its DHT worker must stop p2pd by itself
    survivors = workers[:-1]
    marks = [process.mark() for process, _ in survivors]
    # the victim's last record expires TTL_S after it was written: every survivor drops it then (the
    # deadline allows a few record intervals past the ttl) and still lists all the others
    for (process, _), mark in zip(survivors, marks, strict=True):
        process.wait_for_line(
            lambda line: line.startswith("MEMBERS") and set(line[8:].split(",")) == everyone - {victim_id},
            timeout=TTL_S + 10,
            since=mark,
        )


def _node(run_id: str = RUN, initial_peers: list[str] | None = None, **info) -> SwarmNode:
    node_info = NodeInfo(run_id=run_id, config_hash="ab12", role=info.pop("role", "trainer"), **info)
    return SwarmNode(NetworkOptions(initial_peers=initial_peers or []), node_info, record_ttl_s=30)


def _rogue_dht(initial_peers: list[str], validators: list) -> hivemind.DHT:
    return hivemind.DHT(initial_peers=initial_peers, start=True, record_validators=validators)


def _record_dict(peer_id: str, **changes) -> dict:
    return {
        **PeerRecord(
            peer_id=peer_id, protocol_version=1, package_version="x", config_hash="ab", role="trainer"
        ).dict(),
        **changes,
    }


def test_bad_records_are_never_listed(tmp_path) -> None:
    honest = _node(public_name="honest")
    maddrs = honest.visible_maddrs()
    observer = _node(initial_peers=maddrs, role="bootstrap")
    key = record_key(RUN)
    expiration = get_dht_time() + 30
    forger_key = load_identity(ensure_identity(tmp_path / "forger.key"))
    signer = RSASignatureValidator(forger_key)
    unsigned = _rogue_dht(maddrs, [])
    signed_only = _rogue_dht(maddrs, [signer])
    try:
        fake_owner = RSASignatureValidator(RSAPrivateKey()).local_public_key
        # 1. a record under someone's owner marker without a valid signature
        unsigned.store(
            key,
            subkey=fake_owner,
            value=_record_dict(unsigned.peer_id.to_base58()),
            expiration_time=expiration,
        )
        # 2. correctly signed, but not matching the schema (unknown field, wrong type)
        bad_schema = _record_dict(signed_only.peer_id.to_base58(), step="many", extra_field=1)
        signed_only.store(key, subkey=signer.local_public_key, value=bad_schema, expiration_time=expiration)
        # 3. correctly signed and well-formed, but claiming the honest peer's identity
        forged = _record_dict(honest.peer_id, public_name="forged")
        signed_only.store(key, subkey=signer.local_public_key, value=forged, expiration_time=expiration)
        # 4. a plain non-record value under the key
        unsigned.store(key, subkey=b"junk", value=b"\xff" * 10, expiration_time=expiration)

        wait_until(lambda: len(observer.members()) == 2, timeout=15, what="both honest peers to be listed")
        for viewer in (honest, observer):
            members = viewer.members()
            assert {m.peer_id for m in members} == {honest.peer_id, observer.peer_id}
            assert {m.record.public_name for m in members} == {"honest", ""}
    finally:
        for dht in (unsigned, signed_only):
            dht.shutdown()
        observer.close()
        honest.close()


def test_record_carries_status_and_static_info() -> None:
    status = {"state": "training", "step": 7, "loss": 2.5, "samples_per_s": 12.0, "bytes_sent": 10}
    with SwarmNode(
        NetworkOptions(),
        NodeInfo(RUN, "ab12", "trainer", public_name="n1", device="cpu"),
        status=lambda: status,
    ) as node:
        [member] = node.members()
    assert member.record.public_name == "n1"
    assert (member.record.state, member.record.step, member.record.loss) == ("training", 7, 2.5)
    assert member.record.addresses and member.record.addresses[0].endswith(node.peer_id)


def test_unknown_status_field_fails_loudly() -> None:
    with pytest.raises(Exception, match="no_such_field"):
        SwarmNode(NetworkOptions(), NodeInfo(RUN, "ab12", "trainer"), status=lambda: {"no_such_field": 1})


def test_announce_soon_publishes_in_the_background_and_recent_members_follow() -> None:
    """The training thread's calls: neither waits on the DHT, yet the record and the view catch up
    within a record interval (an hour here, so only the trigger can explain a prompt update)."""
    status = {"state": "training", "step": 1}
    with SwarmNode(
        NetworkOptions(), NodeInfo(RUN, "ab12", "trainer"), status=lambda: status, record_interval_s=3600,
        record_ttl_s=7200,
    ) as node:  # fmt: skip
        [first] = node.recent_members()  # the first call reads at once
        assert first.record.step == 1
        status["step"] = 2
        node.announce_soon()
        wait_until(lambda: [m.record.step for m in node.members()] == [2], 30, "the triggered announcement")
        # the announcer thread reads the members right after storing: the view follows without a lookup here
        wait_until(lambda: [m.record.step for m in node.recent_members()] == [2], 30, "the view to follow")


def test_a_triggered_periodic_task_runs_once_more_and_stops_cleanly() -> None:
    calls: list[int] = []
    ran = threading.Event()

    def action() -> None:
        calls.append(len(calls))
        ran.set()

    task = PeriodicTask(action, interval_s=3600, name="test-task")
    task.start()  # the first call is synchronous
    assert calls == [0]
    ran.clear()
    task.trigger()
    assert ran.wait(30), "a trigger did not run the action"
    task.stop()
    assert calls == [0, 1] and not task._thread.is_alive()
