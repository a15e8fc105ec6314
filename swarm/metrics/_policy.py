"""What the observer compares peers against: thresholds and its own protocol / config identity."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_DRIFT = 0.05
"""Relative drift (a peer's distance to the swarm mean over the mean's norm) above which we warn."""


@dataclass(frozen=True)
class SnapshotPolicy:
    """Inputs of :func:`~swarm.metrics.build_snapshot` that do not come from the records.

    ``config_hash`` is the observer's own run-config hash: when at least one peer shares it, it is the
    reference; otherwise the most common hash among the peers is (so a monitor started without the
    run's config file still flags the odd one out rather than everybody).
    """

    protocol_version: int
    config_hash: str = ""
    run_id: str = ""
    stale_after_s: float = 30.0
    record_ttl_s: float = 10.0
    max_drift: float = DEFAULT_MAX_DRIFT
    clock_skew_tolerance_s: float = 5.0
    target_samples: int | None = None
    trusted_peers: frozenset[str] = frozenset()
    """Peer ids whose ``bootstrap`` record's counters are the run's totals (the initial peers the user
    named): a bootstrap keeps counting the samples of trainers that left, so a monitor started after
    they left still shows what the run trained. Any other record claiming to be a bootstrap adds nothing."""
