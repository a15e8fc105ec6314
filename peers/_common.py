"""What every peer command shares: option definitions, config + network resolution, logging, SIGUSR1."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import inspect
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer

from swarm.config import ConfigError, NetworkSection, RunConfig, load_config

if TYPE_CHECKING:  # the network stack imports torch and hivemind: load it only for commands that need it
    from swarm import NodeInfo, SwarmNode
    from swarm.network import NetworkOptions, ReachabilityResult
    from swarm.p2p import RelayForwarder

R = TypeVar("R")

CONFIG_OPTION = typer.Option(
    None,
    "--config",
    "-c",
    help="Run config YAML file. Omitted: join and monitor use the one the swarm behind --initial-peers "
    "publishes; other commands use the defaults.",
)
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
    behind_nat: bool | None = None
    relay: bool | None = None
    public_name: str = ""


# The network options of the peer commands (`swarm bootstrap` and `swarm join`), declared once: the
# parameter name (a field of NetworkFlags), its type, and its typer option.
NETWORK_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("initial_peers", list[str] | None, INITIAL_PEERS_OPTION),
    (
        "host_maddrs",
        list[str] | None,
        typer.Option(None, "--host-maddrs", help="Multiaddr to listen on. Repeatable."),
    ),
    (
        "announce_maddrs",
        list[str] | None,
        typer.Option(
            None, "--announce-maddrs", help="Multiaddr other peers should dial (e.g. behind NAT). Repeatable."
        ),
    ),
    (
        "port",
        int | None,
        typer.Option(None, "--port", help="Listen on this TCP port on all interfaces (IPv4 and IPv6)."),
    ),
    (
        "public_ip",
        str | None,
        typer.Option(None, "--public-ip", help="Announce this public IP (needs --port)."),
    ),
    (
        "identity_path",
        Path | None,
        typer.Option(
            None,
            "--identity-path",
            help="Private key file fixing the peer id; created (mode 0600) if missing.",
        ),
    ),
    (
        "client_mode",
        bool | None,
        typer.Option(
            None, "--client-mode/--no-client-mode", help="Only dial out; others cannot dial this peer."
        ),
    ),
    (
        "behind_nat",
        bool | None,
        typer.Option(
            None,
            "--behind-nat/--no-behind-nat",
            help="Behind NAT without a port forward: be reached through the initial peers, which relay "
            "(network.behind_nat).",
        ),
    ),
    (
        "relay",
        bool | None,
        typer.Option(
            None,
            "--relay/--no-relay",
            help="Relay for peers behind NAT that list this one among their initial peers (network.relay; "
            "a bootstrap always relays).",
        ),
    ),
    ("public_name", str, typer.Option("", "--public-name", help="A name shown in records and the monitor.")),
)


def with_network_options(command: Callable[..., R]) -> Callable[..., R]:
    """Give a typer command the network options (:data:`NETWORK_OPTIONS`) in one parameter.

    The command declares ``network_flags: NetworkFlags`` where the options belong in its ``--help``
    (any default: it is replaced); typer sees the options themselves there instead, and the command is
    called with what the user typed gathered in a :class:`NetworkFlags`. So `swarm bootstrap` and
    `swarm join` take exactly the same network flags, with the same help.
    """
    signature = inspect.signature(command, eval_str=True)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != "network_flags":
            parameters.append(parameter)
            continue
        parameters += [
            inspect.Parameter(name, parameter.kind, default=option, annotation=annotation)
            for name, annotation, option in NETWORK_OPTIONS
        ]
    if len(parameters) != len(signature.parameters) + len(NETWORK_OPTIONS) - 1:
        raise TypeError(f"{command.__name__} needs one parameter named network_flags")

    @functools.wraps(command)
    def with_flags(**kwargs: Any) -> R:
        given = {name: kwargs.pop(name) for name, _, _ in NETWORK_OPTIONS}
        identity = given.pop("identity_path")
        flags = NetworkFlags(**given, identity_path=str(identity) if identity else None)
        return command(**kwargs, network_flags=flags)

    with_flags.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    with_flags.__annotations__ = {p.name: p.annotation for p in parameters}
    return with_flags


def split_addresses(values: Sequence[str] | None) -> list[str] | None:
    """Accept repeated flags as well as several addresses in one space- or comma-separated value."""
    if not values:
        return None
    return [part for value in values for part in re.split(r"[\s,]+", value) if part]


def load_config_or_exit(path: str | os.PathLike[str] | None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a config; on any problem print each error line to stderr and exit with status 2."""
    try:
        return load_config(path, overrides=tuple(overrides))
    except ConfigError as exc:
        for line in exc.errors:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None


