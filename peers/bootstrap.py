"""`swarm bootstrap`: a stable entry peer that others join through.

It announces itself like any peer (role ``bootstrap``) and prints the line a joiner pastes. That line is
a contract other tools parse: ``swarm join --initial-peers <multiaddr>`` alone on a line.
"""

from __future__ import annotations

import threading

import typer

from peers._common import open_node
from swarm import NodeInfo, SwarmNode, describe_device
from swarm.config import RunConfig
from swarm.network import NetworkOptions

JOIN_LINE_PREFIX = "swarm join --initial-peers "


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
        maddr = pick_public_maddr(node)
        typer.echo(f"bootstrap peer {node.peer_id} is up for run {config.run.run_id!r}")
        typer.echo("join this swarm with:")
        typer.echo(join_line(maddr))
        config_hint = f" --config {config_path}" if config_path else ""
        typer.echo(f"(joiners need the same run config{config_hint}; config hash {config.config_hash()})")
        typer.echo(f"watch it with: swarm monitor --initial-peers {maddr}{config_hint}", err=False)
        while not stop.wait(timeout=1.0):
            pass
        typer.echo("bootstrap: shutting down")
