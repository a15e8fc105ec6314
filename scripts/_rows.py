"""A run's numbers from what its trainers wrote (their ``--summary`` files), for the benchmarks.

Nothing here starts a process: scripts/_runner.py fills a row with these, bench entries and
scripts/bench_report.py read them.
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any


def summary_numbers(per_peer: list[dict[str, Any]]) -> dict[str, Any]:
    """The benchmark's numbers from the trainers' ``--summary`` files (``peers/join.py``).

    ``wire_bytes_per_param_per_sync``: everything a peer sent for averaging (both roles, every
    exchange kind) per round and parameter, mean over peers; ``exchange_bytes_per_param``: one
    exchange (gossip) or all-reduce round, one direction; ``waiting_bytes_per_param``: of those,
    what a gossip peer sent after its round's last inner step (the base pushes overlapped the round);
    ``utilization_since_start``:
    device seconds over each trainer's whole life (start-up and joining included), mean over peers;
    ``compute_per_step_s``: the real forward, backward and optimizer time per step, mean over steps;
    ``exchange_s`` and ``dial_s``: a committed exchange's data phase and a dial's wait for an answer,
    mean over the peers that had any; ``exchange_bytes_per_s``: what an exchange's data phase moved
    each way per second (the bytes a peer sent after its rounds' last steps, per exchange, over
    ``exchange_s``).
    """

    def mean_of(key: str) -> float | None:
        return mean([p.get(key) for p in per_peer])

    steps = sum(p.get("steps", 0) for p in per_peer)
    roles: Counter[str] = Counter()
    for peer in per_peer:
        roles.update(peer.get("rounds_by_role") or {})
    return {
        "final_eval_loss": mean_of("eval_loss"),
        "wire_bytes_per_param_per_sync": mean_of("wire_bytes_per_param_per_sync"),
        "exchange_bytes_per_param": mean_of("exchange_bytes_per_param"),
        "waiting_bytes_per_param": mean_of("waiting_bytes_per_param"),
        "utilization_since_start": mean_of("utilization"),
        "steps_per_peer": steps / max(len(per_peer), 1),
        "syncs_per_peer": sum(p.get("rounds", 0) for p in per_peer) / max(len(per_peer), 1),
        "samples_total": sum(p.get("samples", 0) for p in per_peer),
        "compute_per_step_s": sum(p.get("compute_seconds", 0.0) for p in per_peer) / steps if steps else None,
        "rounds_by_role": dict(roles),
        "exchange_s": mean([p.get("exchange_seconds") or None for p in per_peer]),  # 0: none
        "dial_s": mean([p.get("dial_seconds") or None for p in per_peer]),
        "exchange_bytes_per_s": mean([_exchange_rate(p) for p in per_peer]),
    }


def _exchange_rate(peer: dict[str, Any]) -> float | None:
    seconds, per_param = peer.get("exchange_seconds"), peer.get("waiting_bytes_per_param")
    if not seconds or per_param is None:
        return None
    return per_param * peer.get("n_params", 0) / seconds


def crossing(curve: list[list[float]], target: float, axis: int) -> float | None:
    """Where the eval curve first reaches ``target``, on ``axis`` (0: seconds, 1: samples), linearly
    interpolated from the point before (evaluations are seconds apart); None if it never does."""
    for index, point in enumerate(curve):
        if point[2] <= target:
            if index == 0:
                return point[axis]
            before = curve[index - 1]
            share = (before[2] - target) / (before[2] - point[2])
            return before[axis] + share * (point[axis] - before[axis])
    return None


def training_thread(per_peer: list[dict[str, Any]]) -> dict[str, Any]:
    """``utilization``: device seconds over the wall time of the training loop (from the first inner
    step to the stop; start-up and joining left out), mean over trainers; ``time_split``: the share of
    that wall time each phase of the trainers' own ``phase_seconds`` took (swarm/trainer/_phases.py,
    ``other`` included); means over trainers."""
    splits = [p["time_split"] for p in per_peer if p.get("time_split") and p["time_split"].get("loop")]
    if not splits:
        return {"utilization": None, "time_split": None}
    parts = sorted({part for split in splits for part in split} - {"loop"})
    shares = {part: mean([s.get(part, 0.0) / s["loop"] for s in splits]) for part in parts}
    return {"utilization": shares.get("device"), "time_split": shares}


def emulation_overrun(
    per_peer: list[dict[str, Any]], step_time: float, slow_peer: int | None, slowdown: float
) -> float | None:
    """How much longer the device time was than the emulated step times: 0 when every step's real
    compute fitted in ``emulation.step_time_s`` (the emulation held)."""
    if not step_time:
        return None
    emulated = 0.0
    for peer in per_peer:
        factor = slowdown if peer["name"] == f"peer-{slow_peer}" else 1.0
        emulated += peer.get("steps", 0) * step_time * factor
    device = sum(p.get("device_seconds", 0.0) for p in per_peer)
    return device / emulated - 1 if emulated else None


def set_value(sets: list[str], key: str, default: float) -> float:
    values = [s.split("=", 1)[1] for s in sets if s.startswith(f"{key}=")]
    return float(values[-1]) if values else default


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def brief(row: dict[str, Any]) -> str:
    """One line: time to target, final eval, utilization, real compute per step, load."""
    if "error" in row:
        return f"error: {row['error']}"
    reached = row.get("seconds_to_target")
    to_target = "not reached" if reached is None else f"{reached:.1f} s"
    util = row.get("utilization")
    compute = row.get("compute_per_step_s")
    load = (row.get("load_average") or {}).get("mean")
    parts = [f"to target {to_target}", f"final eval {row['final_eval_loss']:.3f}"]
    parts.append("util -" if util is None else f"util {util:.0%}")
    parts.append("compute -" if compute is None else f"compute {1000 * compute:.0f} ms/step")
    parts.append("load -" if load is None else f"load {load:.1f}")
    return ", ".join(parts)


def short_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row's headline numbers (bench_lag, bench_baselines): name, rate, time and samples to the
    target, final eval, utilization, the share of the loop spent in rounds, compute per step."""
    split = row.get("time_split") or {}
    keep = ("name", "rate", "seconds_to_target", "samples_to_target", "final_eval_loss", "utilization")
    compute = row.get("compute_per_step_s")
    return {key: row.get(key) for key in keep} | {
        "sync_share": split.get("sync"),
        "compute_ms_per_step": None if compute is None else round(1000 * compute, 1),
        "error": row.get("error"),
    }
