"""swarm/gossip/_metrics.py: exchanges that did not commit, counted by role and cause for the summary."""

from __future__ import annotations

from swarm.gossip import FAILURES, SyncOutcome
from swarm.gossip._metrics import (
    MAX_CAUSE_CHARS,
    MAX_CAUSES,
    OTHER_CAUSE,
    FailureCounts,
    failure_cause,
    log_failure,
)

PEER = "12D3KooW" + "x" * 44


def test_a_failure_cause_is_the_stage_outcome_and_the_reasons_first_part() -> None:
    assert failure_cause("data", SyncOutcome.TIMEOUT, "exchange timed out: chunk 3") == (
        "data timeout: exchange timed out"
    )
    dial = f"{PEER}: P2PDaemonError: failed to dial"
    assert failure_cause("handshake", SyncOutcome.FAILED, dial) == "handshake failed: P2PDaemonError"
    assert failure_cause("data", SyncOutcome.FAILED, "  ") == "data failed: no reason given"


def test_failures_are_counted_by_role_most_frequent_cause_first() -> None:
    counts = FailureCounts()
    counts.add("initiator", "handshake failed: P2PDaemonError")
    counts.add("responder", "data failed: IncompleteReadError")
    for _ in range(2):
        counts.add("initiator", "data timeout: exchange timed out")
    snapshot = counts.snapshot()
    assert snapshot == {
        "initiator": {"data timeout: exchange timed out": 2, "handshake failed: P2PDaemonError": 1},
        "responder": {"data failed: IncompleteReadError": 1},
    }
    assert list(snapshot["initiator"]) == [
        "data timeout: exchange timed out",
        "handshake failed: P2PDaemonError",
    ]


def test_each_logged_failure_is_counted_in_the_process_counts() -> None:
    cause = "data cancelled: aborted"
    before = FAILURES.snapshot().get("responder", {}).get(cause, 0)
    log_failure("responder", PEER, "data", SyncOutcome.CANCELLED, "aborted: shutting down")
    assert FAILURES.snapshot()["responder"][cause] == before + 1


def test_a_partner_cannot_grow_the_counts_with_ever_new_refusals() -> None:
    """A refusal's text is the partner's: each new one would be a new cause, without the caps."""
    counts = FailureCounts()
    for i in range(10 * MAX_CAUSES):
        reason = f"{PEER}: refused #{i} " + "x" * 10_000
        counts.add("initiator", failure_cause("handshake", SyncOutcome.REJECTED, reason))
    causes = counts.snapshot()["initiator"]
    assert len(causes) == MAX_CAUSES + 1  # the named ones and the rest
    assert sum(causes.values()) == 10 * MAX_CAUSES  # every failure still counted
    assert causes[OTHER_CAUSE] == 9 * MAX_CAUSES
    assert max(len(cause) for cause in causes) <= len("handshake rejected: ") + MAX_CAUSE_CHARS
