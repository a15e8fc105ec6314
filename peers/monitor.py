"""`swarm monitor`: a live view of a run (table, JSON, Prometheus, history) and `swarm monitor plot`.

The monitor joins the DHT in client mode and never announces, so it never counts as a member. All
numbers come from :func:`swarm.metrics.build_snapshot`; the modules here only render them. Heavy
imports (hivemind, the network stack) happen inside functions so that ``swarm --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import typer

from peers import _common as common
from peers._signals import end_if_stopped, mark_started, shutdown_on_signals
from swarm.config import RunConfig
from swarm.metrics import DEFAULT_MAX_DRIFT

if TYPE_CHECKING:
    from swarm import Member, NodeInfo, SwarmNode
    from swarm.metrics import SnapshotPolicy, SwarmSnapshot
    from swarm.network import NetworkOptions

FORMATS = ("table", "json", "jsonl")

monitor_app = typer.Typer(help="Watch a run: who is in the swarm and how training goes.")


@monitor_app.callback(invoke_without_command=True)
def monitor(
    ctx: typer.Context,
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    initial_peers: list[str] | None = common.INITIAL_PEERS_OPTION,
    run_id: str | None = typer.Option(
        None, "--run-id", help="Watch this run (shortcut for --set run.run_id=ID)."
    ),
    once: bool = typer.Option(False, "--once", help="Print one snapshot and exit."),
    output_format: str = typer.Option("table", "--format", help="table, json (one document) or jsonl."),
    wait: float = typer.Option(10.0, "--wait", min=0.0, help="Seconds to wait for the first records."),
    prometheus_port: int | None = typer.Option(
        None, "--prometheus-port", min=0, max=65535, help="Serve metrics here (0: any free port)."
    ),
    prometheus_host: str = typer.Option(
        "127.0.0.1", "--prometheus-host", help="Address for --prometheus-port."
    ),
    history: Path | None = typer.Option(None, "--history", help="Append one JSON line per refresh to FILE."),
    max_drift: float = typer.Option(
        DEFAULT_MAX_DRIFT, "--max-drift", min=0.0, help="Warn about peers whose reported drift exceeds this."
    ),
    http: str | None = typer.Option(
        None, "--http", help="Serve a status page, /api/snapshot.json and /metrics on HOST:PORT."
    ),
    http_allow_host: list[str] | None = typer.Option(
        None,
        "--http-allow-host",
        help="Also answer --http requests for this host name (repeatable; addresses are always answered).",
    ),
    tensorboard_dir: Path | None = typer.Option(
        None,
        "--tensorboard-dir",
        help="Write swarm scalars as TensorBoard event files to DIR (default: monitor.tensorboard_dir).",
    ),
) -> None:
    """Show the live members of a run (joins in client mode; never counts as a member)."""
    if ctx.invoked_subcommand is not None:
        return
    if output_format not in FORMATS:
        common.fail(f"--format {output_format!r} is not one of {', '.join(FORMATS)}")
    http_address = _http_address(http, once) if http is not None else None
    overrides = [*(set_ or []), *([f"run.run_id={run_id}"] if run_id else [])]
    flags = common.NetworkFlags(initial_peers=initial_peers, client_mode=True)
    with (
        shutdown_on_signals(acknowledge="monitor: stopping", starting=True) as stop,
        contextlib.ExitStack() as closing,
    ):
        cfg, network, node = _watched_run(config, overrides, flags, closing, stop)
        if not network.initial_peers:
            common.fail("swarm monitor needs --initial-peers")
        port = prometheus_port if prometheus_port is not None else cfg.monitor.prometheus_port
        history_path = history or (Path(cfg.monitor.history_path) if cfg.monitor.history_path else None)
        sinks = _open_sinks(output_format, once, prometheus_host, port, history_path)
        try:
            tensorboard = tensorboard_dir or cfg.monitor.tensorboard_dir
            sinks.extras = _open_extra_sinks(
                http_address, tensorboard, cfg.monitor.refresh_s, history_path, http_allow_host or []
            )
            policy = snapshot_policy(cfg, max_drift, trusted=_initial_peer_ids(network))
            run_monitor(cfg, network, sinks, policy=policy, once=once, wait_s=wait, stop=stop, node=node)
        finally:
            sinks.close()


def _watched_run(
    path: Path | None,
    overrides: list[str],
    flags: common.NetworkFlags,
    closing: contextlib.ExitStack,
    stop: threading.Event,
) -> tuple[RunConfig, NetworkOptions, SwarmNode | None]:
    """The run config to watch with, its network options, and the node to watch through (None: open one).

    With ``--config`` (or no initial peers) the file (or the defaults) as always. Otherwise the config
    the swarm publishes, fetched through one client-mode node that then watches the run: one DHT start,
    not two. One line says which config it is; a second only when ``--set`` changed its hash (a peer
    would then show as incompatible). `swarm config pull` writes the whole config.
    """
    from peers import _compat_check, config_cmd

    config = common.load_run_config(path, overrides)
    network = common.resolve_network(config, flags)
    if path is not None or not network.initial_peers:
        return config, network, None
    asked = config.run.run_id if config.run.run_id != RunConfig().run.run_id else None  # --run-id, --set
    node = closing.enter_context(_compat_check.open_probe(network, config))
    end_if_stopped(stop)
    wait_s = config_cmd.PUBLISHED_CONFIG_WAIT_S
    deadline = time.monotonic() + wait_s
    view = _compat_check.look_at_swarm(node, network, asked)
    while view.published_yaml is None and time.monotonic() + config_cmd.LOOK_AGAIN_S < deadline:
        stop.wait(config_cmd.LOOK_AGAIN_S)  # nothing to wait on: the record appears in another node
        end_if_stopped(stop)
        view = _compat_check.look_at_swarm(node, network, asked)
    if view.published_yaml is None:
        common.fail(config_cmd.nothing_published(view, network, wait_s))
    published, config = config_cmd.load_published(view.published_yaml, overrides)
    typer.echo(
        f"monitor: run {published.run.run_id!r}, with the config the swarm publishes (config hash "
        f"{published.config_hash()}, signature and hash checked; swarm config pull writes it)",
        err=True,
    )
    if config.config_hash() != published.config_hash():
        typer.echo(f"run config: with your overrides its config hash is {config.config_hash()}", err=True)
    if node is not None:
        node.observe_run(config.run.run_id, config.config_hash(), config.run.member_shards)
    return config, common.resolve_network(config, flags), node


def _initial_peer_ids(network: NetworkOptions) -> list[str]:
    from peers._compat_check import initial_peer_ids

    return initial_peer_ids(network)


@monitor_app.command("plot")
def plot(
    history: Path = typer.Option(
        ..., "--history", exists=True, dir_okay=False, help="History file (JSON lines)."
    ),
    output: Path = typer.Option(..., "--output", "-o", help="PNG file to write."),
) -> None:
    """Draw loss and throughput over time (one line per peer plus the swarm) from a history file."""
    from peers._monitor_plot import plot_history
    from swarm.metrics import read_history

    snapshots = read_history(history)
    if not snapshots:
        common.fail(f"{history} holds no snapshots")
    plot_history(snapshots, output)
    typer.echo(f"wrote {output} ({len(snapshots)} snapshots)")


def observer_info(config: RunConfig) -> NodeInfo:
    """Identity of a read-only observer; it never announces, so the role is nominal."""
    from swarm import NodeInfo

    run = config.run
    return NodeInfo(run.run_id, config.config_hash(), "trainer", member_shards=run.member_shards)


def snapshot_policy(
    config: RunConfig, max_drift: float = DEFAULT_MAX_DRIFT, *, trusted: Iterable[str] = ()
) -> SnapshotPolicy:
    """What this monitor compares peers against: its protocol, its config, its thresholds; ``trusted``:
    the initial peers, whose bootstrap records carry the run's totals (trainers that left included)."""
    from swarm import PROTOCOL_VERSION
    from swarm.metrics import SnapshotPolicy

    return SnapshotPolicy(
        protocol_version=PROTOCOL_VERSION,
        config_hash=config.config_hash(),
        run_id=config.run.run_id,
        stale_after_s=config.monitor.stale_after_s,
        record_ttl_s=config.network.record_ttl_s,
        max_drift=max_drift,
        target_samples=config.run.target_samples,
        trusted_peers=frozenset(trusted),
    )


