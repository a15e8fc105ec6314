"""`swarm bootstrap`: a stable entry peer that others join through.

It announces itself like any peer (role ``bootstrap``), publishes the run config in the DHT (joiners
fetch it with ``swarm config pull`` and are refused when theirs differs), and prints the line a joiner
pastes. That line is a contract other tools parse: ``swarm join --initial-peers <multiaddr>`` alone on a
line.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import typer

from peers._common import open_node
from swarm import NodeInfo, SwarmNode, describe_device
from swarm.config import RunConfig
from swarm.network import NetworkOptions

if TYPE_CHECKING:
    from swarm.membership._run_config import ConfigPublisher

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
) -> None:
    """Serve as an entry peer until ``stop`` is set."""
    device, memory = describe_device("cpu")
    info = NodeInfo(
        run_id=config.run.run_id,
        config_hash=config.config_hash(),
        role="bootstrap",
        public_name=public_name,
        device=device,
        device_memory_gb=memory,
    )
    with open_node(network, info, config) as node:
        publisher = _start_publisher(node, config)
        try:
            _print_lines(node, config, config_path)
            while not stop.wait(timeout=1.0):
                pass
            typer.echo("bootstrap: shutting down")
        finally:
            publisher.stop()


def _start_publisher(node: SwarmNode, config: RunConfig) -> ConfigPublisher:
    """Publish the run config now (so a joiner can pull it once the join line is out) and keep it fresh."""
    from swarm.membership._run_config import ConfigPublisher

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
    config_hint = f" --config {config_path}" if config_path else ""
    typer.echo(f"(joiners need the same run config{config_hint}; config hash {config.config_hash()})")
    typer.echo(f"fetch the run config with: swarm config pull --initial-peers {maddr} -o run.yaml")
    typer.echo(f"or join in one command: scripts/join.sh {maddr}")
    typer.echo(f"watch it with: swarm monitor --initial-peers {maddr}{config_hint}")
