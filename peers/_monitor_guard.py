"""What the status page (peers/_monitor_http.py) admits: connections, request heads, Host names.

Anyone who reaches the port is a stranger, and a page bound to loopback is reached by every local
process and, through DNS rebinding, by any web page the user's browser shows. So:

* **Connections.** At most ``max_connections`` at once and ``max_per_ip`` per client address; one
  more takes the slot of the connection (of its address, or of all) that has waited longest for a
  request head, and is answered ``503`` only when every one of them is being answered. A connection
  must complete its request head (request line and headers) within ``header_timeout_s`` of opening
  or of its previous response, however slowly it trickles bytes, or it is closed; a response still
  being sent then gets one more such period (a slow reader). Idle connections and slowloris heads
  therefore hold a slot for ``header_timeout_s`` at most, and only until someone needs it.
* **Heads.** At most ``max_header_bytes`` and ``max_headers`` headers (431; a head still incomplete
  past ``max_header_bytes`` gets h11's 400); requests with a body are refused (413): the page only
  serves GETs.
* **Host.** A browser tricked by DNS rebinding sends the attacker's name as ``Host``, never an IP
  address or ``localhost``. A server bound to a loopback address answers only a ``Host`` that is
  ``localhost`` or a loopback address, with its port; bound to another address it also takes any IP
  address with its port. Names the user allows (``--http-allow-host``) are taken on any port. Bound
  to every address (``0.0.0.0``, ``::``) with no name allowed it answers any ``Host``: that page is
  meant to be shared by name, and rebinding can read it (documented in docs/monitor.md). Others get
  ``421`` and a message that says why.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on what strangers may hold of the status page (see the module docstring)."""

    max_connections: int = 64
    max_per_ip: int = 16
    header_timeout_s: float = 10.0
    max_header_bytes: int = 8192
    max_headers: int = 64


_BUSY_TEXT = b"too many connections to this status page; try again shortly\n"
_BUSY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT)
)


_REFUSED_LINGER_S = 1.0
"""How long a refused connection may stay open for its 503 to be read (it holds no slot)."""


class _Gate:
    """Open connections, in all and per client address (used on the server's event loop only).

    A connection over a limit takes the slot of the one (of its address, or of all) that has waited
    longest for a request head; only when every connection concerned is being answered is it refused.
    """

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.open: dict[str, set[_GuardedProtocol]] = {}

    def admit(self, conn: _GuardedProtocol) -> bool:
        mine = self.open.get(conn.ip, set())
        if len(mine) >= self.limits.max_per_ip and not self._evict(mine):
            return False
        everyone = set().union(*self.open.values())
        if len(everyone) >= self.limits.max_connections and not self._evict(everyone):
            return False
        self.open.setdefault(conn.ip, set()).add(conn)
        return True

    def release(self, conn: _GuardedProtocol) -> None:
        mine = self.open.get(conn.ip, set())
        mine.discard(conn)
        if not mine:
            self.open.pop(conn.ip, None)

    def _evict(self, conns: set[_GuardedProtocol]) -> bool:
        waiting = [conn for conn in conns if conn.waiting_since is not None]
        if not waiting:
            return False
        min(waiting, key=lambda conn: conn.waiting_since or 0.0).drop()
        return True


