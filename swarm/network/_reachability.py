"""Reachability dial-back: a peer asks other live members whether they can reach it at the addresses it
announces. Here the protocol and the checker's side; the asker's is in ``_reachability_ask.py``.

One raw hivemind binary stream per check, on ``swarm.reach.v{PROTOCOL_VERSION}.{run_id}``::

    asker                                            checker
    REQUEST {"addresses": [maddr, ...]}  ──────────▶  (each must be in the asker's own record)
                                         ◀──────────  REPLY {"reachable": [...], "unreachable": [...]}
                                      or ◀──────────  ERROR {"error": "..."}

The checker opens a plain TCP connection (with a timeout) to the ip and port of each
``/ip4|ip6/<ip>/tcp/<port>`` address. A successful connect proves that *something* accepts TCP
connections there from the checker's network position, i.e. the port is open and forwarded; it does not
prove that it is the asker's libp2p daemon (no handshake), nor that every peer on the internet can reach
it. It only dials addresses the asking peer announces in its own signed membership record, and of
those only the ones whose ip is the one the asker's connection comes from (the remote address the p2p
daemon reports for the stream): a peer cannot make a checker probe loopback or LAN ports, or someone
else's host, by announcing them. Addresses with another ip are answered as ``not_dialled``; a request
that arrives through a relay has no direct source and is refused. Each asker is checked at most once
per ``CHECK_COOLDOWN_S``, each source ip at most ``MAX_CHECKS_PER_SOURCE`` times and the checker as a
whole at most ``MAX_CHECKS_PER_WINDOW`` times per ``RATE_WINDOW_S``, so fresh peer ids buy no more
connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import ipaddress
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from multiaddr import Multiaddr

from swarm._protocol import protocol_id
from swarm.p2p import (
    P2PFactory,
    ProtocolError,
    StreamService,
    dump_json,
    parse_json,
    read_message,
    write_message,
)

if TYPE_CHECKING:
    from hivemind.dht import DHT

    from swarm.network._swarm_key import SwarmKey

logger = logging.getLogger(__name__)

MAX_ADDRESSES = 16
"""At most this many addresses per check (a membership record holds at most 16)."""
MAX_ADDRESS_CHARS = 256
MESSAGE_MAX_BYTES = 8192
IO_TIMEOUT_S = 10.0
"""Bound on opening the stream and on each read and write, both sides."""
ANNOUNCED_LOOKUP_TIMEOUT_S = IO_TIMEOUT_S / 2
"""How long an ``announced`` callback should let its DHT lookup take, well within the checker's bound."""
DIAL_TIMEOUT_S = 3.0
"""Bound on each TCP connect the checker makes."""
MAX_CONCURRENT_CHECKS = 4
"""A checker runs at most this many checks at once; further ones get ``{"error": "busy"}``."""
CHECK_COOLDOWN_S = 30.0
"""A checker dials for the same asker at most once in this many seconds."""
RATE_WINDOW_S = 60.0
MAX_CHECKS_PER_SOURCE = 8
"""Checks a checker runs per ``RATE_WINDOW_S`` for askers connecting from one ip (several peers may
share a NAT or a host), however many peer ids they use."""
MAX_CHECKS_PER_WINDOW = 64
"""Checks a checker runs per ``RATE_WINDOW_S`` in all."""

_SOURCE_IP: contextvars.ContextVar[str | None] = contextvars.ContextVar("reach_source_ip", default=None)
"""The ip the stream being served comes from (set per stream task by the checker's ``_serve``)."""

AnnouncedAddresses = Callable[[str], Sequence[str] | None]
"""``announced(peer_id)``: the addresses in that peer's membership record, None if it has none."""


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3


SERVICE = "reach"
"""The service's name in its handler's protocol id (the checker's ``StreamService.protocol``)."""


def handler_name(run_id: str) -> str:
    return protocol_id(SERVICE, run_id)


class RequestRefused(ProtocolError):
    """The checker will not check this request (the message says why)."""