def run_monitor(
    config: RunConfig,
    network: NetworkOptions,
    sinks: _Sinks,
    *,
    policy: SnapshotPolicy,
    once: bool,
    wait_s: float,
    stop: threading.Event,
    node: SwarmNode | None = None,
) -> SwarmSnapshot | None:
    """Refresh every ``monitor.refresh_s`` until ``stop`` (or once); return the last snapshot. ``node``:
    an open, non-announcing node of the run to watch through (None: one is opened, and closed)."""
    from hivemind.utils.timed_storage import get_dht_time

    from swarm.metrics import build_snapshot

    snapshot = None
    with contextlib.ExitStack() as closing:
        if node is None:
            node = closing.enter_context(
                common.open_node(network, observer_info(config), config, announce=False)
            )
        mark_started(stop)  # from here a Ctrl+C ends the loop (and the sinks close) instead
        members = wait_for_members(node, wait_s, stop)
        while True:
            snapshot = build_snapshot(members, snapshot, get_dht_time(), policy)
            sinks.emit(snapshot)
            if once or stop.wait(config.monitor.refresh_s):
                return snapshot
            members = node.members()


def wait_for_members(node: SwarmNode, wait_s: float, stop: threading.Event) -> list[Member]:
    """A freshly started monitor may ask before its routing table is warm: retry for ``wait_s``."""
    deadline = time.monotonic() + wait_s
    members = node.members()
    while not members and time.monotonic() < deadline and not stop.wait(0.25):
        members = node.members()
    return members


