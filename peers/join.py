"""`swarm join`: join a run through an initial peer and announce this peer's record."""

from __future__ import annotations

import threading

import typer

from peers._common import open_node
from swarm import NodeInfo, describe_device
from swarm.config import RunConfig
from swarm.network import NetworkOptions


def run_join(config: RunConfig, network: NetworkOptions, *, public_name: str, stop: threading.Event) -> None:
    """Stay in the swarm, announcing this peer, until ``stop`` is set."""
    device, memory = describe_device(config.train.device)
    info = NodeInfo(
        run_id=config.run.run_id,
        config_hash=config.config_hash(),
        role="trainer",
        public_name=public_name,
        device=device,
        device_memory_gb=memory,
    )
    with open_node(network, info, config, status=lambda: {"state": "idle"}) as node:
        typer.echo(
            f"peer {node.peer_id} joined run {config.run.run_id!r} ({len(node.members())} members visible)"
        )
        while not stop.wait(timeout=1.0):
            pass
        typer.echo("join: shutting down")
