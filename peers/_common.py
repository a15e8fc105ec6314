"""What every peer command shares: option definitions, config + network resolution, signals, logging."""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from peers.config_cmd import load_config_or_exit
from swarm.config import NetworkSection, RunConfig

if TYPE_CHECKING:  # the network stack imports torch and hivemind: load it only for commands that need it
    from swarm import NodeInfo, SwarmNode
    from swarm.network import NetworkOptions, ReachabilityResult

CONFIG_OPTION = typer.Option(None, "--config", "-c", help="Run config YAML file (defaults if omitted).")
SET_OPTION = typer.Option(
    None, "--set", help="Override a config key, e.g. --set train.lr=1e-3. Repeatable.", show_default=False
)
INITIAL_PEERS_OPTION = typer.Option(
    None,
    "--initial-peers",
    help="Multiaddr of a peer already in the swarm (/ip4/.../tcp/.../p2p/...). Repeatable; "
    "several may also be given in one value separated by spaces or commas.",
    show_default=False,
)
HOST_MADDRS_OPTION = typer.Option(None, "--host-maddrs", help="Multiaddr to listen on. Repeatable.")
ANNOUNCE_MADDRS_OPTION = typer.Option(
    None, "--announce-maddrs", help="Multiaddr other peers should dial (e.g. behind NAT). Repeatable."
)
PORT_OPTION = typer.Option(None, "--port", help="Listen on this TCP port on all interfaces (IPv4 and IPv6).")
PUBLIC_IP_OPTION = typer.Option(None, "--public-ip", help="Announce this public IP (needs --port).")
IDENTITY_OPTION = typer.Option(
    None, "--identity-path", help="Private key file fixing the peer id; created (mode 0600) if missing."
)
CLIENT_MODE_OPTION = typer.Option(
    None, "--client-mode/--no-client-mode", help="Only dial out; others cannot dial this peer."
)
PUBLIC_NAME_OPTION = typer.Option("", "--public-name", help="A name shown in records and the monitor.")

SHUTDOWN_GRACE_S = 10.0
"""Peers must exit within this long after SIGINT/SIGTERM."""


@dataclass
class NetworkFlags:
    """The network options a user typed on the command line (None/empty = not given)."""

    initial_peers: list[str] | None = None
    host_maddrs: list[str] | None = None
    announce_maddrs: list[str] | None = None
    port: int | None = None
    public_ip: str | None = None
    identity_path: str | None = None
    client_mode: bool | None = None


def split_addresses(values: Sequence[str] | None) -> list[str] | None:
    """Accept repeated flags as well as several addresses in one space- or comma-separated value."""
    if not values:
        return None
    return [part for value in values for part in re.split(r"[\s,]+", value) if part]


def load_run_config(path: Path | None, overrides: Sequence[str] | None) -> RunConfig:
    """Load the run config or exit 2 with every problem named (see :mod:`peers.config_cmd`)."""
    return load_config_or_exit(path, tuple(overrides or ()))


def resolve_network(config: RunConfig, flags: NetworkFlags) -> NetworkOptions:
    """Merge command-line flags over the config's network section; exit 2 on a bad address or swarm key."""
    from swarm.network import AddressError, NetworkOptions, SwarmKeyError

    net: NetworkSection = config.network
    initial_peers = split_addresses(flags.initial_peers)
    host_maddrs = split_addresses(flags.host_maddrs)
    announce_maddrs = split_addresses(flags.announce_maddrs)
    try:
        return NetworkOptions.from_user_input(
            initial_peers=initial_peers if initial_peers is not None else net.initial_peers,
            host_maddrs=host_maddrs if host_maddrs is not None else net.host_maddrs,
            announce_maddrs=announce_maddrs if announce_maddrs is not None else net.announce_maddrs,
            identity_path=flags.identity_path or net.identity_path,
            client_mode=net.client_mode if flags.client_mode is None else flags.client_mode,
            startup_timeout_s=net.startup_timeout_s,
            port=flags.port,
            public_ip=flags.public_ip,
            host_maddrs_given=host_maddrs is not None,
            announce_maddrs_given=announce_maddrs is not None,
            swarm_key_file=net.swarm_key_file,
        )
    except (AddressError, SwarmKeyError) as exc:
        fail(str(exc))


def fail(message: str, status: int = 2) -> typer.Exit:
    """Print ``error: message`` to stderr and exit with ``status`` (2: bad input, 1: runtime failure)."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(status)


def open_node(
    network: NetworkOptions, info: NodeInfo, config: RunConfig, *, announce: bool = True, status=None
) -> SwarmNode:
    """Open this peer's :class:`SwarmNode`; a bad identity exits 2, an unreachable swarm exits 1."""
    from swarm import SwarmNode
    from swarm.network import IdentityError, NetworkError

    try:
        return SwarmNode(
            network,
            info,
            status=status,
            announce=announce,
            record_interval_s=config.network.record_interval_s,
            record_ttl_s=config.network.record_ttl_s,
        )
    except IdentityError as exc:
        fail(str(exc))
    except NetworkError as exc:
        fail(str(exc), status=1)


def reachability_lines(result: ReachabilityResult, who: str) -> list[str]:
    """What to tell the user about a reachability check; numbered advice when nobody could dial us."""
    if result.status == "disabled":
        return []
    if result.status == "skipped":
        return [f"{who}: reachability check skipped (no other peer to ask)"]
    if result.status == "unknown":
        reasons = "; ".join(result.errors) or "no answer"
        return [f"{who}: reachability unknown, no peer answered the check ({reasons})"]
    if result.status == "direct":
        where = ", ".join(result.reachable)
        return [f"{who}: reachability direct (dialled back by {len(result.answered_by)} peer(s) at {where})"]
    port = _port_of(result.addresses)
    port_text = str(port) if port is not None else "N"
    return [
        f"{who}: no peer could dial this peer back at {', '.join(result.addresses)} "
        f"(asked {len(result.answered_by)} peer(s))",
        "to let other peers connect to you:",
        f"  1) open TCP port {port_text} in your firewall and forward it on your router to this machine",
        f"  2) pass --public-ip YOUR_PUBLIC_IP --port {port_text}",
        f"  3) or pass --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/{port_text}",
        f"{who}: now running in client mode: it still trains and starts exchanges, but nobody dials it",
    ]


def _port_of(addresses: Sequence[str]) -> int | None:
    match = next((re.search(r"/tcp/(\d+)", a) for a in addresses if "/tcp/" in a), None)
    return int(match.group(1)) if match else None


def setup_logging() -> None:
    """Plain, quiet logs on stderr: our warnings, and hivemind's only when they matter."""
    level = os.environ.get("SWARM_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hivemind").setLevel(max(logging.getLevelName(level), logging.WARNING))


@contextmanager
def shutdown_on_signals() -> Iterator[threading.Event]:
    """Turn the first SIGINT/SIGTERM into a set event (clean shutdown); a second one interrupts at once.

    Processes forked while the handler is installed (hivemind's DHT worker) inherit it; there it does
    nothing, because their owner shuts them down in order.
    """
    stop = threading.Event()
    owner_pid = os.getpid()
    previous = {}

    def handler(signum: int, frame: object) -> None:
        if os.getpid() != owner_pid:
            return
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield stop
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
