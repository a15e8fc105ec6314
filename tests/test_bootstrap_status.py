"""What the organizer's terminal says: the state mirror's status (what it holds, from how many donors,
or why nothing), `--state-min-donors`, the bootstrap's status lines and summary, and the run's totals
that outlive the trainers (the bootstrap keeps them; a monitor that trusts it shows a finished run)."""

from __future__ import annotations

import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

import peers.bootstrap
from peers._monitor_table import header_lines
from peers.bootstrap import mirror_line, status_lines, summary_line
from peers.cli import app
from swarm.membership import Member, PeerRecord
from swarm.metrics import RunWatch, build_snapshot
from swarm.state import StateMirror, make_snapshot
from tests.test_metrics import HASH, POLICY, T0, member, pid

runner = CliRunner()
RUN = "status-run"


class _Server:
    """A StateServer stand-in: the mirror publishes here."""

    def __init__(self) -> None:
        self.published: list[Any] = []

    def can_publish(self) -> bool:
        return True

    def publish(self, snapshot: Any) -> None:
        self.published.append(snapshot)

    def close(self) -> None:
        pass


def _trainer(n: int) -> Member:
    record = PeerRecord(
        peer_id=pid(n),
        protocol_version=1,
        package_version="0",
        config_hash="ab",
        role="trainer",
        state_hash=f"{n:02x}" * 32,
    )
    return Member(peer_id=pid(n), record=record, expires_at=time.time() + 60)


def mirror_node(members: list[Member], run_id: str) -> Any:
    """What a :class:`StateMirror` needs of its node: the members it sees, its id and run; no DHT."""
    return SimpleNamespace(
        dht=None,
        members=lambda: members,
        peer_id="mirror",
        info=SimpleNamespace(run_id=run_id),
        announce_now=lambda: None,
    )


def _mirror(members: list[Member], **options: Any) -> tuple[StateMirror, list[list[tuple[str, str]]]]:
    """A mirror over ``members`` whose downloads return a fixed state (step 7) from the donors asked."""
    asked: list[list[tuple[str, str]]] = []

    def download(source: Any, donors: list[tuple[str, str]], **kw: Any):
        asked.append(donors)
        meta = {"round": 3, "step": 7, "samples_total": 1234}
        snapshot = make_snapshot({"w": torch.ones(4)}, meta)
        return dataclasses.replace(snapshot, sources=tuple(peer for peer, _ in donors))

    mirror = StateMirror(mirror_node(members, RUN), server=_Server(), download=download, **options)  # type: ignore[arg-type]
    return mirror, asked


@pytest.mark.parametrize(
    ("trainers", "reason"),
    [
        (0, "no trainer is live (it needs 3 distinct trainer states)"),
        (1, "fewer than 3 trainers live: 1"),
        (2, "fewer than 3 trainers live: 2"),
    ],
)
def test_the_mirror_says_why_it_holds_nothing(trainers: int, reason: str) -> None:
    mirror, asked = _mirror([_trainer(n) for n in range(1, trainers + 1)])
    assert mirror.refresh() is False and asked == []
    status = mirror.status
    assert not status.holding and status.live_trainers == trainers and status.refreshes == 1
    assert status.describe() == f"holds no state yet: {reason}"
    line = mirror_line(mirror)
    if trainers:  # the way out, for an organizer who trusts their trainers
        assert line.endswith(
            f"(--state-min-donors {trainers} keeps it from fewer, if you trust your trainers)"
        )
    else:
        assert "--state-min-donors" not in line


def test_with_fewer_donors_allowed_it_keeps_and_names_the_state_and_its_donors() -> None:
    members = [_trainer(1), _trainer(2)]
    mirror, asked = _mirror(members, min_donors=2)
    assert mirror.refresh() is True and len(asked[0]) == 2
    status = mirror.status
    assert status.holding and status.donors == 2
    assert (status.step, status.round, status.samples_total) == (7, 3, 1234)
    text = status.describe(now=status.taken_at + 5)
    assert text == "serving step 7 (round 3, 1234 samples), the median of 2 trainer state(s), taken 5s ago"
    members.pop()  # one trainer left: the copy is kept, and the line says why nothing newer came
    assert mirror.refresh() is False and mirror.status.holding
    assert mirror_line(mirror).endswith("; kept at the last refresh: fewer than 2 trainers live: 1")


