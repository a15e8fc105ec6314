"""One peer as the observer sees it: its record, sanitised, plus rates from the previous observation.

Records that reach us passed the schema validator, but this module still treats every number as
hostile (a hand-built record, a future schema, a peer whose counters reset): values are clamped to
finite bounds, counters that go backwards mean a restart (rates restart too), and announce times from
a clock that runs ahead are clamped to the observer's clock.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol, TypeGuard, cast

from swarm.metrics._policy import SnapshotPolicy

MAX_COUNT = 2**63 - 1
MAX_VALUE = 1e18
MAX_TIME = 1e12
MIN_RATE_INTERVAL_S = 0.05
ACTIVE_STATES = ("training", "syncing")
LOSS_UNITS = ("bits/byte", "bits/token")

Connectivity = Literal["direct", "relay", "client", "unknown"]


class MemberLike(Protocol):
    """What :func:`observe` needs of :class:`swarm.Member` (so callers may pass their own record)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def record(self) -> Any: ...
    @property
    def expires_at(self) -> float: ...


@dataclass(frozen=True)
class PeerView:
    """A peer in a :class:`~swarm.metrics.SwarmSnapshot`; its dict form is the JSON schema's peer."""

    peer_id: str
    public_name: str
    role: str
    state: str
    reported_state: str
    protocol_version: int
    package_version: str
    config_hash: str
    device: str
    device_memory_gb: float
    samples_per_s: float
    round: int
    step: int
    samples_total: int
    loss: float | None
    eval_loss: float | None
    drift: float | None
    bytes_sent: int
    bytes_received: int
    upload_bps: float | None
    download_bps: float | None
    syncs_per_min: float | None
    exchanges_ok: int
    exchanges_failed: int
    exchanges_rejected: int
    connectivity: Connectivity
    client_mode: bool
    addresses: list[str] = field(default_factory=list)
    started_at: float = 0.0
    last_seen: float = 0.0
    last_progress_at: float = 0.0
    expires_in_s: float | None = None
    present: bool = True
    compatible: bool = True
    stage: int = 0
    stage_capacity: float = 0.0
    eval_bits_per_byte: float | None = None
    loss_unit: str = "bits/byte"
    """What ``loss`` and ``eval_loss`` are in: bits per token, or per byte for byte-level data."""

    @property
    def short_id(self) -> str:
        return self.peer_id[-8:]

    @property
    def active(self) -> bool:
        """Counts toward live throughput and loss: compatible, not stale."""
        return self.compatible and self.state != "stale"

    def to_dict(self, now: float) -> dict[str, Any]:
        return {
            "short_id": self.short_id,
            **asdict(self),
            "last_seen_ago_s": _round(max(0.0, now - self.last_seen)),
        }


def observe(
    member: MemberLike, previous: PeerView | None, now: float, policy: SnapshotPolicy
) -> tuple[PeerView, int]:
    """Build the view of a present peer; also return samples to retire (a restart reset its counter)."""
    r = member.record
    expires_at = _clamp(member.expires_at, -MAX_TIME, MAX_TIME, default=now)
    last_seen = min(now, expires_at - policy.record_ttl_s)
    view = PeerView(
        peer_id=_text(member.peer_id, 64),
        public_name=_text(getattr(r, "public_name", ""), 64),
        role=_text(getattr(r, "role", ""), 16) or "unknown",
        state="",
        reported_state=_text(getattr(r, "state", ""), 16) or "unknown",
        protocol_version=_count(getattr(r, "protocol_version", 0)),
        package_version=_text(getattr(r, "package_version", ""), 32),
        config_hash=_text(getattr(r, "config_hash", ""), 64),
        device=_text(getattr(r, "device", ""), 128),
        device_memory_gb=_value(getattr(r, "device_memory_gb", 0.0)) or 0.0,
        samples_per_s=_value(getattr(r, "samples_per_s", 0.0)) or 0.0,
        round=_count(getattr(r, "round", 0)),
        step=_count(getattr(r, "step", 0)),
        samples_total=_count(getattr(r, "samples_total", 0)),
        loss=_value(getattr(r, "loss", None)),
        eval_loss=_value(getattr(r, "eval_loss", None)),
        drift=_value(getattr(r, "drift", None)),
        bytes_sent=_count(getattr(r, "bytes_sent", 0)),
        bytes_received=_count(getattr(r, "bytes_received", 0)),
        upload_bps=None,
        download_bps=None,
        syncs_per_min=None,
        exchanges_ok=_count(getattr(r, "exchanges_ok", 0)),
        exchanges_failed=_count(getattr(r, "exchanges_failed", 0)),
        exchanges_rejected=_count(getattr(r, "exchanges_rejected", 0)),
        connectivity=connectivity_of(r),
        client_mode=getattr(r, "client_mode", False) is True,
        addresses=[_text(a, 256) for a in list(getattr(r, "addresses", None) or [])[:16]],
        started_at=_clamp(getattr(r, "started_at", 0.0), 0.0, MAX_TIME, default=0.0),
        last_seen=last_seen,
        last_progress_at=last_seen,
        expires_in_s=_round(expires_at - now),
        stage=min(_count(getattr(r, "stage", 0)), 255),
        stage_capacity=_value(getattr(r, "stage_capacity", 0.0)) or 0.0,
        eval_bits_per_byte=_value(getattr(r, "eval_bits_per_byte", None)),
        loss_unit=_loss_unit(getattr(r, "loss_unit", None)),
    )
    if previous is None:
        return view, 0
    if _restarted(view, previous):
        return view, previous.samples_total
    return _with_rates(view, previous), 0


