"""`swarm monitor plot`: loss and throughput over time from a history file (matplotlib, Agg)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from peers._monitor_table import shown

Series = dict[str, tuple[list[float], list[float]]]

SWARM_MEAN = "swarm mean"
LOSS_UNITS = ("bits/byte", "bits/token")


def series(snapshots: list[dict[str, Any]], field: str, total_field: str) -> Series:
    """Per-peer (label: public name or short id) and swarm-total series of ``field`` against minutes.

    Time is minutes since the first snapshot; points where the value is missing are left out.
    """
    if not snapshots:
        return {}
    start = _number(snapshots[0].get("time")) or 0.0
    out: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for snap in snapshots:
        t = _number(snap.get("time"))
        if t is None:
            continue
        minutes = (t - start) / 60.0
        for peer in snap.get("peers", []):
            value = _number(peer.get(field)) if isinstance(peer, dict) else None
            if value is not None and peer.get("role") != "bootstrap":
                label = _label(peer.get("public_name") or str(peer.get("peer_id", "?"))[-8:])
                out[label][0].append(minutes)
                out[label][1].append(value)
        total = _number(snap.get("totals", {}).get(total_field))
        if total is not None:
            out[SWARM_MEAN if total_field == "loss_mean" else "swarm total"][0].append(minutes)
            out[SWARM_MEAN if total_field == "loss_mean" else "swarm total"][1].append(total)
    return dict(out)


def plot_history(snapshots: list[dict[str, Any]], output: Path) -> None:
    """Two panels (loss, samples/s) with one line per peer plus the swarm mean / total."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    _draw(loss_ax, series(snapshots, "loss", "loss_mean"), f"training loss ({loss_unit(snapshots)})")
    _draw(rate_ax, series(snapshots, "samples_per_s", "samples_per_s"), "samples / s")
    rate_ax.set_xlabel("time (minutes since first snapshot)")
    fig.suptitle(f"swarm run {snapshots[0].get('run_id', '?') if snapshots else '?'}")
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, format="png", dpi=100)
    plt.close(fig)


def loss_unit(snapshots: list[dict[str, Any]]) -> str:
    """The unit the history's losses are in (its latest snapshot that says; bits/byte if none does)."""
    for snap in reversed(snapshots):
        totals = snap.get("totals")
        unit = totals.get("loss_unit") if isinstance(totals, dict) else None
        if unit in LOSS_UNITS:
            return str(unit)
    return LOSS_UNITS[0]


def _draw(ax, data: Series, ylabel: str) -> None:
    for label, (xs, ys) in sorted(data.items()):
        swarm = label in (SWARM_MEAN, "swarm total")
        ax.plot(xs, ys, label=label, linewidth=2.5 if swarm else 1.0, color="black" if swarm else None)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if data:
        ax.legend(fontsize="small", loc="best")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if value == value and abs(value) != float("inf") else None


def _label(name: object) -> str:
    """A peer's name as a legend label: its text, never matplotlib's ``$...$`` mathematics."""
    return shown(str(name)).replace("$", r"\$")
