"""peers/monitor sinks without a network: table rendering, Prometheus exporter, plot, CLI input errors."""

from __future__ import annotations

import io
import json
import urllib.request

import numpy as np
import pytest
from matplotlib import image as mpimg
from rich.console import Console
from typer.testing import CliRunner

from peers._format import duration, si
from peers._monitor_output import TerminalOutput
from peers._monitor_plot import loss_unit, plot_history
from peers._monitor_prometheus import PrometheusExporter
from peers._monitor_table import columns_for, render
from peers.cli import app
from swarm.metrics import HistoryWriter, SnapshotPolicy, build_snapshot
from tests._cli import refused_output
from tests.test_metrics import HASH, POLICY, T0, member, pid

runner = CliRunner()


def sample_snapshots(count: int = 6):
    policy = SnapshotPolicy(
        protocol_version=POLICY.protocol_version, config_hash=HASH, run_id="r", target_samples=10**6
    )
    snaps, previous = [], None
    for i in range(count):
        members = [
            member(
                n,
                T0 + 3 * i,
                loss=3.0 / (1 + i * n),
                samples_per_s=10.0 * n + i,
                samples_total=1000 * i * n,
                bytes_sent=10_000 * i * n,
                round=i,
                step=10 * i,
            )
            for n in (1, 2, 3)
        ] + [member(4, T0 + 3 * i, role="bootstrap", state="idle", public_name="entry", drift=0.9)]
        previous = build_snapshot(members, previous, T0 + 3 * i, policy)
        snaps.append(previous)
    return snaps


def test_table_fits_a_60_column_terminal_without_colour() -> None:
    console = Console(width=60, record=True, force_terminal=False, color_system=None)
    console.print(render(sample_snapshots()[-1], console.width))
    text = console.export_text()
    assert all(len(line) <= 60 for line in text.splitlines()), text
    for n in (1, 2, 3):
        assert pid(n)[-8:] in text
    assert "training" in text and "samples/s" in text and "! drift" in text
    assert "\x1b[" not in text


def test_header_says_the_unit_of_every_loss() -> None:
    console = Console(width=200, record=True, color_system=None)
    console.print(render(sample_snapshots()[-1], console.width))
    assert "loss mean 0.3201 best 0.1875 eval - bits/byte" in console.export_text()
    tokenized = [
        member(n, T0, loss=5.0 + n, eval_loss=6.0, eval_bits_per_byte=1.5, loss_unit="bits/token")
        for n in (1, 2)
    ]
    console = Console(width=200, record=True, color_system=None)
    console.print(render(build_snapshot(tokenized, None, T0, POLICY), console.width))
    assert "loss mean 6.5 best 6 eval 6 bits/token (1.5 bits/byte)" in console.export_text()


def test_plot_labels_the_loss_unit_of_its_history() -> None:
    snaps = [s.to_dict() for s in sample_snapshots(2)]
    assert loss_unit(snaps) == "bits/byte" and loss_unit([]) == "bits/byte"
    snaps[-1]["totals"]["loss_unit"] = "bits/token"
    assert loss_unit(snaps) == "bits/token"
    snaps[-1]["totals"]["loss_unit"] = "nats"  # a foreign line: the earlier snapshot's unit holds
    assert loss_unit(snaps) == "bits/byte"


def test_wide_table_shows_every_column() -> None:
    titles = [c.title for c in columns_for(200)]
    assert {
        "peer",
        "name",
        "role",
        "state",
        "version",
        "device",
        "samples/s",
        "round/step",
        "loss",
        "up",
        "down",
        "seen",
        "conn",
    } <= set(titles)
    assert len(columns_for(60)) < len(titles)


def test_formatting_helpers() -> None:
    assert si(None) == "-" and si(1234567.0, "B/s") == "1.2MB/s" and si(12) == "12"
    assert duration(None) == "-" and duration(75) == "1m15s" and duration(3 * 86400 + 7200) == "3d02h"
    # a peer's numbers are untrusted: garbage shows as "-", a clock ahead of ours as no time at all
    assert (
        si("12") == si(float("nan")) == si(True) == duration(float("inf")) == "-" and duration(-5.0) == "0s"
    )


def test_json_and_jsonl_output_is_the_documented_schema(capsys) -> None:
    last = sample_snapshots()[-1]
    TerminalOutput("jsonl", live=False).show(last)
    TerminalOutput("json", live=False).show(last)
    out = capsys.readouterr().out
    line, document = out.split("\n", 1)
    assert json.loads(line) == json.loads(document) == last.to_dict()
    doc = json.loads(line)
    assert doc["schema_version"] == 1
    assert set(doc) == {
        "schema_version",
        "time",
        "run_id",
        "reference_config_hash",
        "totals",
        "peers",
        "warnings",
        "retired_samples",
        "stages",
        "bottleneck_stage",
    }


