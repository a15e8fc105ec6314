"""`swarm monitor --http`: the status server in-process, its page in headless Chromium, the CLI's input
checks, and the whole command against a local swarm (multipeer)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import re
import signal
import socket
import urllib.error
import urllib.request

import pytest
from typer.testing import CliRunner

from peers._monitor_http import PlotHistory, StatusServer, parse_http_address
from peers.cli import app
from swarm.metrics import HistoryWriter, SnapshotPolicy, build_snapshot, read_history
from tests._browser import ARTIFACTS, Dom, chromium_or_skip, load
from tests._local_swarm import spawn_live_monitor, spawn_local_swarm
from tests._processes import outliving, session_processes, wait_until
from tests.test_metrics import HASH, POLICY, T0, member

runner = CliRunner()
PEER = "/ip4/127.0.0.1/tcp/4000/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
HOSTILE_NAME = "<img src=x onerror=\"document.title='pwned'\">"


def snapshots(count: int = 5, *, stages: bool = False, names: tuple[str, ...] = ("p1", "p2", "p3")):
    """Snapshots of 3 trainers (losses falling, counters rising) and a bootstrap whose drift warns."""
    policy = SnapshotPolicy(protocol_version=POLICY.protocol_version, config_hash=HASH, run_id="web")
    out, previous = [], None
    for i in range(count):
        members = [
            member(
                n, T0 + 3 * i, public_name=name, loss=3.0 / (1 + i), eval_loss=3.2 / (1 + i) + 0.1 * n,
                samples_per_s=10.0 * n + i, samples_total=1000 * i * n, bytes_sent=10_000 * i * n,
                bytes_received=5_000 * i * n, round=i, step=10 * i,
                stage=(n - 1) % 2 if stages else 0, stage_capacity=50.0 * n if stages else 0.0,
            )
            for n, name in enumerate(names, start=1)
        ]  # fmt: skip
        members.append(member(9, T0 + 3 * i, role="bootstrap", state="idle", public_name="entry", drift=0.9))
        previous = build_snapshot(members, previous, T0 + 3 * i, policy)
        out.append(previous)
    return out


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        (" localhost:0 ", ("localhost", 0)),
        ("0.0.0.0:65535", ("0.0.0.0", 65535)),
        ("[::1]:9000", ("::1", 9000)),
    ],
)
def test_http_address_parses(text, expected) -> None:
    assert parse_http_address(text) == expected


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("8080", "HOST:PORT"),
        ("127.0.0.1", "HOST:PORT"),
        ("127.0.0.1:", "HOST:PORT"),
        (":8080", "HOST:PORT"),
        ("localhost:http", "HOST:PORT"),
        ("127.0.0.1:-1", "HOST:PORT"),
        ("127.0.0.1:\uff18\uff10", "HOST:PORT"),  # full-width digits
        ("127.0.0.1:70000", "out of range"),
        ("::1:8080", "brackets"),
        ("a b:80", "not a host"),
        ("evil.example/x:80", "not a host"),
    ],
)
def test_bad_http_address_is_named(text, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_http_address(text)


def test_plot_history_keeps_the_whole_run_in_bounded_memory() -> None:
    history = PlotHistory(max_points=4)
    for i in range(10):
        history.add({"time": T0 + i, "totals": {"eval_loss_mean": 5.0 - i, "samples_per_s": 1.0}})
    history.add({"time": T0 + 3, "totals": {}})  # out of order: ignored
    history.add({"time": float("nan"), "totals": {}})
    history.add({"totals": {}})
    points = history.since(float("-inf"))
    times = [p["time"] for p in points]
    assert len(points) <= 4 and times == sorted(times)
    assert times[0] == T0 and times[-1] == T0 + 9  # first and latest kept
    assert points[-1]["eval_loss"] == -4.0 and points[-1]["loss"] is None
    assert [p["time"] for p in history.since(T0 + 8)] == [T0 + 9]


def test_server_serves_page_snapshot_history_and_metrics() -> None:
    snaps = snapshots()
    server = StatusServer("127.0.0.1", 0, refresh_s=1.0)
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, _, body = get(base + "/api/snapshot.json")
        assert status == 503 and "no snapshot yet" in json.loads(body)["error"]

        status, headers, page = get(base + "/")
        assert status == 200 and headers["content-type"].startswith("text/html")
        text = page.decode()
        assert 'data-refresh-ms="1000"' in text
        assert not re.search(r"(src|href)=\"?(https?:)?//", text), "the page loads nothing from elsewhere"
        (script,) = re.findall(r"<script>(.*?)</script>", text, flags=re.S)
        digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
        assert f"script-src 'sha256-{digest}'" in headers["content-security-policy"]
        assert "connect-src 'self'" in headers["content-security-policy"]

        for snapshot in snaps:
            server.update(snapshot)
        status, headers, body = get(base + "/api/snapshot.json")
        assert status == 200 and headers["content-type"] == "application/json"
        assert json.loads(body) == snaps[-1].to_dict()

        status, _, body = get(base + "/api/history.json")
        points = json.loads(body)
        assert [p["time"] for p in points] == [s.time for s in snaps]
        assert [p["eval_loss"] for p in points] == [s.totals.eval_loss_mean for s in snaps]
        assert [p["samples_per_s"] for p in points] == [s.totals.samples_per_s for s in snaps]
        assert len(json.loads(get(f"{base}/api/history.json?since={snaps[2].time}")[2])) == 2
        assert get(base + "/api/history.json?since=soon")[0] == 400

        status, headers, body = get(base + "/metrics")
        metrics = body.decode()
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert sum(line.startswith("swarm_peer_samples_per_second{") for line in metrics.splitlines()) == 4
        assert f"swarm_eval_loss_mean {snaps[-1].totals.eval_loss_mean}" in metrics
        assert get(base + "/nope")[0] == 404
    finally:
        server.close()
    assert not server._thread.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_server_plots_start_from_the_history_file(tmp_path) -> None:
    path = tmp_path / "h.jsonl"
    writer = HistoryWriter(path)
    for snapshot in snapshots(3):
        writer.append(snapshot)
    server = StatusServer("127.0.0.1", 0, seed=read_history(path))
    try:
        points = json.loads(get(f"http://127.0.0.1:{server.port}/api/history.json")[2])
    finally:
        server.close()
    assert len(points) == 3 and points[0]["eval_loss"] is not None


def test_busy_port_is_an_oserror() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy, pytest.raises(OSError):
        StatusServer("127.0.0.1", busy.getsockname()[1])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--http", "nonsense"], "--http: expected HOST:PORT"),
        (["--http", "127.0.0.1:99999"], "out of range"),
        (["--http", "127.0.0.1:0", "--once"], "does not go with --once"),
    ],
)
def test_cli_rejects_a_bad_http_option(args, needle) -> None:
    result = runner.invoke(app, ["monitor", "--initial-peers", PEER, *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_cli_names_a_busy_http_port() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        args = ["monitor", "--config", "configs/local-tiny.yaml", "--initial-peers", PEER]
        result = runner.invoke(app, [*args, "--http", f"127.0.0.1:{port}"])
    assert result.exit_code == 2, result.output
    assert f"cannot serve on http://127.0.0.1:{port}/" in result.output


def test_page_in_chromium_shows_stages_warnings_and_escapes_names(tmp_path) -> None:
    """The page draws what the API serves; a peer's name is text, never markup."""
    chromium_or_skip()
    snaps = snapshots(stages=True, names=("p1", HOSTILE_NAME, "p3"))
    server = StatusServer("127.0.0.1", 0, refresh_s=0.5)
    try:
        for snapshot in snaps:
            server.update(snapshot)
        html = load(server.url, tmp_path / "profile", "--dump-dom")
    finally:
        server.close()
    dom = Dom(html)
    assert "drift: entry: drift 0.9" in html  # the warnings list
    peers = dom.rows["peers"]
    assert [row["data-peer-id"] for row in dom.row_attrs["peers"]] == [p.peer_id for p in snaps[-1].peers]
    assert HOSTILE_NAME in [cells[1] for cells in peers]
    assert "img" not in dom.tags, "a peer's name became markup"
    assert "hidden" not in dom.by_id["stages-section"]
    assert [cells[0] for cells in dom.rows["stages"]] == ["0", "1"]
    assert int(dom.by_id["plot-loss"]["data-points"]) == len(snaps)
    assert int(dom.by_id["plot-rate"]["data-points"]) == len(snaps)
    assert dom.by_id["peers"]["data-rows"] == str(len(snaps[-1].peers))


