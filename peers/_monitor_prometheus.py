"""Prometheus sink: serves the latest snapshot as per-peer labelled gauges and swarm totals.

A custom collector renders whatever snapshot is current at scrape time, so a peer that left the
swarm simply stops appearing (no stale labelled series linger in a registry).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from swarm.metrics import PeerView, SwarmSnapshot

PEER_LABELS = ("peer_id", "public_name", "role")
LOSS_UNIT = ", in bits per token (per byte for byte-level data)"

PEER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("swarm_peer_up", "1 if the peer is compatible and not stale", "active"),
    ("swarm_peer_samples_per_second", "Samples per second the peer reports", "samples_per_s"),
    ("swarm_peer_samples_total", "Samples the peer has trained", "samples_total"),
    ("swarm_peer_round", "The peer's local sync round", "round"),
    ("swarm_peer_step", "The peer's local inner step", "step"),
    ("swarm_peer_loss", "The peer's smoothed training loss" + LOSS_UNIT, "loss"),
    ("swarm_peer_drift", "The peer's reported drift from the swarm mean", "drift"),
    ("swarm_peer_upload_bytes_per_second", "Upload rate from byte-counter deltas", "upload_bps"),
    ("swarm_peer_download_bytes_per_second", "Download rate from byte-counter deltas", "download_bps"),
    ("swarm_peer_bytes_sent", "Bytes the peer has sent", "bytes_sent"),
    ("swarm_peer_bytes_received", "Bytes the peer has received", "bytes_received"),
)

TOTAL_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("swarm_peers", "Peers with a live record", "peers"),
    ("swarm_trainers", "Compatible, non-stale trainers", "trainers"),
    ("swarm_stale_peers", "Peers shown as stale", "stale"),
    ("swarm_incompatible_peers", "Peers with another protocol or config hash", "incompatible"),
    ("swarm_samples_per_second", "Total samples per second of active peers", "samples_per_s"),
    ("swarm_samples_total", "Samples trained by the swarm", "samples_total"),
    ("swarm_loss_mean", "Mean recent training loss of active peers" + LOSS_UNIT, "loss_mean"),
    ("swarm_loss_best", "Best recent training loss of active peers" + LOSS_UNIT, "loss_best"),
    ("swarm_eval_loss_mean", "Mean held-out loss of active peers" + LOSS_UNIT, "eval_loss_mean"),
    (
        "swarm_eval_bits_per_byte_mean",
        "Mean held-out loss of active peers in bits per byte of text",
        "eval_bits_per_byte_mean",
    ),
    ("swarm_syncs_per_minute", "Sync rounds per minute, summed over peers", "syncs_per_min"),
    ("swarm_progress_ratio", "Samples trained / run.target_samples", "progress"),
    ("swarm_eta_seconds", "Seconds to run.target_samples at the current rate", "eta_s"),
)


class SnapshotCollector(Collector):
    """Yields gauges for the snapshot last passed to :meth:`update` (nothing before the first)."""

    def __init__(self) -> None:
        self._snapshot: SwarmSnapshot | None = None
        self._lock = threading.Lock()

    def update(self, snapshot: SwarmSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None:
            return
        for name, documentation, attribute in PEER_GAUGES:
            family = GaugeMetricFamily(name, documentation, labels=PEER_LABELS)
            for peer in snapshot.peers:
                value = _peer_value(peer, attribute)
                if value is not None:
                    family.add_metric([peer.peer_id, peer.public_name, peer.role], value)
            yield family
        for name, documentation, attribute in TOTAL_GAUGES:
            value = getattr(snapshot.totals, attribute)
            if value is not None:
                yield GaugeMetricFamily(name, documentation, value=float(value))
        yield GaugeMetricFamily(
            "swarm_warnings", "Warnings in the latest snapshot", value=len(snapshot.warnings)
        )


def _peer_value(peer: PeerView, attribute: str) -> float | None:
    value = getattr(peer, attribute)
    return None if value is None else float(value)


class PrometheusExporter:
    """An HTTP endpoint on ``host:port`` (port 0 picks a free one; see :attr:`port`)."""

    def __init__(self, host: str, port: int):
        self.collector = SnapshotCollector()
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self.collector)
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def update(self, snapshot: SwarmSnapshot) -> None:
        self.collector.update(snapshot)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
