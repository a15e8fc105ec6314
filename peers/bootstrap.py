"""`swarm bootstrap`: a stable entry peer that others join through.

It announces itself like any peer (role ``bootstrap``), publishes the run config in the DHT (``swarm
join`` and ``swarm monitor`` without ``--config`` use it, ``swarm config pull`` writes it to a file, and
a joiner with a differing ``--config`` is refused), checks that others can dial it back, optionally
keeps and serves the latest model state (``--serve-state``), and prints the line a joiner pastes.
That line is a contract other tools parse: ``swarm join --initial-peers <multiaddr>`` alone on a line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import typer

from peers._common import close_relay, open_node, reachability_lines, start_relay
from peers._signals import end_if_stopped, mark_started
from peers.monitor import snapshot_policy
from swarm import NodeInfo, SwarmNode, describe_device
from swarm.config import RunConfig
from swarm.network import NetworkOptions

if TYPE_CHECKING:
    from swarm.membership import ConfigPublisher
    from swarm.metrics import RunWatch
    from swarm.state import StateMirror, StateSnapshot

logger = logging.getLogger(__name__)

JOIN_LINE_PREFIX = "swarm join --initial-peers "
CONFIG_PUBLISH_INTERVAL_S = 30.0
CONFIG_TTL_S = 120.0
STATUS_INTERVAL_S = 60.0
"""How often the bootstrap prints where the run stands (trainers, samples, the state it keeps)."""


def join_line(maddr: str) -> str:
    """The copy-pasteable command a volunteer runs to join through ``maddr``."""
    return f"{JOIN_LINE_PREFIX}{maddr}"


def pick_public_maddr(node: SwarmNode) -> str:
    """The address to advertise: an announced one if configured, else the first IPv4 one."""
    maddrs = node.visible_maddrs()
    announced = [m for m in maddrs if any(m.startswith(a) for a in node.network.announce_maddrs)]
    ipv4 = [m for m in maddrs if m.startswith("/ip4/")]
    return (announced or ipv4 or maddrs)[0]


def run_bootstrap(
    config: RunConfig,
    network: NetworkOptions,
    *,
    public_name: str,
    config_path: str | None,
    stop: threading.Event,
    serve_state: bool = False,
    state_dir: str | None = None,
    state_interval_s: float = 60.0,
    state_min_donors: int | None = None,
    status_interval_s: float = STATUS_INTERVAL_S,
) -> None:
    """Serve as an entry peer until ``stop`` is set; with ``serve_state`` keep and serve the model state
    (the median of at least ``state_min_donors`` trainer states, default 3).

    Joins and leaves are printed as they are seen, where the run stands every ``status_interval_s``,
    and a summary at exit."""
    from swarm.metrics import RunWatch

    device, memory = describe_device("cpu")
    info = NodeInfo(
        run_id=config.run.run_id,
        config_hash=config.config_hash(),
        role="bootstrap",
        public_name=public_name,
        device=device,
        device_memory_gb=memory,
        member_shards=config.run.member_shards,
    )
    mirror: StateMirror | None = None
    watch: RunWatch | None = None

    def status() -> dict[str, object]:
        """The kept state's digest (joiners ask for it) and the run's totals, which outlive the
        trainers (a monitor started later reads them; swarm/metrics/_run.py)."""
        totals = watch.record_fields() if watch is not None else {}
        return {"state_hash": mirror.digest if mirror is not None else "", **totals}

    with open_node(network, info, config, status=status) as node:
        end_if_stopped(stop)  # Ctrl+C while the DHT started: no join line for a peer that is leaving
        publisher = _start_publisher(node, config)
        relay = start_relay(node)
        watcher = None
        try:
            end_if_stopped(stop)
            _print_lines(node, config, config_path)
            if config.network.reachability_check:
                for line in reachability_lines(node.check_reachability(), "bootstrap"):
                    typer.echo(line)
            end_if_stopped(stop)
            if serve_state:
                mirror = _start_mirror(node, config, state_dir, state_interval_s, state_min_donors)
            watch = RunWatch(snapshot_policy(config), node.peer_id)
            poll_s = config.network.record_interval_s
            watcher = _start_watcher(node, watch, mirror, status_interval_s, poll_s)
            mark_started(stop)
            stop.wait()  # the signal handler said "bootstrap: shutting down" (peers/cli.py)
        finally:
            if watcher is not None:
                watcher.stop()
            if mirror is not None:
                mirror.close()
            close_relay(relay, "bootstrap")
            publisher.stop()
    if watch is not None:
        typer.echo(summary_line(watch, mirror))


def _start_watcher(
    node: SwarmNode, watch: RunWatch, mirror: StateMirror | None, status_interval_s: float, poll_s: float
) -> _Watcher:
    """A thread that reads the members every ``poll_s``: prints joins and leaves at once, and where the
    run stands every ``status_interval_s`` (the main thread only waits for Ctrl+C)."""
    next_status = [time.monotonic() + status_interval_s]

    def look() -> None:
        change = watch.observe(node.members())
        live = watch.live_trainers - len(change.joined) + len(change.left)  # before this look
        for peer in change.left:
            live -= 1
            typer.echo(f"bootstrap: {_name(peer)} left: {live} trainer(s) live")
        for peer in change.joined:
            live += 1
            typer.echo(f"bootstrap: {_name(peer)} joined: {live} trainer(s) live")
        if time.monotonic() >= next_status[0]:
            next_status[0] = time.monotonic() + status_interval_s
            for line in status_lines(watch, mirror):
                typer.echo(line)

    return _Watcher(look, min(poll_s, status_interval_s))


class _Watcher:
    """Calls ``look`` every ``period_s`` on a thread of its own until :meth:`stop`; a failed look is
    logged and the next one goes on (a DHT hiccup must not silence the organizer's terminal)."""

    def __init__(self, look: Callable[[], None], period_s: float):
        self._look, self._period_s = look, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bootstrap-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._period_s):
            try:
                self._look()
            except Exception:
                logger.exception("could not read the run's members")

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=self._period_s + 5)


