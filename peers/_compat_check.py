"""Looking at a swarm before taking part: its run id, published config and members.

`swarm join` refuses to train with a config that differs from the swarm's (exit 2, the differing keys
listed), and `swarm config pull` fetches that config. Both open a short-lived *probe*: a client-mode
node with a throwaway identity that announces nothing, so it never shows up as a member and never
competes with the trainer for the user's identity or port.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from peers._common import open_node
from swarm.config import RunConfig

if TYPE_CHECKING:
    from swarm import SwarmNode
    from swarm.membership import Member
    from swarm.network import NetworkOptions

LOOKUP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class SwarmView:
    """What a probe saw: the run id it looked at, the chosen published config (if any), the members."""

    run_id: str
    published_yaml: str | None
    published_hash: str | None
    members: list[Member]


@contextmanager
def open_probe(network: NetworkOptions, config: RunConfig) -> Iterator[SwarmNode]:
    """A client-mode, non-announcing node on the swarm that ``network.initial_peers`` lead to."""
    from swarm import NodeInfo

    probe_network = dataclasses.replace(
        network,
        client_mode=True,
        identity_path=None,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
        announce_maddrs=[],
    )
    run = config.run
    info = NodeInfo(run.run_id, config.config_hash(), "trainer", member_shards=run.member_shards)
    node = open_node(probe_network, info, config, announce=False)
    try:
        yield node
    finally:
        node.close()


def initial_peer_ids(network: NetworkOptions) -> list[str]:
    """The peer ids at the end of the initial peers' multiaddrs (``.../p2p/<id>``)."""
    return [maddr.rstrip("/").rsplit("/", 1)[-1] for maddr in network.initial_peers]


def look_at_swarm(node: SwarmNode, network: NetworkOptions, run_id: str | None) -> SwarmView:
    """Find the run (``run_id``, else the one the initial peers host), its published config, its members.

    Only a config signed by one of the initial peers counts (the peer ids the user pasted): anyone can
    publish one, and trainers' records, which anyone can forge too, do not vote.
    """
    from swarm.membership import discover_run_id, fetch_run_config, list_members

    trusted = initial_peer_ids(network)
    run_id = run_id or discover_run_id(node.dht, trusted, LOOKUP_TIMEOUT_S)
    if run_id is None:
        return SwarmView(run_id="", published_yaml=None, published_hash=None, members=[])
    chosen = fetch_run_config(node.dht, run_id, trusted, LOOKUP_TIMEOUT_S)
    shards = chosen.config.run.member_shards if chosen is not None else node.info.member_shards
    members = list_members(node.dht, run_id, member_shards=shards, timeout_s=LOOKUP_TIMEOUT_S)
    if chosen is None:
        return SwarmView(run_id=run_id, published_yaml=None, published_hash=None, members=members)
    return SwarmView(run_id, chosen.yaml, chosen.config_hash, members)


def check_swarm_config(config: RunConfig, network: NetworkOptions) -> None:
    """Exit 2 listing every problem when ``config`` cannot train in the swarm; return when it can.

    The run looked at is the one the initial peers publish, so a different ``run.run_id`` is reported
    as a differing key instead of silently starting a separate, empty run.
    """
    from swarm.membership import compatibility_problems

    with open_probe(network, config) as node:
        view = look_at_swarm(node, network, None)
        if not view.run_id:  # nobody publishes a run: compare with our run's members only
            view = look_at_swarm(node, network, config.run.run_id)
    problems = compatibility_problems(config, view.published_yaml, view.members)
    if problems:
        for line in problems:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2)
