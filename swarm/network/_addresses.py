"""Validation of every network address a user types, before anything reaches the p2p daemon.

Addresses are libp2p multiaddrs (``/ip4/1.2.3.4/tcp/31337/p2p/Qm...``). A malformed one would otherwise
surface as an opaque daemon start-up failure minutes later, so we parse each with py-multiaddr first
and raise :class:`AddressError` quoting the offending text.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from multiaddr import Multiaddr

from swarm._errors import SwarmError


class AddressError(SwarmError, ValueError):
    """A user-supplied address or address option is malformed or contradictory."""


def parse_maddr(text: str, *, what: str = "address", require_peer_id: bool = False) -> Multiaddr:
    """Parse one multiaddr, raising :class:`AddressError` that quotes ``text`` when it is malformed.

    :param what: how the address is called in the error message (e.g. ``"initial peer"``).
    :param require_peer_id: the address must end in ``/p2p/<peer id>`` (true for initial peers,
        which hivemind dials by peer id).
    """
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{what} {text!r} is empty; expected a multiaddr like /ip4/1.2.3.4/tcp/31337")
    try:
        maddr = Multiaddr(text.strip())
    except Exception as exc:  # py-multiaddr raises several unrelated types for bad input
        hint = _multiaddr_hint(text.strip(), require_peer_id)
        raise AddressError(f"malformed {what} {text!r}: {exc}{hint}") from None
    has_peer_id = "p2p" in {proto.name for proto in maddr.protocols()}
    if require_peer_id and not has_peer_id:
        raise AddressError(f"{what} {text!r} has no /p2p/<peer id> part; copy the full address it printed")
    return maddr


_HOST_PORT = re.compile(
    r"^(?:[a-z][a-z0-9+.-]*://)?\[?(?P<host>[^/\s\[\]]+?)\]?:(?P<port>\d{1,5})(?P<peer>/p2p/\S+)?/?$",
    re.IGNORECASE,
)


def _multiaddr_hint(text: str, require_peer_id: bool) -> str:
    """For a ``host:port`` (or ``tcp://host:port``) address, the multiaddr form it was meant as."""
    match = _HOST_PORT.match(text)
    if match is None:
        return ""
    host, port = match.group("host"), match.group("port")
    try:
        protocol = f"ip{ipaddress.ip_address(host).version}"
    except ValueError:
        protocol = "dns"
    peer = match.group("peer") or ("/p2p/<peer id>" if require_peer_id else "")
    return f"; addresses are multiaddrs: write it as /{protocol}/{host}/tcp/{port}{peer}"


def parse_maddrs(texts: Iterable[str], *, what: str, require_peer_id: bool = False) -> list[Multiaddr]:
    """Parse several multiaddrs; the first malformed one raises :class:`AddressError`."""
    return [parse_maddr(text, what=what, require_peer_id=require_peer_id) for text in texts]


@dataclass(frozen=True)
class ListenOptions:
    """Where a peer listens and what it tells others, after shortcut expansion."""

    host_maddrs: list[str]
    announce_maddrs: list[str]


def expand_listen_options(
    *,
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    port: int | None = None,
    public_ip: str | None = None,
    host_maddrs_given: bool = False,
    announce_maddrs_given: bool = False,
) -> ListenOptions:
    """Expand the ``--port``/``--public-ip`` shortcuts (as in Petals) into multiaddrs and validate all.

    ``--port N`` listens on all IPv4 and IPv6 interfaces on TCP port N; ``--public-ip IP`` announces
    ``/ip4/IP/tcp/N`` (or ``/ip6/...``) and so needs ``--port``. A shortcut cannot be mixed with the raw
    option it replaces (``host_maddrs_given``/``announce_maddrs_given`` say whether the user set those).
    """
    if port is not None:
        if host_maddrs_given:
            raise AddressError("use either --port or --host-maddrs, not both")
        if not 0 < port < 65536:
            raise AddressError(f"--port {port} is out of range 1..65535")
        host_maddrs = [f"/ip4/0.0.0.0/tcp/{port}", f"/ip6/::/tcp/{port}"]
    if public_ip is not None:
        if announce_maddrs_given:
            raise AddressError("use either --public-ip or --announce-maddrs, not both")
        if port is None:
            raise AddressError("--public-ip needs --port: peers must know which port to dial")
        announce_maddrs = [_announce_maddr(public_ip, port)]
    parse_maddrs(host_maddrs, what="host address")
    parse_maddrs(announce_maddrs, what="announce address")
    return ListenOptions(host_maddrs=list(host_maddrs), announce_maddrs=list(announce_maddrs))


def _announce_maddr(public_ip: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(public_ip)
    except ValueError:
        raise AddressError(f"--public-ip {public_ip!r} is not an IPv4 or IPv6 address") from None
    return f"/ip{ip.version}/{ip}/tcp/{port}"
