"""`swarm monitor` against a real swarm on loopback: a bootstrap and 3 `swarm join` trainers, their
records spread over two DHT keys (``run.member_shards``): the bootstrap and the monitor read both."""

from __future__ import annotations

import json
import re
import signal
import urllib.request

import pytest

from swarm.membership import PROTOCOL_VERSION
from tests._local_swarm import SHARDED_RUN, spawn_live_monitor, spawn_local_swarm, spawn_monitor
from tests._processes import heavy_scenario, swarm_cli, wait_until

PEER_FIELDS = {
    "short_id", "peer_id", "public_name", "role", "state", "reported_state", "protocol_version",
    "package_version", "config_hash", "device", "device_memory_gb", "samples_per_s", "round", "step",
    "samples_total", "loss", "eval_loss", "drift", "bytes_sent", "bytes_received", "upload_bps",
    "download_bps", "syncs_per_min", "exchanges_ok", "exchanges_failed", "exchanges_rejected",
    "connectivity", "client_mode", "addresses", "started_at", "last_seen", "last_progress_at",
    "expires_in_s", "present", "compatible", "last_seen_ago_s", "stage", "stage_capacity",
    "eval_bits_per_byte", "loss_unit",
}  # fmt: skip
TOTAL_FIELDS = {
    "peers", "trainers", "stale", "incompatible", "samples_per_s", "samples_total", "loss_mean", "loss_best",
    "upload_bps", "download_bps", "syncs_per_min", "target_samples", "progress", "eta_s", "eval_loss_mean",
    "eval_bits_per_byte_mean", "loss_unit", "run_state",
}  # fmt: skip


def _json_document(output: str) -> dict:
    lines = output.splitlines()
    start = lines.index("{")
    return json.loads("\n".join(lines[start:]))


def _snapshot_lines(process) -> list[dict]:
    process.drain()
    return [json.loads(line) for line in process.lines if line.startswith('{"schema_version"')]


@heavy_scenario
@pytest.mark.multipeer
def test_monitor_against_a_local_swarm_of_three(spawn, tmp_path) -> None:
    names = [f"local-{n}" for n in (1, 2, 3)]
    boot, maddr, joiners = spawn_local_swarm(spawn, "local-bootstrap", names, SHARDED_RUN)
    for joiner in joiners:
        joiner.wait_for_line(lambda text: "joined run" in text, timeout=120)

    history = tmp_path / "history.jsonl"
    live = spawn_live_monitor(
        spawn, maddr, "--prometheus-port", "0", "--history", str(history), run=SHARDED_RUN
    )
    once = spawn_monitor(spawn, maddr, "--once", "--format", "json", run=SHARDED_RUN)
    assert once.wait(timeout=120) == 0, once.output()
    doc = _json_document(once.output())

    assert doc["schema_version"] == 1 and set(doc["totals"]) == TOTAL_FIELDS
    trainers = [p for p in doc["peers"] if p["role"] == "trainer"]
    assert sorted(p["public_name"] for p in trainers) == ["local-1", "local-2", "local-3"]
    assert [p["public_name"] for p in doc["peers"] if p["role"] == "bootstrap"] == ["local-bootstrap"]
    assert len(doc["peers"]) == 4  # the monitor itself is not a member
    for peer in doc["peers"]:
        assert set(peer) == PEER_FIELDS
        assert peer["protocol_version"] == PROTOCOL_VERSION and peer["compatible"] and peer["present"]
        expected_states = {"idle"} if peer["role"] == "bootstrap" else {"joining", "training", "syncing"}
        assert peer["state"] in expected_states and peer["connectivity"] == "direct"
    assert doc["totals"]["peers"] == 4 and doc["totals"]["incompatible"] == 0

    endpoint = live.wait_for_line(lambda text: "prometheus metrics at" in text, timeout=120)
    url = re.search(r"http://\S+", endpoint).group(0)
    wait_until(
        lambda: any(len(s["peers"]) == 4 for s in _snapshot_lines(live)), 120, "4 peers in the live view"
    )
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    series = [s for s in body.splitlines() if s.startswith("swarm_peer_samples_per_second{")]
    assert sum('role="trainer"' in s for s in series) == 3
    assert {re.search(r'public_name="([^"]*)"', s).group(1) for s in series} >= {
        "local-1",
        "local-2",
        "local-3",
    }
    wait_until(lambda: len(_snapshot_lines(live)) >= 2, 60, "a second refresh")

    live.signal(signal.SIGINT)
    assert live.wait(timeout=20) == 0, live.output()
    assert len(history.read_text().splitlines()) >= 2
    trained = _snapshot_lines(live)[-1]["totals"]["samples_total"]

    png = tmp_path / "run.png"
    plot = spawn(swarm_cli("monitor", "plot", "--history", str(history), "--output", str(png)))
    assert plot.wait(timeout=60) == 0, plot.output()
    assert png.read_bytes()[:4] == b"\x89PNG"

    for process in joiners:
        process.signal(signal.SIGTERM)
    for process in joiners:
        assert process.wait(timeout=20) == 0, process.output()
    _assert_the_run_outlives_its_trainers(spawn, boot, maddr, trained)


def _assert_the_run_outlives_its_trainers(spawn, boot, maddr: str, trained: int) -> None:
    """The trainers left: a monitor started now still shows what the run trained, as a finished run
    (the bootstrap kept the count and announces it), and the bootstrap named who came and went."""
    late = spawn_live_monitor(spawn, maddr, run=SHARDED_RUN)
    wait_until(
        lambda: any(s["totals"]["run_state"] == "finished" for s in _snapshot_lines(late)),
        120,
        "the late monitor to show a finished run",
    )
    finished = next(s for s in _snapshot_lines(late) if s["totals"]["run_state"] == "finished")
    assert finished["totals"]["trainers"] == 0 and finished["totals"]["samples_total"] >= trained > 0
    late.signal(signal.SIGINT)
    assert late.wait(timeout=20) == 0, late.output()
    boot.signal(signal.SIGTERM)
    assert boot.wait(timeout=20) == 0, boot.output()
    output = boot.output()
    for name in ("local-1", "local-2", "local-3"):
        assert re.search(rf"bootstrap: {name} \(\w+\) joined: \d trainer\(s\) live", output), output
        assert re.search(rf"bootstrap: {name} \(\w+\) left: \d trainer\(s\) live", output), output
    summary = boot.lines[-1]
    assert summary.startswith("bootstrap: summary: up ") and "3 trainer(s) joined" in summary, output