def test_state_min_donors_needs_serve_state_and_a_positive_count(monkeypatch) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr(peers.bootstrap, "run_bootstrap", lambda cfg, network, **kw: seen.update(kw))
    refused = runner.invoke(app, ["bootstrap", "--state-min-donors", "2"])
    assert refused.exit_code == 2 and "--state-min-donors needs --serve-state" in refused.output
    assert runner.invoke(app, ["bootstrap", "--serve-state", "--state-min-donors", "0"]).exit_code == 2
    taken = runner.invoke(app, ["bootstrap", "--serve-state", "--state-min-donors", "1"])
    assert taken.exit_code == 0, taken.output
    assert seen["state_min_donors"] == 1 and seen["serve_state"] is True


def _watch_policy():
    return dataclasses.replace(POLICY, stale_after_s=6.0)


def test_the_bootstrap_names_joins_and_leaves_and_keeps_the_run_totals() -> None:
    now = [T0]
    watch = RunWatch(_watch_policy(), self_id=pid(9), clock=lambda: now[0])
    own = member(9, T0, role="bootstrap", state="idle", samples_total=999_999)  # its own record: left out
    change = watch.observe([own, member(1, T0, samples_total=100), member(2, T0, samples_total=50)])
    assert [p.public_name for p in change.joined] == ["p1", "p2"] and change.left == ()
    now[0] = T0 + 3
    change = watch.observe([own, member(1, T0 + 3, samples_total=160, step=4)])  # p2's record expired
    assert [p.public_name for p in change.left] == ["p2"] and watch.live_trainers == 1
    for t in (T0 + 20, T0 + 40):  # both gone, long past the stale window: retired, still counted
        now[0] = t
        change = watch.observe([own])
    assert watch.live_trainers == 0 and watch.samples_total == 210 and watch.step == 4
    assert watch.record_fields() == {"samples_total": 210, "step": 4, "round": 0}
    assert len(watch.seen) == 2 and watch.peak_trainers == 2
    lines = status_lines(watch, None)
    assert lines == [
        "bootstrap: 0 trainer(s) live, 210 samples trained (0.0 samples/s), step 4, 2 trainer(s) seen"
    ]
    summary = summary_line(watch, None)
    assert "2 trainer(s) joined (at most 2 at once), 210 samples trained, step 4" in summary


def test_a_monitor_started_after_the_trainers_left_shows_a_finished_run() -> None:
    """The trainers are gone; only the bootstrap's record is left, carrying the run's totals."""
    boot = member(9, T0, role="bootstrap", state="idle", samples_total=106_500, step=3000)
    trusting = dataclasses.replace(POLICY, trusted_peers=frozenset({pid(9)}))
    seen = build_snapshot([boot], None, T0, trusting)
    assert seen.totals.samples_total == 106_500 and seen.totals.trainers == 0
    assert seen.totals.run_state == "finished"
    header = " ".join(line.plain for line in header_lines(seen))
    assert "finished (no trainer live)" in header and "106.5k samples trained" in header
    assert seen.to_dict()["totals"]["run_state"] == "finished"
    # anyone can announce a "bootstrap" record: one that is not an initial peer adds nothing
    untrusted = build_snapshot([boot], None, T0, POLICY)
    assert untrusted.totals.samples_total == 0 and untrusted.totals.run_state == "waiting"


def test_live_trainers_and_the_bootstraps_count_are_not_added_twice() -> None:
    trusting = dataclasses.replace(POLICY, trusted_peers=frozenset({pid(9)}))
    boot = member(9, T0, role="bootstrap", state="idle", samples_total=300)
    live = [member(1, T0, samples_total=200), member(2, T0, samples_total=150)]
    seen = build_snapshot([boot, *live], None, T0, trusting)
    assert seen.totals.samples_total == 350 and seen.totals.run_state == "training"  # max, not the sum
    assert seen.to_dict()["reference_config_hash"] == HASH