def test_live_output_on_a_terminal_redraws_in_place() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    output = TerminalOutput("table", live=True, console=console)
    for snapshot in sample_snapshots(2):
        output.show(snapshot)
    output.close()
    assert "samples/s" in console.file.getvalue()


def test_prometheus_scrape_has_one_series_per_peer() -> None:
    exporter = PrometheusExporter("127.0.0.1", 0)
    try:
        assert urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read() == b""
        exporter.update(sample_snapshots()[-1])
        body = urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=10).read().decode()
    finally:
        exporter.close()
    series = [line for line in body.splitlines() if line.startswith("swarm_peer_samples_per_second{")]
    assert len(series) == 4
    assert any(
        f'peer_id="{pid(2)}"' in s and 'public_name="p2"' in s and 'role="trainer"' in s for s in series
    )
    assert "swarm_samples_per_second " in body and "swarm_eta_seconds " in body
    assert "# HELP swarm_loss_mean Mean recent training loss of active peers, in bits per token" in body


def test_plot_draws_more_than_a_blank_canvas(tmp_path) -> None:
    history = tmp_path / "h.jsonl"
    writer = HistoryWriter(history)
    for snapshot in sample_snapshots():
        writer.append(snapshot)
    out = tmp_path / "plots" / "run.png"
    result = runner.invoke(app, ["monitor", "plot", "--history", str(history), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(out)
    assert pixels.shape[0] > 300 and float(np.var(pixels[..., :3])) > 1e-3


def test_plot_of_history_without_losses_still_writes(tmp_path) -> None:
    snaps = [s.to_dict() for s in sample_snapshots(2)]
    for s in snaps:
        for p in s["peers"]:
            p["loss"] = None
    plot_history(snaps, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["monitor", "--format", "xml", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX"], "--format"),
        (["monitor", "--once"], "--initial-peers"),
        (["monitor", "--run-id", "bad id!", "--initial-peers", "/ip4/1.2.3.4/tcp/1"], "run.run_id"),
        (["monitor", "plot", "--history", "/nonexistent.jsonl", "--output", "x.png"], "does not exist"),
    ],
)
def test_bad_input_exits_2(args, needle) -> None:
    assert needle in refused_output(args)


def test_plot_of_empty_history_fails_cleanly(tmp_path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("garbage\n")
    output = refused_output(["monitor", "plot", "--history", str(empty), "--output", str(tmp_path / "o.png")])
    assert "no snapshots" in output


def test_the_monitor_watches_through_the_node_that_fetched_the_config_and_says_so_in_one_line(
    monkeypatch,
) -> None:
    """One DHT node (not a probe, closed, then a second node) and one line about the config, not the
    list of every key that differs from the defaults; the hash with overrides only when they change it."""
    from contextlib import contextmanager

    import peers._compat_check
    import peers.monitor
    from swarm.config import load_config
    from swarm.membership._run_config import shareable_config

    config = load_config("configs/local-tiny.yaml", env={})
    published = peers._compat_check.SwarmView(
        config.run.run_id, shareable_config(config).to_yaml(), config.config_hash(), []
    )

    class Probe:
        watched: tuple[str, str, int] | None = None
        closed = False

        def observe_run(self, run_id: str, config_hash: str, member_shards: int = 1) -> None:
            Probe.watched = (run_id, config_hash, member_shards)

    @contextmanager
    def probe(network, cfg):
        yield Probe()
        Probe.closed = True

    ran: dict = {}
    monkeypatch.setattr(peers._compat_check, "open_probe", probe)
    monkeypatch.setattr(peers._compat_check, "look_at_swarm", lambda node, network, run_id: published)
    monkeypatch.setattr(peers.monitor, "run_monitor", lambda cfg, net, sinks, **kw: ran.update(kw, cfg=cfg))
    peer = "/ip4/127.0.0.1/tcp/4000/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    result = runner.invoke(app, ["monitor", "--initial-peers", peer, "--once"])
    assert result.exit_code == 0, result.output
    assert isinstance(ran["node"], Probe) and Probe.closed  # the same node watched, closed at the end
    assert Probe.watched == (config.run.run_id, config.config_hash(), config.run.member_shards)
    assert ran["policy"].trusted_peers == {peer.rsplit("/", 1)[-1]}  # its bootstrap's totals count
    (line,) = result.output.splitlines()
    digest = config.config_hash()
    assert line.startswith("monitor: run 'local-tiny', with the config the swarm publishes")
    assert f"(config hash {digest}, signature and hash checked" in line
    changed = runner.invoke(app, ["monitor", "--initial-peers", peer, "--once", "--set", "train.lr=0.5"])
    assert changed.exit_code == 0 and len(changed.output.splitlines()) == 2
    assert f"with your overrides its config hash is {ran['cfg'].config_hash()}" in changed.output
