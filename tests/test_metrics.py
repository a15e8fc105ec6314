"""swarm.metrics: snapshot computations (rates, states, totals, ETA, warnings) and history, no network."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.membership import PROTOCOL_VERSION, PeerRecord
from swarm.metrics import SCHEMA_VERSION, HistoryWriter, SnapshotPolicy, build_snapshot, read_history

T0 = 1_700_000_000.0
TTL = 10.0
HASH = "ab" * 8
POLICY = SnapshotPolicy(protocol_version=PROTOCOL_VERSION, config_hash=HASH, run_id="r", record_ttl_s=TTL)


def pid(n: int) -> str:
    return "Qm" + "abcdefghijkmnopqrstuvwxyzABCDEFG"[:30] + "123456789"[n % 9] * 2


@dataclass(frozen=True)
class M:
    peer_id: str
    record: Any
    expires_at: float


def member(n: int, announced_at: float, **fields: Any) -> M:
    values = dict(
        peer_id=pid(n),
        protocol_version=PROTOCOL_VERSION,
        package_version="0.1.0",
        config_hash=HASH,
        role="trainer",
        state="training",
        public_name=f"p{n}",
        started_at=T0 - 100,
    )
    values.update(fields)
    return M(pid(n), PeerRecord(**values), announced_at + TTL)


def snap(members, previous=None, now=T0, policy=POLICY):
    return build_snapshot(members, previous, now, policy)


def peer(snapshot, n: int):
    return next(p for p in snapshot.peers if p.peer_id == pid(n))


def test_rates_come_from_counter_deltas_between_announcements() -> None:
    first = snap([member(1, T0, bytes_sent=1000, bytes_received=500, round=2, step=10)])
    assert peer(first, 1).upload_bps is None
    second = snap([member(1, T0 + 4, bytes_sent=5000, bytes_received=2500, round=4, step=20)], first, T0 + 5)
    p = peer(second, 1)
    assert p.upload_bps == pytest.approx(1000.0)
    assert p.download_bps == pytest.approx(500.0)
    assert p.syncs_per_min == pytest.approx(30.0)
    assert second.totals.upload_bps == pytest.approx(1000.0)
    assert second.totals.syncs_per_min == pytest.approx(30.0)


def test_unchanged_record_keeps_previous_rates() -> None:
    a = snap([member(1, T0, bytes_sent=0)])
    b = snap([member(1, T0 + 2, bytes_sent=2000)], a, T0 + 2)
    c = snap([member(1, T0 + 2, bytes_sent=2000)], b, T0 + 3)
    assert peer(c, 1).upload_bps == peer(b, 1).upload_bps == pytest.approx(1000.0)


def test_counters_going_backwards_mean_restart_and_retire_samples() -> None:
    a = snap([member(1, T0, samples_total=5000, bytes_sent=10**9, step=50)])
    b = snap([member(1, T0 + 3, samples_total=10, bytes_sent=100, step=1)], a, T0 + 3)
    p = peer(b, 1)
    assert p.upload_bps is None and p.download_bps is None
    assert b.retired_samples == 5000
    assert b.totals.samples_total == 5010


def test_new_started_at_is_a_restart_even_if_counters_grew() -> None:
    a = snap([member(1, T0, bytes_sent=10)])
    b = snap([member(1, T0 + 3, bytes_sent=20, started_at=T0 + 1)], a, T0 + 3)
    assert peer(b, 1).upload_bps is None


def test_states_incompatible_stale_and_reported() -> None:
    members = [
        member(1, T0, state="training"),
        member(2, T0, state="joining"),
        member(3, T0, config_hash="cd" * 8),
        member(4, T0, protocol_version=PROTOCOL_VERSION + 1),
        member(5, T0 - 40, state="idle"),
    ]
    s = snap(members)
    assert [peer(s, n).state for n in range(1, 6)] == [
        "training",
        "joining",
        "incompatible",
        "incompatible",
        "stale",
    ]
    assert s.totals.incompatible == 2 and s.totals.stale == 1
    kinds = {(w.kind, w.peer_id) for w in s.warnings}
    assert ("config_mismatch", pid(3)) in kinds and ("protocol_mismatch", pid(4)) in kinds
    assert ("stale", pid(5)) in kinds


def test_learning_peer_without_progress_becomes_stale() -> None:
    a = snap([member(1, T0, step=5)])
    b = snap([member(1, T0 + 20, step=5)], a, T0 + 20)
    c = snap([member(1, T0 + 40, step=5)], b, T0 + 40)
    assert peer(b, 1).state == "training" and peer(c, 1).state == "stale"
    d = snap([member(1, T0 + 42, step=6)], c, T0 + 42)
    assert peer(d, 1).state == "training"


def test_departed_peer_stays_stale_then_is_dropped_and_its_samples_kept() -> None:
    a = snap([member(1, T0, samples_total=100), member(2, T0, samples_total=50)])
    b = snap([member(1, T0 + 15, samples_total=200)], a, T0 + 15)
    assert peer(b, 2).state == "stale" and not peer(b, 2).present
    assert b.totals.peers == 1 and b.totals.samples_total == 250
    c = snap([member(1, T0 + 40, samples_total=300)], b, T0 + 40)
    assert [p.peer_id for p in c.peers] == [pid(1)]
    assert c.totals.samples_total == 350


def test_reference_hash_is_the_observers_if_shared_else_the_majority() -> None:
    other = "ef" * 8
    members = [member(1, T0, config_hash=other), member(2, T0, config_hash=other), member(3, T0)]
    assert snap(members).reference_config_hash == HASH
    s = snap([*members[:2], member(3, T0, config_hash="01" * 8)])
    assert s.reference_config_hash == other
    assert peer(s, 3).state == "incompatible" and peer(s, 1).state == "training"


def test_totals_loss_throughput_progress_and_eta() -> None:
    policy = SnapshotPolicy(
        protocol_version=PROTOCOL_VERSION, config_hash=HASH, record_ttl_s=TTL, target_samples=10_000
    )
    members = [
        member(1, T0, samples_per_s=100.0, samples_total=2000, loss=3.0, eval_loss=3.5),
        member(2, T0, samples_per_s=300.0, samples_total=4000, loss=2.0, eval_loss=2.5),
        member(3, T0, samples_per_s=1e6, samples_total=10**6, loss=0.1, eval_loss=0.1, config_hash="cd" * 8),
        member(4, T0, role="bootstrap", state="idle"),
    ]
    t = snap(members, policy=policy).totals
    assert t.peers == 4 and t.trainers == 2
    assert t.samples_per_s == 400.0 and t.samples_total == 6000
    assert t.loss_mean == pytest.approx(2.5) and t.loss_best == 2.0
    assert t.eval_loss_mean == pytest.approx(3.0)  # the incompatible peer's is left out
    assert t.progress == pytest.approx(0.6) and t.eta_s == pytest.approx(10.0)


def test_losses_are_averaged_in_the_unit_peers_report_and_say_it() -> None:
    members = [
        member(1, T0, loss=5.0, eval_loss=5.5, eval_bits_per_byte=1.5, loss_unit="bits/token"),
        member(2, T0, loss=4.0, eval_loss=4.5, eval_bits_per_byte=1.25, loss_unit="bits/token"),
        member(3, T0, loss=0.5, eval_loss=0.5, eval_bits_per_byte=0.5),  # a record in bits/byte (the default)
    ]
    s = snap(members)
    assert (peer(s, 1).loss_unit, peer(s, 1).eval_bits_per_byte) == ("bits/token", 1.5)
    assert peer(s, 3).loss_unit == "bits/byte"
    t = s.totals
    assert t.loss_unit == "bits/token"  # the majority's; the peer in another unit is not averaged in
    assert (t.loss_mean, t.loss_best, t.eval_loss_mean) == (4.5, 4.0, 5.0)
    assert t.eval_bits_per_byte_mean == pytest.approx(1.375)
    doc = s.to_dict()
    assert doc["totals"]["loss_unit"] == "bits/token" and doc["peers"][0]["loss_unit"] == "bits/token"
    byte_level = snap([member(1, T0, loss=3.0)]).totals
    assert (byte_level.loss_unit, byte_level.loss_mean, byte_level.eval_bits_per_byte_mean) == (
        "bits/byte",
        3.0,
        None,
    )
    hostile = SimpleNamespace(**{**members[0].record.dict(), "loss_unit": "nats", "eval_bits_per_byte": -1.0})
    view = snap([M(pid(1), hostile, T0 + TTL)]).peers[0]
    assert (view.loss_unit, view.eval_bits_per_byte) == ("bits/byte", None)


def test_eta_unknown_without_throughput_and_zero_when_done() -> None:
    policy = SnapshotPolicy(
        protocol_version=PROTOCOL_VERSION, config_hash=HASH, record_ttl_s=TTL, target_samples=100
    )
    assert snap([member(1, T0, samples_total=10)], policy=policy).totals.eta_s is None
    done = snap([member(1, T0, samples_total=500, samples_per_s=1.0)], policy=policy).totals
    assert done.eta_s == 0.0 and done.progress == 1.0


def test_warnings_version_skew_drift_and_clock_skew() -> None:
    members = [
        member(1, T0, package_version="0.1.0", drift=0.5),
        member(2, T0, package_version="0.2.0", drift=0.01),
        member(3, T0 + 3600),
    ]
    s = snap(members)
    kinds = {(w.kind, w.peer_id) for w in s.warnings}
    assert ("version_skew", None) in kinds
    assert ("drift", pid(1)) in kinds and ("drift", pid(2)) not in kinds
    assert ("clock_skew", pid(3)) in kinds
    assert peer(s, 3).last_seen == T0  # an announce time from the future is clamped to now
    assert peer(s, 3).state == "training"


def test_hostile_values_are_sanitised_not_fatal() -> None:
    garbage = SimpleNamespace(
        peer_id=pid(1),
        protocol_version="one",
        package_version=None,
        config_hash=123,
        public_name="x" * 10_000,
        role=None,
        state=["training"],
        device=b"gpu",
        device_memory_gb=float("nan"),
        samples_per_s=float("inf"),
        round=-5,
        step=10**400,
        samples_total=True,
        loss=float("-inf"),
        eval_loss="low",
        drift=-1.0,
        bytes_sent=10**30,
        bytes_received=-(10**30),
        exchanges_ok=1.5,
        client_mode="yes",
        addresses=["/ip4/1.2.3.4"] * 100,
        reachability=7,
        started_at=1e300,
    )
    s = snap([M(pid(1), garbage, float("nan")), M("", garbage, T0), M(None, garbage, T0)])
    assert len(s.peers) == 1
    p = s.peers[0]
    assert p.step == 2**63 - 1 and p.round == 0 and p.samples_total == 0
    assert p.samples_per_s == 0.0 and p.loss is None and p.drift is None
    assert len(p.public_name) == 64 and len(p.addresses) == 16 and p.state == "incompatible"
    json.dumps(s.to_dict(), allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(
    counters=st.lists(st.integers(0, 2**63 - 1), min_size=3, max_size=3),
    later=st.lists(st.integers(0, 2**63 - 1), min_size=3, max_size=3),
    rate=st.floats(0, 1e18),
    skew=st.floats(-1e6, 1e6),
)
def test_extreme_but_valid_records_always_give_a_json_snapshot(counters, later, rate, skew) -> None:
    a = snap([member(1, T0 + skew, samples_total=counters[0], bytes_sent=counters[1], round=counters[2])])
    fields = dict(samples_total=later[0], bytes_sent=later[1], round=later[2], samples_per_s=rate)
    b = snap([member(1, T0 + 3 + skew, **fields)], a, T0 + 3)
    doc = json.loads(json.dumps(b.to_dict(), allow_nan=False))
    assert doc["schema_version"] == SCHEMA_VERSION
    assert all(v is None or v >= 0 for v in (b.peers[0].upload_bps, b.totals.samples_per_s))


def test_history_roundtrip_skips_torn_lines(tmp_path) -> None:
    path = tmp_path / "sub" / "history.jsonl"
    writer = HistoryWriter(path)
    first = snap([member(1, T0, loss=2.0)])
    writer.append(first)
    writer.append(snap([member(1, T0 + 2, loss=1.5)], first, T0 + 2))
    with path.open("a") as file:
        file.write('{"schema_version": 1, "peers": [\n\n[1, 2]\n')
    rows = read_history(path)
    assert [r["peers"][0]["loss"] for r in rows] == [2.0, 1.5]


def test_trainer_writes_its_own_history(tmp_path) -> None:
    writer = HistoryWriter(tmp_path / "own.jsonl", POLICY)
    writer.append_record(member(1, T0, bytes_sent=0).record, T0)
    last = writer.append_record(member(1, T0, bytes_sent=3000).record, T0 + 3)
    assert last.peers[0].upload_bps == pytest.approx(1000.0)
    assert len(read_history(tmp_path / "own.jsonl")) == 2
    with pytest.raises(ValueError):
        HistoryWriter(tmp_path / "x.jsonl").append_record(member(1, T0).record, T0)
