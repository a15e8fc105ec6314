"""The swarm as one observer sees it at one moment: peers, totals and warnings.

:func:`build_snapshot` is the only place where monitor numbers are computed; every sink (table, JSON,
Prometheus, plots, the trainer's own history) renders a :class:`SwarmSnapshot` and computes nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from swarm.metrics._peer import ACTIVE_STATES, MemberLike, PeerView, observe, vanished
from swarm.metrics._policy import SnapshotPolicy
from swarm.metrics._stages import StageView, stage_views

SCHEMA_VERSION = 1
"""Version of :meth:`SwarmSnapshot.to_dict` (docs/monitor.md). Adding a field keeps it; renaming or
removing one, or changing a meaning, bumps it."""


@dataclass(frozen=True)
class SwarmWarning:
    """Something an observer should look at. ``kind`` is one of the kinds listed in docs/monitor.md."""

    kind: str
    message: str
    peer_id: str | None = None


@dataclass(frozen=True)
class SwarmTotals:
    """Swarm-wide numbers over compatible peers (throughput and loss over the non-stale ones only)."""

    peers: int
    trainers: int
    stale: int
    incompatible: int
    samples_per_s: float
    samples_total: int
    loss_mean: float | None
    loss_best: float | None
    upload_bps: float | None
    download_bps: float | None
    syncs_per_min: float | None
    target_samples: int | None
    progress: float | None
    eta_s: float | None
    eval_loss_mean: float | None = None
    """Mean held-out loss of the active peers that have evaluated: the swarm's eval loss."""
    eval_bits_per_byte_mean: float | None = None
    """The same per byte of text (equal to ``eval_loss_mean`` for byte-level data)."""
    loss_unit: str = "bits/byte"
    """The unit of the losses above: the one most active peers report; peers in another are left out."""
    run_state: str = "waiting"
    """``training`` (a trainer is active), ``finished`` (none is, and samples were trained, or the
    target is reached) or ``waiting`` (nothing trained yet)."""


@dataclass(frozen=True)
class SwarmSnapshot:
    """Everything one refresh of the monitor shows. ``time`` is DHT time (Unix seconds)."""

    time: float
    run_id: str
    reference_config_hash: str
    peers: tuple[PeerView, ...]
    totals: SwarmTotals
    warnings: tuple[SwarmWarning, ...]
    retired_samples: int = 0
    stages: tuple[StageView, ...] = ()
    """Pipelined runs: per-stage peers, throughput, capacity and the bottleneck (swarm/metrics/_stages.py)."""

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON form (``schema_version`` first); see docs/monitor.md."""
        return {
            "schema_version": SCHEMA_VERSION,
            "time": round(self.time, 3),
            "run_id": self.run_id,
            "reference_config_hash": self.reference_config_hash,
            "totals": asdict(self.totals),
            "peers": [p.to_dict(self.time) for p in self.peers],
            "warnings": [asdict(w) for w in self.warnings],
            "retired_samples": self.retired_samples,
            "stages": [asdict(s) for s in self.stages],
            "bottleneck_stage": next((s.stage for s in self.stages if s.bottleneck), None),
        }


def build_snapshot(
    members: Iterable[MemberLike], previous: SwarmSnapshot | None, now: float, policy: SnapshotPolicy
) -> SwarmSnapshot:
    """Turn the live member list into a snapshot, using ``previous`` for rates and departed peers."""
    before = {p.peer_id: p for p in previous.peers} if previous else {}
    retired = previous.retired_samples if previous else 0
    views: dict[str, PeerView] = {}
    for member in members:
        if not isinstance(member.peer_id, str) or not member.peer_id or member.peer_id in views:
            continue
        prior = before.get(member.peer_id)
        view, reset_samples = observe(member, prior, now, policy)
        views[view.peer_id] = view
        retired += reset_samples if prior is not None and _counts(prior) else 0
    for peer_id, prior in before.items():
        if peer_id in views:
            continue
        if now - prior.last_seen <= policy.stale_after_s:
            views[peer_id] = vanished(prior)
        elif _counts(prior):
            retired += prior.samples_total
    reference = reference_config_hash([v for v in views.values() if v.present], policy.config_hash)
    peers = tuple(sorted((_judge(v, reference, now, policy) for v in views.values()), key=_order))
    return SwarmSnapshot(
        time=now,
        run_id=policy.run_id,
        reference_config_hash=reference,
        peers=peers,
        totals=_totals(peers, retired, policy.target_samples, _trusted_total(peers, policy)),
        warnings=tuple(_warnings(peers, reference, now, policy)),
        retired_samples=retired,
        stages=stage_views(peers),
    )


def _counts(view: PeerView) -> bool:
    """Whether a peer's samples add to the total: a compatible trainer's do; a bootstrap trains none
    (its record's counters are the run's totals, see :func:`_trusted_total`)."""
    return view.compatible and view.role != "bootstrap"


def reference_config_hash(peers: Sequence[PeerView], own_hash: str) -> str:
    """The observer's hash if any peer shares it, else the most common one (ties: smallest hash)."""
    counts = Counter(p.config_hash for p in peers)
    if not counts or own_hash in counts:
        return own_hash
    return min(counts, key=lambda h: (-counts[h], h))


def _judge(view: PeerView, reference: str, now: float, policy: SnapshotPolicy) -> PeerView:
    compatible = view.protocol_version == policy.protocol_version and view.config_hash == reference
    return replace(view, compatible=compatible, state=_state(view, compatible, now, policy))