NAMES = ("web-1", "web-<i>2</i>")


def _status_for_host(port: int, host: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/api/history.json", headers={"Host": host})
        return connection.getresponse().status
    finally:
        connection.close()


def _printed_snapshots(process) -> list[dict]:
    lines = process.output().splitlines()
    return [json.loads(line) for line in lines if line.startswith('{"schema_version"')]


def _api_snapshot(url: str) -> dict:
    status, _, body = get(url + "api/snapshot.json")
    return json.loads(body) if status == 200 else {}


def _wait_for_evaluated_trainers(url: str, monitor) -> dict:
    """The API's snapshot once both trainers have reported a held-out loss."""

    def evaluated() -> bool:
        peers = [p for p in _api_snapshot(url).get("peers", []) if p["role"] == "trainer"]
        return len(peers) == len(NAMES) and all(p["eval_loss"] is not None for p in peers)

    try:
        wait_until(evaluated, 120, "both trainers reporting an eval loss on /api/snapshot.json")
    except AssertionError as error:
        last = f"last snapshot: {_api_snapshot(url)}\nmonitor:\n{monitor.output()[-4000:]}"
        raise AssertionError(f"{error}\n{last}") from None
    return _api_snapshot(url)


def _assert_same_schema_as_printed(doc: dict, printed: dict) -> None:
    """/api/snapshot.json has the keys of what ``--format json``/``jsonl`` prints, at every level."""
    assert doc["schema_version"] == printed["schema_version"] == 1 and set(doc) == set(printed)
    assert set(doc["totals"]) == set(printed["totals"]) >= {"eval_loss_mean", "loss_mean", "samples_per_s"}
    peer_keys = set(printed["peers"][0])
    assert peer_keys >= {"peer_id", "public_name", "eval_loss"}
    assert all(set(peer) == peer_keys for peer in doc["peers"])


@pytest.mark.multipeer
def test_status_page_of_a_local_swarm_in_chromium(spawn, tmp_path) -> None:
    chromium_or_skip()
    _, maddr, _ = spawn_local_swarm(spawn, "web-entry", NAMES)
    tensorboard = tmp_path / "tb"
    page_args = ("--http", "127.0.0.1:0", "--http-allow-host", "monitor.test")
    monitor = spawn_live_monitor(spawn, maddr, *page_args, "--tensorboard-dir", str(tensorboard))
    line = monitor.wait_for_line(lambda text: text.startswith("status page at "), timeout=120)
    url = line.removeprefix("status page at ")
    port = int(re.search(r":(\d+)/$", url).group(1))

    doc = _wait_for_evaluated_trainers(url, monitor)
    _assert_same_schema_as_printed(doc, _printed_snapshots(monitor)[-1])
    trainer_ids = {p["public_name"]: p["peer_id"] for p in doc["peers"] if p["role"] == "trainer"}
    assert set(trainer_ids) == set(NAMES)
    metrics = get(url + "metrics")[2].decode()
    assert "swarm_trainers 2.0" in metrics and "swarm_eval_loss_mean " in metrics
    assert sum(s.startswith("swarm_peer_up{") and 'role="trainer"' in s for s in metrics.splitlines()) == 2
    assert _status_for_host(port, "monitor.test") == 200  # --http-allow-host
    assert _status_for_host(port, f"rebound.example:{port}") == 421

    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "monitor-status-page.png"
    screenshot.unlink(missing_ok=True)
    shot = (f"--screenshot={screenshot}", "--window-size=1280,1000")
    dom = Dom(load(url, tmp_path / "profile", "--dump-dom", *shot))
    rows = dict(zip([a["data-peer-id"] for a in dom.row_attrs["peers"]], dom.rows["peers"], strict=True))
    for name, peer_id in trainer_ids.items():
        assert peer_id in rows and rows[peer_id][1] == name, (name, rows)
    assert "i" not in dom.tags, "a trainer's name became markup"
    assert int(dom.by_id["plot-loss"]["data-points"]) >= 1, "the eval-loss plot drew nothing"
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 20_000
    print(f"status page screenshot: {screenshot}")

    monitor.signal(signal.SIGTERM)
    assert monitor.wait(timeout=30) == 0, monitor.output()
    assert not outliving(lambda: session_processes({monitor.sid}), 30), "the monitor left processes (p2pd)"
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard))
    events.Reload()
    assert events.Scalars("swarm/trainers")[-1].value == 2.0
    assert events.Scalars("swarm/eval_loss"), "no eval loss written to TensorBoard"


