"""The membership benchmark's numbers: rates from two readings of the peers' RPC counters and network
interfaces (scripts/_membership_probe.py, scripts/_membership_swarm.py), the growth fits, the table.

A reading is ``{name: counters}``; each counters file carries the time it was written, so each node's
rate is over its own interval. A peer's own membership traffic (``client``: the record stores and
member-list reads it makes) is what every other node answered it; what it answered others is
``served``. The nodes that serve the most membership bytes are the ones holding ``<run_id>_members``
(hivemind stores a key on its ``num_replicas`` = 5 nearest nodes, and caches a found value on the
nearest node that lacked it).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any

HOLDERS = 5
"""hivemind's ``num_replicas``: the nodes a key is stored on."""
EXTRAPOLATE_TO = 1000


def _delta(after: dict[str, int], before: dict[str, int] | None, field: str) -> int:
    return after.get(field, 0) - (before or {}).get(field, 0)


def _intervals(before: dict[str, Any], after: dict[str, Any]) -> Iterator[tuple[str, Any, Any, float]]:
    """Per node read twice: its name, both readings and the seconds between them."""
    for name, now in after.items():
        then = before.get(name)
        if now and then and now["time"] > then["time"]:
            yield name, now, then, now["time"] - then["time"]


def rpc_rates(before: dict[str, Any], after: dict[str, Any], kind: str = "members") -> dict[str, dict]:
    """Bytes per second of ``kind`` RPCs, per node (by name): ``client_sent``/``client_received`` (its
    own requests and the answers), ``served_in``/``served_out`` (others' requests and our answers),
    and ``client_calls``/``served_calls`` per second. Unknown clients (the monitor) are keyed by id."""
    names = {doc["node"]: name for name, doc in after.items() if doc and doc.get("node")}
    rates: dict[str, dict[str, float]] = {}

    def row(name: str) -> dict[str, float]:
        fields = ("client_sent", "client_received", "client_calls", "served_in", "served_out", "served_calls")
        return rates.setdefault(name, dict.fromkeys(fields, 0.0))

    for name, now, then, seconds in _intervals(before, after):
        for rpc_kind, counts in now["served"].items():
            if rpc_kind.split(".")[0] != kind:
                continue
            old = then["served"].get(rpc_kind)
            row(name)["served_in"] += _delta(counts, old, "request_bytes") / seconds
            row(name)["served_out"] += _delta(counts, old, "response_bytes") / seconds
            row(name)["served_calls"] += _delta(counts, old, "calls") / seconds
        for client, kinds in now["by_client"].items():
            for rpc_kind, counts in kinds.items():
                if rpc_kind.split(".")[0] != kind:
                    continue
                old = then["by_client"].get(client, {}).get(rpc_kind)
                target = row(names.get(client, client))
                target["client_sent"] += _delta(counts, old, "request_bytes") / seconds
                target["client_received"] += _delta(counts, old, "response_bytes") / seconds
                target["client_calls"] += _delta(counts, old, "calls") / seconds
    return rates


def by_rpc(before: dict[str, Any], after: dict[str, Any], kind: str = "members") -> dict[str, dict]:
    """Over all nodes, per RPC of ``kind`` (``store``: one record, ``store_all``: a whole dictionary,
    ``find``): calls and bytes per second, and the mean request and response of one call."""
    totals: dict[str, dict[str, float]] = {}
    for _, now, then, seconds in _intervals(before, after):
        for rpc_kind, counts in now["served"].items():
            key, _, rpc = rpc_kind.partition(".")
            if key != kind:
                continue
            row = totals.setdefault(rpc, {"calls": 0, "request_bytes": 0, "response_bytes": 0, "per_s": 0.0})
            old = then["served"].get(rpc_kind)
            for field in ("calls", "request_bytes", "response_bytes"):
                row[field] += _delta(counts, old, field)
            row["per_s"] += (
                _delta(counts, old, "request_bytes") + _delta(counts, old, "response_bytes")
            ) / seconds
    return {
        rpc: {
            "bytes_per_s": row["per_s"],
            "calls": row["calls"],
            "mean_request": row["request_bytes"] / row["calls"] if row["calls"] else None,
            "mean_response": row["response_bytes"] / row["calls"] if row["calls"] else None,
        }
        for rpc, row in totals.items()
    }


def message_sizes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    """Mean bytes of one record's store request and of a membership find's answer, over all nodes."""
    rpcs = by_rpc(before, after)
    return {
        "store_request_bytes": rpcs.get("store", {}).get("mean_request"),
        "find_response_bytes": rpcs.get("find", {}).get("mean_response"),
    }


def wire_rates(
    before: dict[str, dict], after: dict[str, dict], seconds: float
) -> dict[str, dict[str, float]]:
    """Bytes per second on each namespaced peer's interface, ``tx`` and ``rx``."""
    return {
        name: {d: (after[name][d] - before[name][d]) / seconds for d in ("tx", "rx")}
        for name in after
        if name in before and seconds > 0
    }