def parse_request(payload: bytes) -> list[str]:
    """The addresses a request asks about; RequestRefused names what is wrong with it."""
    try:
        obj = parse_json(payload)
    except ProtocolError as exc:
        raise RequestRefused(str(exc)) from None
    addresses = obj.get("addresses")
    if not isinstance(addresses, list) or not addresses:
        raise RequestRefused("field 'addresses' must be a non-empty list")
    if len(addresses) > MAX_ADDRESSES:
        raise RequestRefused(f"{len(addresses)} addresses; at most {MAX_ADDRESSES} per check")
    for address in addresses:
        if not isinstance(address, str) or not 0 < len(address) <= MAX_ADDRESS_CHARS:
            raise RequestRefused(f"an address is not a string of 1..{MAX_ADDRESS_CHARS} characters")
    return list(dict.fromkeys(addresses))


def dial_target(address: str) -> tuple[str, int] | None:
    """(ip, port) of an ``/ip4|ip6/<ip>/tcp/<port>[/p2p/<id>]`` address; None for anything not dialable
    by a plain TCP connect (DNS names, relays, unspecified or multicast ips, malformed text)."""
    try:
        parts = [(proto.name, value) for proto, value in _components(Multiaddr(address))]
    except Exception:  # py-multiaddr raises several unrelated types for bad input
        return None
    if len(parts) < 2 or parts[0][0] not in ("ip4", "ip6") or parts[1][0] != "tcp":
        return None
    if any(name != "p2p" for name, _ in parts[2:]):
        return None
    try:
        ip, port = ipaddress.ip_address(parts[0][1]), int(parts[1][1])
    except ValueError:
        return None
    if ip.is_unspecified or ip.is_multicast or not 0 < port < 65536:
        return None
    return str(ip), port


def source_ip(remote: Any) -> str | None:
    """The ip of a connection's remote multiaddr as the p2p daemon reports it (``/ip4/<ip>/tcp/<port>``);
    None for a relayed (``/p2p-circuit``) or otherwise indirect connection."""
    try:
        parts = [(proto.name, value) for proto, value in _components(Multiaddr(str(remote)))]
        if not parts or parts[0][0] not in ("ip4", "ip6") or any(n == "p2p-circuit" for n, _ in parts):
            return None
        return _normal_ip(parts[0][1])
    except Exception:  # py-multiaddr raises several unrelated types for bad input
        return None


def _normal_ip(text: str) -> str:
    ip = ipaddress.ip_address(text)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


def dialable_from(address: str, source: str | None) -> tuple[str, int] | None:
    """The dial target of ``address`` if the asker connected from its ip (``source``), else None: a
    checker dials an asker back only where the asker's own connection came from."""
    target = dial_target(address)
    if target is None or source is None or _normal_ip(target[0]) != source:
        return None
    return target


class CheckLimits:
    """Per-asker cooldown, per-source-ip and global budgets of dial-back checks (monotonic seconds).

    Only touched on the checker's loop thread. Every table is pruned on each call, so it holds at most
    one entry per check admitted in the last window."""

    def __init__(
        self,
        cooldown_s: float = CHECK_COOLDOWN_S,
        window_s: float = RATE_WINDOW_S,
        per_source: int = MAX_CHECKS_PER_SOURCE,
        total: int = MAX_CHECKS_PER_WINDOW,
    ) -> None:
        self.cooldown_s, self.window_s, self.per_source, self.total = cooldown_s, window_s, per_source, total
        self._last_check: dict[str, float] = {}
        self._recent: deque[tuple[float, str]] = deque()  # (time, source ip), oldest first

    def admit(self, peer: str, source: str, now: float) -> None:
        """Count one check of ``peer`` connecting from ``source``; RequestRefused if over a budget."""
        self._last_check = {p: t for p, t in self._last_check.items() if now - t < self.cooldown_s}
        while self._recent and now - self._recent[0][0] >= self.window_s:
            self._recent.popleft()
        if peer in self._last_check:
            raise RequestRefused(f"asked too often: one check per {self.cooldown_s:g} s")
        if sum(1 for _, ip in self._recent if ip == source) >= self.per_source:
            raise RequestRefused(
                f"asked too often from {source}: {self.per_source} checks per {self.window_s:g} s"
            )
        if len(self._recent) >= self.total:
            raise RequestRefused("busy: too many checks lately")
        self._last_check[peer] = now
        self._recent.append((now, source))