def _state(view: PeerView, compatible: bool, now: float, policy: SnapshotPolicy) -> str:
    """incompatible > stale > what the peer reports (joining / idle / training / syncing / leaving)."""
    if not compatible:
        return "incompatible"
    if _stale_reason(view, now, policy):
        return "stale"
    return view.reported_state


def _stale_reason(view: PeerView, now: float, policy: SnapshotPolicy) -> str:
    if not view.present:
        return f"record expired, last seen {now - view.last_seen:.0f}s ago"
    if now - view.last_seen > policy.stale_after_s:
        return f"last seen {now - view.last_seen:.0f}s ago"
    if view.reported_state in ACTIVE_STATES and now - view.last_progress_at > policy.stale_after_s:
        return f"{view.reported_state} but no progress for {now - view.last_progress_at:.0f}s"
    return ""


def _order(view: PeerView) -> tuple:
    return (view.role != "bootstrap", view.public_name, view.peer_id)


def _trusted_total(peers: Sequence[PeerView], policy: SnapshotPolicy) -> int:
    """The run's samples as counted by a trusted bootstrap (0 without one): a floor for the total."""
    trusted = [
        p for p in peers if p.role == "bootstrap" and p.compatible and p.peer_id in policy.trusted_peers
    ]
    return max((p.samples_total for p in trusted), default=0)


def _run_state(trainers: int, samples_total: int, progress: float | None) -> str:
    if progress is not None and progress >= 1.0:
        return "finished"
    if trainers:
        return "training"
    return "finished" if samples_total else "waiting"


def _totals(peers: Sequence[PeerView], retired: int, target: int | None, floor: int = 0) -> SwarmTotals:
    """``floor``: the run's total as a trusted bootstrap counts it (trainers that left included)."""
    compatible = [p for p in peers if p.compatible]
    active = [p for p in compatible if p.active]
    unit = _loss_unit_of(active)
    scored = [p for p in active if p.loss_unit == unit]
    losses = [p.loss for p in scored if p.loss is not None]
    eval_losses = [p.eval_loss for p in scored if p.eval_loss is not None]
    samples_per_s = sum(p.samples_per_s for p in active)
    counted = retired + sum(p.samples_total for p in compatible if p.role != "bootstrap")
    samples_total = max(counted, floor)
    progress = eta = None
    if target:
        progress = min(1.0, samples_total / target)
        remaining = max(0, target - samples_total)
        eta = 0.0 if remaining == 0 else (round(remaining / samples_per_s, 1) if samples_per_s > 0 else None)
    trainers = sum(p.role != "bootstrap" for p in active)
    return SwarmTotals(
        run_state=_run_state(trainers, samples_total, progress),
        peers=sum(p.present for p in peers),
        trainers=trainers,
        stale=sum(p.state == "stale" for p in peers),
        incompatible=len(peers) - len(compatible),
        samples_per_s=round(samples_per_s, 3),
        samples_total=samples_total,
        loss_mean=round(sum(losses) / len(losses), 6) if losses else None,
        loss_best=min(losses) if losses else None,
        upload_bps=_sum([p.upload_bps for p in active]),
        download_bps=_sum([p.download_bps for p in active]),
        syncs_per_min=_sum([p.syncs_per_min for p in active]),
        target_samples=target,
        progress=None if progress is None else round(progress, 6),
        eta_s=eta,
        eval_loss_mean=round(sum(eval_losses) / len(eval_losses), 6) if eval_losses else None,
        eval_bits_per_byte_mean=_mean([p.eval_bits_per_byte for p in scored]),
        loss_unit=unit,
    )


def _loss_unit_of(active: Sequence[PeerView]) -> str:
    units = Counter(p.loss_unit for p in active if p.loss is not None or p.eval_loss is not None)
    return units.most_common(1)[0][0] if units else "bits/byte"


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known) / len(known), 6) if known else None


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(sum(known), 3) if known else None


def _warnings(
    peers: Sequence[PeerView], reference: str, now: float, policy: SnapshotPolicy
) -> list[SwarmWarning]:
    found = []
    versions = Counter(p.package_version for p in peers if p.present)
    if len(versions) > 1:
        spread = ", ".join(f"{v or '?'} ({n})" for v, n in sorted(versions.items()))
        found.append(SwarmWarning("version_skew", f"package versions differ: {spread}"))
    for p in peers:
        found.extend(_peer_warnings(p, reference, now, policy))
    return found


def _peer_warnings(p: PeerView, reference: str, now: float, policy: SnapshotPolicy) -> list[SwarmWarning]:
    name = p.public_name or p.short_id
    found = []
    if p.protocol_version != policy.protocol_version:
        message = f"{name}: protocol {p.protocol_version}, expected {policy.protocol_version}"
        found.append(SwarmWarning("protocol_mismatch", message, p.peer_id))
    if p.config_hash != reference:
        message = f"{name}: config hash {p.config_hash[:12] or '?'} != {reference[:12] or '?'}"
        found.append(SwarmWarning("config_mismatch", message, p.peer_id))
    stale = _stale_reason(p, now, policy)
    if stale:
        found.append(SwarmWarning("stale", f"{name}: {stale}", p.peer_id))
    if p.drift is not None and p.drift > policy.max_drift:
        found.append(SwarmWarning("drift", f"{name}: drift {p.drift:.3g} > {policy.max_drift:g}", p.peer_id))
    if p.expires_in_s is not None and p.expires_in_s > policy.record_ttl_s + policy.clock_skew_tolerance_s:
        ahead = p.expires_in_s - policy.record_ttl_s
        message = f"{name}: record expires {ahead:.0f}s later than expected (clock ahead or longer TTL)"
        found.append(SwarmWarning("clock_skew", message, p.peer_id))
    return found
