"""`swarm monitor`: list the live members of a run (the full live view is its own issue).

The monitor joins the DHT in client mode and never announces, so it never counts as a member.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import typer
from hivemind.utils.timed_storage import get_dht_time

from peers._common import open_node
from swarm import Member, NodeInfo
from swarm.config import RunConfig
from swarm.network import NetworkOptions

FORMATS = ("json", "table")


def member_to_json(member: Member, now: float) -> dict[str, Any]:
    """One member as a JSON object: its record fields plus ``expires_in_s`` (stable schema, see docs)."""
    return {**member.record.dict(), "expires_in_s": round(member.expires_at - now, 3)}


def observer_info(config: RunConfig) -> NodeInfo:
    """Identity of a read-only observer; it never announces, so the role is nominal."""
    return NodeInfo(run_id=config.run.run_id, config_hash=config.config_hash(), role="trainer")


def run_monitor_once(
    config: RunConfig, network: NetworkOptions, *, output_format: str, wait_s: float, stop: threading.Event
) -> list[Member]:
    """Print the live members once and return them.

    Waits up to ``wait_s`` for the first records to arrive (a freshly started monitor may ask before its
    routing table is warm); an empty swarm prints an empty list.
    """
    with open_node(network, observer_info(config), config, announce=False) as node:
        deadline = time.monotonic() + wait_s
        members = node.members()
        while not members and time.monotonic() < deadline and not stop.wait(0.25):
            members = node.members()
    now = get_dht_time()
    if output_format == "json":
        typer.echo(json.dumps([member_to_json(m, now) for m in members], indent=2))
    else:
        _print_table(members, now)
    return members


def _print_table(members: list[Member], now: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(members)} live peers")
    for column in ("peer", "name", "role", "state", "version", "device", "step", "expires in"):
        table.add_column(column)
    for m in members:
        r = m.record
        table.add_row(
            m.peer_id[-8:],
            r.public_name,
            r.role,
            r.state,
            r.package_version,
            r.device,
            str(r.step),
            f"{m.expires_at - now:.0f}s",
        )
    Console().print(table)