class _Sink(Protocol):
    def update(self, snapshot: SwarmSnapshot) -> None: ...

    def close(self) -> None: ...


class _Sinks:
    """Where each snapshot goes: the terminal (table / json / jsonl), Prometheus, a history file, and
    the ``extras`` (the status page, TensorBoard)."""

    def __init__(self, output_format: str, once: bool, exporter=None, history=None):
        from peers._monitor_output import TerminalOutput

        self.terminal = TerminalOutput(output_format, live=not once)
        self.exporter = exporter
        self.history = history
        self.extras: list[_Sink] = []

    def emit(self, snapshot: SwarmSnapshot) -> None:
        if self.exporter is not None:
            self.exporter.update(snapshot)
        if self.history is not None:
            self.history.append(snapshot)
        for sink in self.extras:
            sink.update(snapshot)
        self.terminal.show(snapshot)

    def close(self) -> None:
        self.terminal.close()
        if self.exporter is not None:
            self.exporter.close()
        for sink in self.extras:
            sink.close()


def _open_sinks(output_format: str, once: bool, host: str, port: int | None, history: Path | None) -> _Sinks:
    exporter = writer = None
    if port is not None:
        from peers._monitor_prometheus import PrometheusExporter

        try:
            exporter = PrometheusExporter(host, port)
        except OSError as exc:
            common.fail(f"cannot serve Prometheus metrics on {host}:{port}: {exc}")
        typer.echo(f"prometheus metrics at http://{host}:{exporter.port}/metrics", err=True)
    if history is not None:
        from swarm.metrics import HistoryWriter

        writer = HistoryWriter(history)
    return _Sinks(output_format, once, exporter, writer)


def _http_address(text: str, once: bool) -> tuple[str, int]:
    from peers._monitor_http import parse_http_address

    if once:
        common.fail("--http serves a live page; it does not go with --once")
    try:
        return parse_http_address(text)
    except ValueError as exc:
        common.fail(f"--http: {exc}")


def _open_extra_sinks(
    http: tuple[str, int] | None,
    tensorboard: str | Path | None,
    refresh_s: float,
    history: Path | None,
    allowed_hosts: list[str],
) -> list[_Sink]:
    """The status page (plots seeded from the ``--history`` file, if any; answering ``Host`` names in
    ``allowed_hosts`` besides addresses) and the TensorBoard writer."""
    extras: list[_Sink] = []
    if http is not None:
        extras.append(_open_status_page(*http, refresh_s, history, allowed_hosts))
    if tensorboard is not None:
        from peers._monitor_tensorboard import TensorBoardSink

        try:
            extras.append(TensorBoardSink(Path(tensorboard).expanduser()))
        except (ImportError, OSError) as exc:
            for sink in extras:
                sink.close()
            common.fail(f"cannot write TensorBoard events to {tensorboard}: {exc}")
        typer.echo(f"tensorboard events in {tensorboard}", err=True)
    return extras


def _open_status_page(
    host: str, port: int, refresh_s: float, history: Path | None, allowed_hosts: list[str]
) -> _Sink:
    from peers._monitor_http import StatusServer, url_of
    from swarm.metrics import read_history

    seed = read_history(history) if history is not None and history.is_file() else []
    try:
        server = StatusServer(host, port, refresh_s=refresh_s, seed=seed, allowed_hosts=allowed_hosts)
    except OSError as exc:
        common.fail(f"--http: cannot serve on {url_of(host, port)}: {exc}")
    typer.echo(f"status page at {server.url}", err=True)
    return server
