"""Many real peers on one machine: scripts/bench_membership.py end to end, with fewer peers than its 32.

One run of the benchmark on loopback (a bootstrap and :data:`PEERS` trainers of
configs/membership-bench.yaml, gossiping, each with its DHT RPCs counted), then ``swarm monitor
--once`` twice. What must hold: every trainer joins, trains, exchanges with partners and writes its
summary; the counters see each trainer store its record and read the whole member list every record
interval, and see the nodes that hold the key serve more than the average; the monitor shows the whole
run; and once the benchmark has exited, nothing it started is still running (a peer, its DHT worker,
``p2pd``). The 32-peer numbers are the benchmark's (docs/benchmarks.md); this test keeps to what fits
in a few minutes on two busy cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests._processes import REPO, describe, heavy_scenario, kill_all, outliving

PEERS = 8
RECORD_INTERVAL_S = 3.0  # configs/membership-bench.yaml
BENCH_TIMEOUT_S = 900


def _descendants(besides: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """Live processes below this one (pytest is their subreaper: orphans count too), except the pids
    ``besides`` (what this worker ran before, e.g. its own ``torch_shm_manager``, which its tensors
    need: killing it aborts the worker at the next garbage collection)."""
    alive = []
    for proc in psutil.Process().children(recursive=True):
        if proc.pid in besides:
            continue
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def _bench(log_dir: Path) -> dict:
    """The benchmark's row for :data:`PEERS` trainers, and what of its processes outlived it."""
    out = log_dir / "rows.json"
    argv = [sys.executable, "-m", "scripts.bench_membership", "--peers", str(PEERS), "--warmup-s", "10"]
    argv += ["--window-s", "20", "--monitor", "--log-dir", str(log_dir), "--json", str(out)]
    before = frozenset(p.pid for p in _descendants())
    try:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    finally:  # even after a timeout (the benchmark killed): its peers go down with it, or are killed here
        left = outliving(lambda: _descendants(before), 30.0)
        described = [describe(p) for p in left]
        kill_all(left)
    assert out.exists(), f"the benchmark wrote no rows (exit {done.returncode}):\n{done.stderr[-4000:]}"
    [row] = json.loads(out.read_text())["rows"]
    return {"row": row, "status": done.returncode, "outlived": described, "output": done.stdout + done.stderr}


def _every_trainer_joins_trains_and_finds_partners(bench: dict) -> None:
    row = bench["row"]
    assert "error" not in row, row.get("error")
    assert bench["status"] == 0, bench["output"][-4000:]
    assert row["summaries"] == PEERS
    assert row["rounds"] >= 2 * PEERS, "each trainer should have averaged a few rounds"
    assert row["partner_share"] >= 0.5, f"most rounds find a partner: {row['partner_share']:.0%}"


def _membership_traffic_is_counted_per_peer_and_at_the_key_holders(bench: dict) -> None:
    membership, sizes = bench["row"]["membership"], bench["row"]["sizes"]
    record = sizes["store_request_bytes"]
    assert 500 < record < 5000, f"a signed record is about a kilobyte, counted {record} B"
    # every trainer stores its record on the key's holders and reads the whole list every interval
    nodes = PEERS + 1
    assert membership["peer_sent"]["mean"] >= record / RECORD_INTERVAL_S
    assert membership["peer_received"]["mean"] >= 0.5 * nodes * record / RECORD_INTERVAL_S
    assert sizes["find_response_bytes"] > record
    # the holders of the key serve more than an average node does
    assert membership["holder_mean"] > membership["served_total"] / nodes


def _monitor_once_shows_the_whole_run(bench: dict) -> None:
    monitor = bench["row"]["monitor"]
    for variant in ("config", "published"):
        assert monitor[variant]["status"] == 0, variant
        totals = monitor[variant]["totals"]
        assert totals["trainers"] == PEERS, (variant, totals)
        assert totals["samples_total"] > 0


def _nothing_outlives_the_benchmark(bench: dict) -> None:
    memory = bench["row"]["memory"]
    assert memory["rss"] > 0 and memory["p2pd_rss"] > 0, memory
    assert bench["row"]["leftover"] == []
    assert bench["outlived"] == []


@heavy_scenario
@pytest.mark.multipeer
@pytest.mark.timeout(BENCH_TIMEOUT_S + 120)
def test_eight_trainers_on_one_machine(tmp_path: Path) -> None:
    """One run of the benchmark (minutes), then each check on it."""
    bench = _bench(tmp_path)
    _every_trainer_joins_trains_and_finds_partners(bench)
    _membership_traffic_is_counted_per_peer_and_at_the_key_holders(bench)
    _monitor_once_shows_the_whole_run(bench)
    _nothing_outlives_the_benchmark(bench)
