"""Timing ``swarm monitor --once`` against the membership benchmark's run, optionally under cProfile.

Two ways a user starts it: with the run's config file (``--config``), and with only ``--run-id``, in
which case the monitor first reads the config the swarm publishes. Each is timed from its start to its
exit, as a user waits for it; its JSON document gives the run's totals, its stderr the log.
"""

from __future__ import annotations

import json
import pstats
import time
from collections.abc import Callable
from io import StringIO
from typing import Any

from scripts._membership_swarm import Swarm

TIMEOUT_S = 180.0
TOTALS = ("peers", "trainers", "samples_total", "loss_mean", "samples_per_s")
TOP_ENTRIES = 25


def _variants(common: list[str], run_id: str) -> dict[str, list[str]]:
    """``--config`` and the overrides, or ``--run-id`` alone (the published config)."""
    return {"config": common, "published": ["--run-id", run_id]}


def time_monitor(
    swarm: Swarm, slot: int, maddr: str, common: list[str], profile: bool, say: Callable[[str], None]
) -> dict[str, Any]:
    """Each variant once (twice with ``profile``: plain, then profiled); ``{variant: result}``."""
    results: dict[str, Any] = {}
    for variant, args in _variants(common, swarm.run_id).items():
        results[variant] = _once(swarm, slot, f"monitor-{variant}", maddr, args, None)
        say(f"monitor --once ({variant}): {results[variant]['seconds']:.1f} s")
        if profile:
            path = swarm.log_dir / f"monitor-{variant}.prof"
            profiled = _once(swarm, slot, f"monitor-{variant}-profiled", maddr, args, str(path))
            results[variant]["profiled_seconds"] = profiled["seconds"]
            results[variant]["profile_top"] = top_entries(path) if path.exists() else None
    return results


def _once(
    swarm: Swarm, slot: int, name: str, maddr: str, args: list[str], profile: str | None
) -> dict[str, Any]:
    argv = ["monitor", "--once", "--format", "json", "--initial-peers", maddr, *args]
    env = {"MEMBERSHIP_BENCH_PROFILE": profile} if profile else None
    started = time.monotonic()
    peer = swarm.start(name, slot, argv, listen=False, env=env, nice=0)  # as on a machine of its own
    try:
        status = peer.proc.wait(timeout=TIMEOUT_S)
    except Exception:  # a monitor that hangs is a result too; the run's stop kills it
        status = None
    seconds = time.monotonic() - started
    return {"seconds": seconds, "status": status, "totals": _totals(swarm.log_dir / f"{name}.out")}


def _totals(path) -> dict[str, Any] | None:
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    totals = document.get("totals") or {}
    return {k: totals.get(k) for k in TOTALS}


def top_entries(path, limit: int = TOP_ENTRIES) -> str:
    """The profile's ``limit`` entries of largest cumulative time, as pstats prints them."""
    out = StringIO()
    pstats.Stats(str(path), stream=out).sort_stats("cumulative").print_stats(limit)
    return out.getvalue()
