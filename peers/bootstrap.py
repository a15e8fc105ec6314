"""`swarm bootstrap`: a stable entry peer that others join through.

It announces itself like any peer (role ``bootstrap``), publishes the run config in the DHT (``swarm
join`` and ``swarm monitor`` without ``--config`` use it, ``swarm config pull`` writes it to a file, and
a joiner with a differing ``--config`` is refused), checks that others can dial it back, optionally
keeps and serves the latest model state (``--serve-state``), and prints the line a joiner pastes.
That line is a contract other tools parse: ``swarm join --initial-peers <multiaddr>`` alone on a line.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import typer

from peers._common import close_relay, open_node, reachability_lines, start_relay
from swarm import NodeInfo, SwarmNode, describe_device
from swarm.config import RunConfig
from swarm.network import NetworkOptions

if TYPE_CHECKING:
    from swarm.membership import ConfigPublisher
    from swarm.state import StateMirror, StateSnapshot

JOIN_LINE_PREFIX = "swarm join --initial-peers "
CONFIG_PUBLISH_INTERVAL_S = 30.0
CONFIG_TTL_S = 120.0


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
) -> None:
    """Serve as an entry peer until ``stop`` is set; with ``serve_state`` keep and serve the model state."""
    device, memory = describe_device("cpu")
    info = NodeInfo(
        run_id=config.run.run_id,
        config_hash=config.config_hash(),
        role="bootstrap",
        public_name=public_name,
        device=device,
        device_memory_gb=memory,
    )
    mirror: StateMirror | None = None

    def status() -> dict[str, str]:  # the kept state's digest goes into our record: joiners ask for it
        return {"state_hash": mirror.digest if mirror is not None else ""}

    with open_node(network, info, config, status=status) as node:
        publisher = _start_publisher(node, config)
        relay = start_relay(node)
        try:
            _print_lines(node, config, config_path)
            if config.network.reachability_check:
                for line in reachability_lines(node.check_reachability(), "bootstrap"):
                    typer.echo(line)
            if serve_state:
                mirror = _start_mirror(node, config, state_dir, state_interval_s)
            while not stop.wait(timeout=1.0):
                pass
            typer.echo("bootstrap: shutting down")
        finally:
            if mirror is not None:
                mirror.close()
            close_relay(relay, "bootstrap")
            publisher.stop()


def _start_mirror(
    node: SwarmNode, config: RunConfig, state_dir: str | None, interval_s: float
) -> StateMirror:
    """Keep the latest state of the live trainers and serve it to joiners (see swarm/state/_mirror.py)."""
    from swarm.state import StateMirror

    mirror = StateMirror(
        node,
        interval_s=interval_s,
        state_dir=state_dir,
        config_hash=config.config_hash(),
        on_update=_print_kept_state,
    )
    where = f", saved to {state_dir}" if state_dir else ""
    typer.echo(f"bootstrap: keeping the latest model state every {interval_s:g}s for joiners{where}")
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