def load_run_config(path: Path | None, overrides: Sequence[str] | None) -> RunConfig:
    """Load the run config or exit 2 with every problem named."""
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
            behind_nat=net.behind_nat if flags.behind_nat is None else flags.behind_nat,
            relay=net.relay if flags.relay is None else flags.relay,
        )
    except (AddressError, SwarmKeyError) as exc:
        fail(str(exc))


def fail(message: str, status: int = 2) -> NoReturn:
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
    if result.status == "relay":
        outcome = (
            f"{who}: now reachable through relays at {', '.join(result.relay_addresses)}: "
            "it trains, exchanges and serves, but its traffic crosses a relay, and direct peers are "
            "preferred as partners"
        )
    else:
        outcome = (
            f"{who}: now running in client mode: it still trains and starts exchanges, but nobody dials it "
            "(or pass --behind-nat to be reached through the initial peers, which relay)"
        )
    return [
        f"{who}: no peer could dial this peer back at {', '.join(result.addresses)} "
        f"(asked {len(result.answered_by)} peer(s))",
        "to let other peers connect to you directly:",
        f"  1) open TCP port {port_text} in your firewall and forward it on your router to this machine",
        f"  2) pass --public-ip YOUR_PUBLIC_IP --port {port_text}",
        f"  3) or pass --announce-maddrs /ip4/YOUR_PUBLIC_IP/tcp/{port_text}",
        outcome,
    ]


def _port_of(addresses: Sequence[str]) -> int | None:
    match = next((re.search(r"/tcp/(\d+)", a) for a in addresses if "/tcp/" in a), None)
    return int(match.group(1)) if match else None


def setup_logging() -> None:
    """Plain, quiet logs on stderr: ours at ``SWARM_LOG_LEVEL`` (warnings by default), and hivemind's and
    py-multiaddr's only when they matter."""
    level = os.environ.get("SWARM_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # libraries whose DEBUG/INFO lines would drown ours (py-multiaddr logs every address it parses)
    for noisy in ("hivemind", "multiaddr"):
        logging.getLogger(noisy).setLevel(max(logging.getLevelName(level), logging.WARNING))


def enable_stack_dumps() -> None:
    """`kill -USR1 <pid>` prints every thread's stack to stderr: how a peer that seems hung is
    diagnosed. The DHT worker that hivemind forks inherits it."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def exit_now(code: int | str | None) -> NoReturn:
    """End the process with ``code`` (what :class:`SystemExit` takes) after the exit handlers, but
    without the interpreter's teardown (see :func:`peers.cli.main`)."""
    if isinstance(code, str):
        print(code, file=sys.stderr)
    status = code if isinstance(code, int) else (0 if code is None else 1)
    atexit._run_exitfuncs()  # logging's flush, multiprocessing's joins, coverage: as a normal exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def start_relay(node: SwarmNode) -> RelayForwarder:
    """Forward streams to the peers behind NAT that joined through this node (swarm/p2p/_forward.py)."""
    from swarm.p2p import RelayForwarder

    return RelayForwarder(node.info.run_id, dht=node.dht)


def close_relay(relay: RelayForwarder, who: str) -> None:
    """Stop relaying, and say what was carried (if anything)."""
    from swarm.p2p import FORWARDED

    relay.close()
    carried = FORWARDED.snapshot()
    if carried["streams"]:
        typer.echo(
            f"{who}: relayed {carried['streams']} stream(s) for peers behind NAT: "
            f"{carried['sent'] / 1e6:.2f} MB to them, {carried['received'] / 1e6:.2f} MB back"
        )