def test_the_page_reads_without_its_script() -> None:
    """The numbers are in the HTML the server sends: a page whose script never runs (blocked, a text
    browser, a slow machine) shows the run, its totals, its peers and its warnings, not "connecting"."""
    last = snapshots()[-1]
    server = StatusServer("127.0.0.1", 0, refresh_s=1.0)
    try:
        status, _, before = get(f"http://127.0.0.1:{server.port}/")
        assert status == 200 and "no snapshot yet" in before.decode()
        server.update(last)
        page = get(f"http://127.0.0.1:{server.port}/")[2].decode()
    finally:
        server.close()
    static = re.sub(r"<script>.*?</script>", "", page, flags=re.S)  # what a page without script shows
    assert "connecting" not in static and "__" not in static  # every placeholder filled
    assert '<span id="run-id">web</span>' in static and "training · updated" in static
    cards = dict(re.findall(r'<div class="label">(.*?)</div><div class="value">(.*?)</div>', static))
    totals = last.totals
    assert cards["samples trained"] == f"{totals.samples_total / 1e3:.1f}k"  # 24000 -> 24.0k
    assert cards["trainers"] == str(totals.trainers) == "3" and cards["run"] == "training"
    assert cards["train loss (best)"] == f"{totals.loss_best:.4f}"
    assert len(re.findall(r"<tr><td class=\"text id\">", static)) == len(last.peers) == 4
    assert "drift: entry" in static  # the bootstrap's drift warning
    assert '<meta http-equiv="refresh" content="1">' in page  # inside <noscript>: reloads itself


def test_the_page_escapes_what_peers_wrote_and_keeps_placeholders_as_text() -> None:
    from peers._monitor_http import render_page
    from peers._monitor_render import fill_page, total_cards

    last = snapshots(names=(HOSTILE_NAME, "__TOTALS__", "p3"))[-1]
    template, _ = render_page(1.0)
    page = fill_page(template, last.to_dict())
    assert "<img src=x" not in page and "&lt;img src=x" in page
    assert ">__TOTALS__<" in page  # a name that reads like a placeholder stays a name
    assert page.count('<div class="card">') == len(total_cards(last.to_dict()["totals"]))