def _name(peer) -> str:
    from swarm.metrics import peer_name

    return peer_name(peer)


def status_lines(watch: RunWatch, mirror: StateMirror | None) -> list[str]:
    """Where the run stands: live trainers, samples, step; and what the state mirror holds, or why not."""
    lines = [
        f"bootstrap: {watch.live_trainers} trainer(s) live, {_count(watch.samples_total)} samples trained "
        f"({watch.samples_per_s:.1f} samples/s), step {watch.step}, {len(watch.seen)} trainer(s) seen"
    ]
    if mirror is not None:
        lines.append(f"bootstrap: state mirror {mirror_line(mirror)}")
    return lines


def mirror_line(mirror: StateMirror) -> str:
    """What the mirror holds, or why it holds nothing, with the way out when too few trainers are live."""
    status = mirror.status
    text = status.describe()
    if not status.holding and status.live_trainers and status.live_trainers < status.min_donors:
        text += (
            f" (--state-min-donors {status.live_trainers} keeps it from fewer, if you trust your trainers)"
        )
    return text


def summary_line(watch: RunWatch, mirror: StateMirror | None) -> str:
    """The bootstrap's last line: how long it served, who came, what the run trained, what it keeps."""
    up = time.time() - watch.started_at
    text = (
        f"bootstrap: summary: up {_duration(up)}, {len(watch.seen)} trainer(s) joined "
        f"(at most {watch.peak_trainers} at once), {_count(watch.samples_total)} samples trained, "
        f"step {watch.step}"
    )
    if mirror is not None:
        text += f"; state mirror {mirror_line(mirror)}"
    return text


def _count(value: int) -> str:
    for factor, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.1f}{suffix}"
    return str(value)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _start_mirror(
    node: SwarmNode, config: RunConfig, state_dir: str | None, interval_s: float, min_donors: int | None
) -> StateMirror:
    """Keep the latest state of the live trainers and serve it to joiners (see swarm/state/_mirror.py)."""
    from swarm.state import MIN_DONORS, StateMirror

    donors = MIN_DONORS if min_donors is None else min_donors
    mirror = StateMirror(
        node,
        interval_s=interval_s,
        state_dir=state_dir,
        config_hash=config.config_hash(),
        on_update=_print_kept_state,
        min_donors=donors,
    )
    where = f", saved to {state_dir}" if state_dir else ""
    typer.echo(
        f"bootstrap: keeping the latest model state every {interval_s:g}s for joiners{where}: the median "
        f"of at least {donors} distinct trainer state(s)"
    )
    if donors < MIN_DONORS:
        typer.echo(
            f"bootstrap: warning: --state-min-donors {donors}: a state from fewer than {MIN_DONORS} trainers "
            "is served to every joiner as it is; one broken or hostile trainer's model becomes theirs "
            "(docs/state-sync.md)"
        )
    mirror.start()
    return mirror


def _print_kept_state(snapshot: StateSnapshot) -> None:
    meta = snapshot.meta
    typer.echo(
        f"bootstrap: serving the state of round {meta.get('round')}, step {meta.get('step')}, "
        f"samples {meta.get('samples_total')} (digest {snapshot.digest[:12]})"
    )


def _start_publisher(node: SwarmNode, config: RunConfig) -> ConfigPublisher:
    """Publish the run config now (so a joiner can pull it once the join line is out) and keep it fresh."""
    from swarm.membership import ConfigPublisher

    publisher = ConfigPublisher(
        node.dht,
        config.run.run_id,
        config,
        node.signer,  # the node's identity key signs the published config like its records
        interval_s=CONFIG_PUBLISH_INTERVAL_S,
        ttl_s=CONFIG_TTL_S,
    )
    publisher.start()
    return publisher


def _print_lines(node: SwarmNode, config: RunConfig, config_path: str | None) -> None:
    maddr = pick_public_maddr(node)
    typer.echo(f"bootstrap peer {node.peer_id} is up for run {config.run.run_id!r}")
    typer.echo("join this swarm with:")
    typer.echo(join_line(maddr))
    source = f" ({config_path})" if config_path else ""
    typer.echo(
        f"(joiners and monitors fetch this run config{source} from the swarm, signed by this peer; "
        f"config hash {config.config_hash()})"
    )
    typer.echo(f"fetch the run config with: swarm config pull --initial-peers {maddr} -o run.yaml")
    typer.echo(f"or join in one command: scripts/join.sh {maddr}")
    typer.echo(f"watch it with: swarm monitor --initial-peers {maddr}")