class _GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the connection limits and the request-head deadline."""

    gate: ClassVar[_Gate]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.ip = self.client[0] if self.client else ""
        self._deadline: asyncio.TimerHandle | None = None
        self._armed_at = self.loop.time()
        self._waited_for: object = None
        self._admitted = self.gate.admit(self)
        if not self._admitted:
            self._refuse(transport)
            return
        self._arm()

    @property
    def waiting_since(self) -> float | None:
        """Since when it waits for a request head (None while a response is being sent)."""
        sending = self.cycle is not None and not self.cycle.response_complete
        return None if sending or not self._admitted else self._armed_at

    def drop(self) -> None:
        """Give up its slot and close it."""
        self._release()
        self.transport.close()

    def _refuse(self, transport: asyncio.Transport) -> None:
        """Answer 503 and close: at the client's EOF or soon after. What it sends meanwhile is read and
        dropped (closing on unread data would reset the connection, losing the answer)."""
        transport.write(_BUSY)
        transport.write_eof()
        linger = min(_REFUSED_LINGER_S, self.gate.limits.header_timeout_s)
        self._deadline = self.loop.call_later(linger, transport.close)

    def data_received(self, data: bytes) -> None:
        if self._admitted:
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._release()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._admitted:
            self._admitted = False
            self.gate.release(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request head is due within the timeout

    def _arm(self) -> None:
        self._disarm()
        self._armed_at = self.loop.time()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.gate.limits.header_timeout_s, self._overdue)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _overdue(self) -> None:
        """No complete request head in time: close, unless a response is being sent (it gets one more
        period, for a slow reader; its completion re-arms the deadline)."""
        self._deadline = None
        sending = self.cycle is not None and not self.cycle.response_complete
        if sending and self._waited_for is not self.cycle:
            self._waited_for = self.cycle
            self._arm()
            return
        self.transport.close()  # uvicorn's connection_lost ends the h11 connection and the cycle


def guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """A protocol class for one server: its connections share one :class:`_Gate`."""
    return type("GuardedH11Protocol", (_GuardedProtocol,), {"gate": _Gate(limits)})


class HostRule:
    """Which ``Host`` headers a server bound to ``bound_ip:port`` answers (module docstring)."""

    def __init__(self, bound_ip: str, port: int, allowed_names: Iterable[str] = ()) -> None:
        address = ipaddress.ip_address(bound_ip.split("%")[0])
        self.port = port
        self.loopback = address.is_loopback
        self.names = {parsed[0] for parsed in map(_split_host, allowed_names) if parsed is not None}
        self.any_host = address.is_unspecified and not self.names

    def refusal(self, host: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused, or None when it is answered."""
        if self.any_host:
            return None
        if host is None:
            return "a Host header is required"
        parsed = _split_host(host)
        if parsed is None:
            return f"Host {host!r} is malformed"
        name, port = parsed
        if name in self.names:
            return None
        if name == "localhost" or _is_address(name, loopback_only=self.loopback):
            if port == self.port:
                return None
            return f"Host {host!r} names port {port}, this page is on port {self.port}"
        what = "localhost or a loopback address" if self.loopback else "localhost or an IP address"
        return (
            f"Host {host!r} is refused: this page answers {what} with its port "
            "(a foreign name is how DNS rebinding reads a local page); "
            "allow a name with swarm monitor --http-allow-host NAME"
        )


def _normal_name(name: str) -> str:
    return name.strip().lower().rstrip(".")


def _split_host(host: str) -> tuple[str, int] | None:
    """``name[:port]`` / ``[v6][:port]`` as (lower-case name without brackets, port; 80 if none)."""
    host = host.strip()
    if host.startswith("["):
        name, bracket, rest = host[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:] if rest else ""
    else:
        name, colon, port_text = host.rpartition(":")
        if not colon:
            name, port_text = host, ""
        if ":" in name:
            return None
    if port_text and not (port_text.isascii() and port_text.isdigit() and len(port_text) <= 5):
        return None
    return (_normal_name(name), int(port_text) if port_text else 80) if name else None


def _is_address(name: str, *, loopback_only: bool) -> bool:
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return address.is_loopback or not loopback_only


class RequestGuard:
    """ASGI middleware in front of the page: header count, no request body, the :class:`HostRule`."""

    def __init__(self, app: ASGIApp, rule: HostRule, limits: HttpLimits) -> None:
        self.app = app
        self.rule = rule
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refused = self._refused(scope) if scope["type"] == "http" else None
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message = refused
        headers = {"Connection": "close", "X-Content-Type-Options": "nosniff"}
        response = PlainTextResponse(message + "\n", status_code=status, headers=headers)
        await response(scope, receive, send)

    def _refused(self, scope: Scope) -> tuple[int, str] | None:
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if len(headers) > self.limits.max_headers:
            return 431, f"more than {self.limits.max_headers} headers"
        if sum(len(name) + len(value) for name, value in headers) > self.limits.max_header_bytes:
            return 431, f"headers of more than {self.limits.max_header_bytes} bytes"
        names = [name for name, _ in headers]
        if b"transfer-encoding" in names or any(
            n == b"content-length" and v.strip() != b"0" for n, v in headers
        ):
            return 413, "this page takes no request body"
        hosts = [value for name, value in headers if name == b"host"]
        if len(hosts) > 1:
            return 400, "more than one Host header"
        reason = self.rule.refusal(hosts[0].decode("latin-1") if hosts else None)
        return (421, reason) if reason is not None else None