def summarize(rates: dict[str, dict], trainers: list[str], wire: dict[str, dict]) -> dict[str, Any]:
    """The row of one run: per-trainer membership bytes (mean, max), the key holders', the wire's."""

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"mean": None, "max": None}
        return {"mean": statistics.fmean(values), "max": max(values)}

    own = [rates.get(n, {}) for n in trainers]
    served = sorted((r["served_out"] + r["served_in"], n) for n, r in rates.items())[::-1]
    return {
        "peer_sent": stats([r.get("client_sent", 0.0) for r in own]),
        "peer_received": stats([r.get("client_received", 0.0) for r in own]),
        "peer_total": stats([r.get("client_sent", 0.0) + r.get("client_received", 0.0) for r in own]),
        "peer_reads_per_s": stats([r.get("client_calls", 0.0) for r in own]),
        "holders": [{"name": n, "bytes_per_s": b} for b, n in served[:HOLDERS]],
        "holder_mean": statistics.fmean(b for b, _ in served[:HOLDERS]) if served else None,
        "served_total": sum(b for b, _ in served),
        "wire_peer_tx": stats([wire[n]["tx"] for n in trainers if n in wire]),
        "wire_peer_rx": stats([wire[n]["rx"] for n in trainers if n in wire]),
        "wire_max_tx": max((w["tx"] for w in wire.values()), default=None),
    }


def power_fit(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Least squares of ``log y = log a + k log N``: ``{"a", "k"}``, or None with fewer than 2 points."""
    points = [(n, y) for n, y in points if n > 0 and y and y > 0]
    if len(points) < 2:
        return None
    xs, ys = [math.log(n) for n, _ in points], [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return {"a": math.exp(my - k * mx), "k": k}


def fixed_power(points: list[tuple[float, float]], k: int) -> float | None:
    """Least squares ``c`` of ``y = c N^k`` (``k`` fixed: 1 per peer, 2 at the holders)."""
    points = [(n, y) for n, y in points if y is not None]
    if not points:
        return None
    return sum(y * n**k for n, y in points) / sum(n ** (2 * k) for n, _ in points)


def fits(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The growth with N of a trainer's own membership bytes and of the busiest holders'."""
    per_peer = [(r["peers"], r["membership"]["peer_total"]["mean"]) for r in rows]
    holders = [(r["peers"], r["membership"]["holder_mean"]) for r in rows]
    linear, quadratic = fixed_power(per_peer, 1), fixed_power(holders, 2)
    return {
        "peer_total": {"power": power_fit(per_peer), "linear_c": linear},
        "holder_mean": {"power": power_fit(holders), "quadratic_c": quadratic},
        f"peer_total_at_{EXTRAPOLATE_TO}": None if linear is None else linear * EXTRAPOLATE_TO,
        f"holder_mean_at_{EXTRAPOLATE_TO}": None if quadratic is None else quadratic * EXTRAPOLATE_TO**2,
    }


def _kb(value: float | None) -> str:
    return "-" if value is None else f"{value / 1000:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of N against membership bytes (kB/s, 1 kB = 1000 B)."""
    lines = [
        "| N | shards | peer sends kB/s | peer receives kB/s | peer total kB/s (max) | key holders serve "
        "kB/s (busiest) | all nodes serve kB/s | record store B | list answer B | wire per peer tx+rx kB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m, sizes = r["membership"], r["sizes"]
        wire = None
        if m["wire_peer_tx"]["mean"] is not None:
            wire = m["wire_peer_tx"]["mean"] + m["wire_peer_rx"]["mean"]
        busiest = m["holders"][0]["bytes_per_s"] if m["holders"] else None
        lines.append(
            f"| {r['peers']} | {r.get('member_shards', 1)} | {_kb(m['peer_sent']['mean'])} | "
            f"{_kb(m['peer_received']['mean'])} | "
            f"{_kb(m['peer_total']['mean'])} ({_kb(m['peer_total']['max'])}) | {_kb(m['holder_mean'])} "
            f"({_kb(busiest)}) | {_kb(m['served_total'])} | {_size(sizes['store_request_bytes'])} | "
            f"{_size(sizes['find_response_bytes'])} | {_kb(wire)} |"
        )
    return "\n".join(lines)


def _size(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def fit_lines(fit: dict[str, Any]) -> list[str]:
    """The fits in words."""
    lines = []
    for key, what, fixed in (
        ("peer_total", "per trainer", "linear_c"),
        ("holder_mean", "per key holder", "quadratic_c"),
    ):
        power, c = fit[key]["power"], fit[key][fixed]
        if power is None or c is None:
            continue
        exponent = 1 if fixed == "linear_c" else 2
        at = fit[f"{key}_at_{EXTRAPOLATE_TO}"]
        lines.append(
            f"{what}: {power['a']:.1f} * N^{power['k']:.2f} B/s (least squares in log-log); with the "
            f"exponent fixed at {exponent}: {c:.2f} * N^{exponent} B/s, {_kb(at)} kB/s at "
            f"N = {EXTRAPOLATE_TO}"
        )
    return lines
