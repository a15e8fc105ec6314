"""Outcome of one sync, and the averager's running counters.

Counters are per peer and cover both roles (exchanges this peer initiated and ones it served):

- ``exchanges_ok``: committed exchanges;
- ``exchanges_failed``: exchanges that died (connection lost, protocol error, timeout, the partner
  rejected our data or refused the handshake, dial failure);
- ``exchanges_busy``: BUSY answers received while looking for a partner;
- ``exchanges_rejected``: exchanges where *we* rejected the partner's data (schema, NaN/Inf, norm);
- ``no_partner``: sync calls that found nobody eligible to dial;
- ``exchanges_clipped``: committed exchanges whose partner difference the robust rule clipped;
- ``exchanges_suspect``: of those, the ones clipped hard enough to count against the partner.

:data:`FAILURES` counts the exchanges that did not commit (BUSY answers aside) in this process, by role
and cause, as :func:`log_failure` logs them.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from collections import Counter
from dataclasses import dataclass

logger = logging.getLogger(__name__)


class SyncOutcome(enum.Enum):
    OK = "ok"
    NO_PARTNER = "no_partner"
    BUSY = "busy"
    FAILED = "failed"
    REJECTED = "rejected"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class SyncResult:
    """What one :meth:`GossipAverager.sync` call did. ``weight`` is the weight we offered to the
    exchange that ended it (0 when none took our offer)."""

    outcome: SyncOutcome
    partner: str | None
    bytes_sent: int
    bytes_received: int
    latency_s: float
    weight: float
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.outcome is SyncOutcome.OK


@dataclass(frozen=True)
class ExchangeMetrics:
    """A peer's averaging counters (module docstring): a gossip averager's, and the shape in which
    every averaging backend reports its rounds (the hivemind and all-reduce baselines count their
    rounds as exchanges)."""

    exchanges_ok: int = 0
    exchanges_failed: int = 0
    exchanges_busy: int = 0
    exchanges_rejected: int = 0
    no_partner: int = 0
    exchanges_clipped: int = 0
    exchanges_suspect: int = 0
    exchanges_relative: int = 0
    """Committed exchanges that sent the models relative to a shared base (:mod:`swarm.gossip._bases`)."""
    bases_pushed: int = 0
    """Bases we pushed that the partner took."""
    base_bytes_sent: int = 0
    """Of ``bytes_sent``, what base pushes sent: traffic overlapped with training, not after a round."""
    bytes_sent: int = 0
    bytes_received: int = 0
    last_latency_s: float = 0.0
    mean_latency_s: float = 0.0
    """Of the committed exchanges, the data phase's seconds (the handshake done, to the commit)."""
    mean_dial_latency_s: float = 0.0
    """Seconds from dialling a partner of our own sync to its answer (accepted, busy or refused)."""


class MetricsRecorder:
    """Thread-safe accumulation of :class:`ExchangeMetrics`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        names = (
            "ok",
            "failed",
            "busy",
            "rejected",
            "no_partner",
            "clipped",
            "suspect",
            "donated",
            "relative",
            "pushed",
        )
        self._counts = dict.fromkeys(names, 0)
        self._sent = 0
        self._received = 0
        self._base_sent = 0
        self._last_latency = 0.0
        self._latency_sum = 0.0
        self._dials = 0
        self._dial_sum = 0.0

    def count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def add_bytes(self, sent: int, received: int, *, base: bool = False) -> None:
        """Stream bytes both ways; ``base``: they were a base push's."""
        with self._lock:
            self._sent += sent
            self._received += received
            self._base_sent += sent if base else 0

    def record_ok(self, latency_s: float) -> None:
        with self._lock:
            self._counts["ok"] += 1
            self._last_latency = latency_s
            self._latency_sum += latency_s

    def record_dial(self, seconds: float) -> None:
        with self._lock:
            self._dials += 1
            self._dial_sum += seconds

    def snapshot(self) -> ExchangeMetrics:
        with self._lock:
            ok = self._counts["ok"]
            return ExchangeMetrics(
                exchanges_ok=ok,
                exchanges_failed=self._counts["failed"],
                exchanges_busy=self._counts["busy"],
                exchanges_rejected=self._counts["rejected"],
                no_partner=self._counts["no_partner"],
                exchanges_clipped=self._counts["clipped"],
                exchanges_suspect=self._counts["suspect"],
                exchanges_relative=self._counts["relative"],
                bases_pushed=self._counts["pushed"],
                bytes_sent=self._sent,
                base_bytes_sent=self._base_sent,
                bytes_received=self._received,
                last_latency_s=self._last_latency,
                mean_latency_s=self._latency_sum / ok if ok else 0.0,
                mean_dial_latency_s=self._dial_sum / self._dials if self._dials else 0.0,
            )


_PEER_ID = re.compile(r"^(?:\S+ )?\S{40,}: ")  # "12D3KooW...: " before a dialled partner's answer


MAX_CAUSE_CHARS = 80
"""A cause is cut to this length: a partner's refusal is its own text (any length)."""
MAX_CAUSES = 64
"""Distinct causes counted per role; later new ones count as :data:`OTHER_CAUSE`. A partner's
refusal text is part of a cause, so a hostile partner could otherwise grow the counts (and every
summary) by one entry per refusal."""
OTHER_CAUSE = "other causes"


def failure_cause(stage: str, outcome: SyncOutcome, reason: str) -> str:
    """``STAGE OUTCOME: KIND``, KIND being the reason's first part (an exception name, "exchange timed
    out", a partner's refusal) without the partner id in front of it, at most
    :data:`MAX_CAUSE_CHARS` long."""
    text = _PEER_ID.sub("", reason.strip(), count=1)
    kind = text.split(":", 1)[0].strip()[:MAX_CAUSE_CHARS] or "no reason given"
    return f"{stage} {outcome.value}: {kind}"


class FailureCounts:
    """Exchanges that did not commit, counted by role (``initiator``, ``responder``) and cause; at
    most :data:`MAX_CAUSES` distinct causes per role (then :data:`OTHER_CAUSE`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()
        self._named: Counter[str] = Counter()  # distinct causes per role, the OTHER_CAUSE bucket aside

    def add(self, role: str, cause: str) -> None:
        with self._lock:
            key = (role, cause)
            if key not in self._counts and self._named[role] >= MAX_CAUSES:
                key = (role, OTHER_CAUSE)
            elif key not in self._counts:
                self._named[role] += 1
            self._counts[key] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{role: {cause: count}}``, most frequent cause first."""
        with self._lock:
            counts = self._counts.most_common()
        by_role: dict[str, dict[str, int]] = {}
        for (role, cause), count in counts:
            by_role.setdefault(role, {})[cause] = count
        return by_role


FAILURES = FailureCounts()
"""Every averager's failed exchanges in this process (a trainer's summary reports them)."""


def log_failure(role: str, partner: str, stage: str, outcome: SyncOutcome, reason: str) -> None:
    """One INFO line per exchange that did not commit (BUSY answers aside), in a fixed shape:
    ``exchange failed as ROLE with PEER at STAGE (OUTCOME): REASON``; counted in :data:`FAILURES`."""
    FAILURES.add(role, failure_cause(stage, outcome, reason))
    logger.info("exchange failed as %s with %s at %s (%s): %s", role, partner, stage, outcome.value, reason)