def _components(maddr: Multiaddr) -> list[tuple[Any, str]]:
    return [(proto, maddr.value_for_protocol(proto.code)) for proto in maddr.protocols()]


async def tcp_reachable(host: str, port: int, timeout: float = DIAL_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port opens within ``timeout`` seconds."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return True


# ---------------------------------------------------------------------------- checker


class ReachabilityChecker(StreamService):
    """Answers dial-back requests of other members on this peer's P2P daemon.

    Give ``dht`` (a running ``hivemind.DHT``: we open our own client to its daemon) or ``p2p_factory``.
    ``announced(peer_id)`` returns the addresses the asker announces in its record; it is called in a
    worker thread and may block for a DHT lookup (bounded by ``IO_TIMEOUT_S``).
    """

    what = "reachability check"
    protocol = SERVICE
    io_timeout_s = IO_TIMEOUT_S

    def __init__(
        self,
        announced: AnnouncedAddresses,
        dht: DHT | None = None,
        run_id: str = "",
        *,
        p2p_factory: P2PFactory | None = None,
        dial_timeout_s: float = DIAL_TIMEOUT_S,
        cooldown_s: float = CHECK_COOLDOWN_S,
        swarm_key: SwarmKey | None = None,
    ) -> None:
        super().__init__(run_id, dht=dht, p2p_factory=p2p_factory, swarm_key=swarm_key)
        self._announced, self._dial_timeout = announced, dial_timeout_s
        self.limits = CheckLimits(cooldown_s)
        self.checks = 0
        self._start(f"reach-{run_id}")

    async def _serve(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Remember where this stream's connection comes from (the daemon's ``StreamInfo.addr``)."""
        _SOURCE_IP.set(source_ip(getattr(info, "addr", None)))
        await super()._serve(info, reader, writer)

    async def _handle(self, peer: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The one place that reads a request from and writes an answer to an asking peer."""
        try:
            kind, payload = await read_message(reader, Kind, lambda kind: MESSAGE_MAX_BYTES, IO_TIMEOUT_S)
            if kind is not Kind.REQUEST:
                raise RequestRefused(f"expected REQUEST, got {kind.name}")
            answer = await self._answer(peer, payload)
            await write_message(writer, Kind.REPLY, dump_json(answer), IO_TIMEOUT_S)
        except RequestRefused as exc:
            logger.info("refused a reachability check for %s: %s", peer, exc)
            with contextlib.suppress(Exception):
                await write_message(writer, Kind.ERROR, dump_json({"error": str(exc)[:500]}), IO_TIMEOUT_S)

    async def _answer(self, peer: str, payload: bytes) -> dict[str, list[str]]:
        addresses = parse_request(payload)
        if self._active > MAX_CONCURRENT_CHECKS:
            raise RequestRefused("busy")
        announced = await asyncio.wait_for(asyncio.to_thread(self._announced, peer), IO_TIMEOUT_S)
        if announced is None:
            raise RequestRefused(f"no membership record of {peer} announces addresses")
        allowed = {_strip_peer_id(a, peer) for a in announced}
        for address in addresses:
            if _strip_peer_id(address, peer) not in allowed:
                raise RequestRefused(f"address {address!r} is not announced in the record of {peer}")
        source = _SOURCE_IP.get()
        if source is None:
            raise RequestRefused("the request came through a relay: no direct address to dial back")
        self.limits.admit(peer, source, time.monotonic())
        targets = [dialable_from(a, source) for a in addresses]
        dialled = [(a, t) for a, t in zip(addresses, targets, strict=True) if t is not None]
        results = await asyncio.gather(*(tcp_reachable(*t, self._dial_timeout) for _, t in dialled))
        self.checks += 1
        return {
            "reachable": [a for (a, _), ok in zip(dialled, results, strict=True) if ok],
            "unreachable": [a for (a, _), ok in zip(dialled, results, strict=True) if not ok]
            + [a for a, t in zip(addresses, targets, strict=True) if t is None and dial_target(a) is None],
            "not_dialled": [
                a for a, t in zip(addresses, targets, strict=True) if t is None and dial_target(a)
            ],
        }


def _strip_peer_id(address: str, peer: str) -> str:
    suffix = f"/p2p/{peer}"
    return address[: -len(suffix)] if address.endswith(suffix) else address
