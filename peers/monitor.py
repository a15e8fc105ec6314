"""`swarm monitor`: list the live members of a run (the full live view is its own issue).

The monitor joins the DHT in client mode and never announces, so it never counts as a member.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from peers import _common as common
from peers._common import open_node
from swarm.config import RunConfig

if TYPE_CHECKING:
    from swarm import Member, NodeInfo
    from swarm.network import NetworkOptions

FORMATS = ("json", "table")

monitor_app = typer.Typer(help="Watch a run: who is in the swarm and how training goes.")


@monitor_app.callback(invoke_without_command=True)
def monitor(
    ctx: typer.Context,
    config: Path | None = common.CONFIG_OPTION,
    set_: list[str] | None = common.SET_OPTION,
    initial_peers: list[str] | None = common.INITIAL_PEERS_OPTION,
    once: bool = typer.Option(False, "--once", help="Print the members once and exit."),
    output_format: str = typer.Option("table", "--format", help="table or json."),
    wait: float = typer.Option(10.0, "--wait", min=0.0, help="Seconds to wait for the first records."),
) -> None:
    """Show the live members of a run (joins in client mode; never counts as a member)."""
    if ctx.invoked_subcommand is not None:
        return
    if output_format not in FORMATS:
        common.fail(f"--format {output_format!r} is not one of {', '.join(FORMATS)}")
    cfg = common.load_run_config(config, set_)
    network = common.resolve_network(cfg, common.NetworkFlags(initial_peers=initial_peers, client_mode=True))
    if not network.initial_peers:
        common.fail("swarm monitor needs --initial-peers")
    with common.shutdown_on_signals() as stop:
        run_monitor_once(cfg, network, output_format=output_format, wait_s=wait, stop=stop)
        while not once and not stop.wait(cfg.monitor.refresh_s):
            run_monitor_once(cfg, network, output_format=output_format, wait_s=0.0, stop=stop)


def member_to_json(member: Member, now: float) -> dict[str, Any]:
    """One member as a JSON object: its record fields plus ``expires_in_s`` (stable schema, see docs)."""
    return {**member.record.dict(), "expires_in_s": round(member.expires_at - now, 3)}


def observer_info(config: RunConfig) -> NodeInfo:
    """Identity of a read-only observer; it never announces, so the role is nominal."""
    from swarm import NodeInfo

    return NodeInfo(run_id=config.run.run_id, config_hash=config.config_hash(), role="trainer")


def run_monitor_once(
    config: RunConfig, network: NetworkOptions, *, output_format: str, wait_s: float, stop: threading.Event
) -> list[Member]:
    """Print the live members once and return them.

    Waits up to ``wait_s`` for the first records to arrive (a freshly started monitor may ask before its
    routing table is warm); an empty swarm prints an empty list.
    """
    from hivemind.utils.timed_storage import get_dht_time

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