def vanished(previous: PeerView) -> PeerView:
    """A peer whose record expired: kept (stale) until ``stale_after_s`` after it was last seen."""
    return replace(
        previous, present=False, expires_in_s=None, upload_bps=None, download_bps=None, syncs_per_min=None
    )


def connectivity_of(record: Any) -> Connectivity:
    """direct / relay / client / unknown, from what the peer says about itself."""
    reachability = getattr(record, "reachability", "unknown")
    if reachability in ("direct", "relay", "client"):
        return cast(Connectivity, reachability)
    if getattr(record, "client_mode", False) is True:
        return "client"
    addresses = [a for a in getattr(record, "addresses", None) or [] if isinstance(a, str)]
    if any("/p2p-circuit" in a for a in addresses):
        return "relay"
    return "direct" if addresses else "unknown"


def _restarted(view: PeerView, previous: PeerView) -> bool:
    counters = ("round", "step", "samples_total", "bytes_sent", "bytes_received", "exchanges_ok")
    went_back = any(getattr(view, name) < getattr(previous, name) for name in counters)
    return went_back or view.started_at != previous.started_at


def _with_rates(view: PeerView, previous: PeerView) -> PeerView:
    """Rates over the interval between the two announcements; an unchanged record keeps the old rates."""
    last_seen = max(view.last_seen, previous.last_seen)
    progressed = (view.round, view.step, view.samples_total) != (
        previous.round,
        previous.step,
        previous.samples_total,
    )
    last_progress_at = last_seen if progressed else previous.last_progress_at
    dt = last_seen - previous.last_seen
    if dt < MIN_RATE_INTERVAL_S:
        return replace(
            view,
            last_seen=last_seen,
            last_progress_at=last_progress_at,
            upload_bps=previous.upload_bps,
            download_bps=previous.download_bps,
            syncs_per_min=previous.syncs_per_min,
        )
    return replace(
        view,
        last_seen=last_seen,
        last_progress_at=last_progress_at,
        upload_bps=_round((view.bytes_sent - previous.bytes_sent) / dt),
        download_bps=_round((view.bytes_received - previous.bytes_received) / dt),
        syncs_per_min=_round((view.round - previous.round) * 60.0 / dt),
    )


def _loss_unit(value: object) -> str:
    """A known loss unit; a record without one (or with garbage) is read as bits per byte."""
    return value if isinstance(value, str) and value in LOSS_UNITS else LOSS_UNITS[0]


def _text(value: object, limit: int) -> str:
    return value[:limit] if isinstance(value, str) else ""


def _number(value: object) -> TypeGuard[int | float]:
    """A real int or finite float (ints of any size: ``math.isfinite`` would overflow on them)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _count(value: object) -> int:
    return int(min(max(value, 0), MAX_COUNT)) if _number(value) else 0


def _value(value: object) -> float | None:
    """A non-negative finite float, or None when absent or garbage."""
    if not _number(value) or value < 0:
        return None
    return float(min(value, MAX_VALUE))


def _clamp(value: object, low: float, high: float, *, default: float) -> float:
    return float(min(max(value, low), high)) if _number(value) else default


def _round(value: float) -> float:
    return round(value, 3)
