"""Status-page sink: ``swarm monitor --http HOST:PORT`` serves, on one port,

* ``/``                   a live page (peers/_monitor_page.html: inline CSS and JS, plots on canvases);
* ``/api/snapshot.json``  the latest snapshot, in the schema of ``--format json`` (``SwarmSnapshot.to_dict``);
* ``/api/history.json``   points for the page's plots (``?since=T``: only those after DHT time ``T``);
* ``/metrics``            the Prometheus exposition of the same snapshot (the Prometheus sink's collector).

A Starlette app runs on a uvicorn server in a thread of its own, so the monitor loop stays as it is: each
refresh hands the snapshot to :meth:`StatusServer.update` and requests read the latest one. The socket
is bound before the thread starts, so a bad or busy address fails at once, in the caller. What the server
admits (connections, request heads, ``Host`` names) is peers/_monitor_guard.py's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import socket
import threading
from collections.abc import Iterable
from importlib import resources
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from peers._monitor_guard import HostRule, HttpLimits, RequestGuard, guarded_protocol
from peers._monitor_prometheus import SnapshotCollector
from peers._monitor_render import fill_page
from swarm.metrics import SwarmSnapshot

PAGE_FILE = "_monitor_page.html"
HISTORY_POINTS = 2000
"""Plot points kept in memory; when full, every other point is dropped, so the whole run stays in view."""

HISTORY_FIELDS = {
    "eval_loss": "eval_loss_mean",
    "loss": "loss_mean",
    "samples_per_s": "samples_per_s",
    "upload_bps": "upload_bps",
    "download_bps": "download_bps",
    "trainers": "trainers",
}
"""A plot point's fields and the ``totals`` entries they copy (the page plots them against time)."""

_HOST_CHARS = re.compile(r"^[A-Za-z0-9.:%_-]{1,253}$")


def parse_http_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6; port 0 picks a free one) as ``(host, port)``.

    Raises ValueError with a message saying what is wrong.
    """
    example = "e.g. 127.0.0.1:8080, 0.0.0.0:8080 or [::1]:8080"
    host, colon, port_text = text.strip().rpartition(":")
    if not colon or not host or not (port_text.isascii() and port_text.isdigit()) or len(port_text) > 5:
        raise ValueError(f"expected HOST:PORT ({example}), got {text!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 host goes in brackets ({example}), got {text!r}")
    if not _HOST_CHARS.match(host):
        raise ValueError(f"{host!r} is not a host name or IP address")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"port {port} is out of range (0..65535)")
    return host, port


def url_of(host: str, port: int) -> str:
    """The page's URL (IPv6 hosts in brackets)."""
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


class PlotHistory:
    """The page's plot points, oldest first: the :data:`HISTORY_FIELDS` of each snapshot's totals."""

    def __init__(self, max_points: int = HISTORY_POINTS):
        self.max_points = max(2, max_points)
        self._points: list[dict[str, Any]] = []

    def add(self, snapshot: dict[str, Any]) -> None:
        """Add one snapshot in its JSON form (live, or a line of a ``--history`` file)."""
        point = _plot_point(snapshot)
        if point is None or (self._points and point["time"] <= self._points[-1]["time"]):
            return
        if len(self._points) >= self.max_points:
            self._points = self._points[::2]
        self._points.append(point)

    def since(self, time: float) -> list[dict[str, Any]]:
        return [p for p in self._points if p["time"] > time]


def _plot_point(snapshot: dict[str, Any]) -> dict[str, Any] | None:
    time, totals = snapshot.get("time"), snapshot.get("totals")
    if not _finite(time) or not isinstance(totals, dict):
        return None
    point: dict[str, Any] = {"time": time}
    for name, field in HISTORY_FIELDS.items():
        value = totals.get(field)
        point[name] = value if _finite(value) else None
    return point


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class StatusServer:
    """The page, the snapshot API and ``/metrics`` on ``host:port`` (port 0: see :attr:`port`).

    ``seed``: snapshots (JSON form) to start the plots with, e.g. :func:`swarm.metrics.read_history`
    of the ``--history`` file. ``allowed_hosts``: ``Host`` names answered besides addresses (see
    :class:`~peers._monitor_guard.HostRule`); ``limits``: connections and request heads. Raises OSError
    when the address cannot be bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        refresh_s: float = 2.0,
        seed: Iterable[dict[str, Any]] = (),
        allowed_hosts: Iterable[str] = (),
        limits: HttpLimits = HttpLimits(),
    ) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._snapshot_json: bytes | None = None
        self._snapshot: dict[str, Any] | None = None
        self._history = PlotHistory()
        for snapshot in seed:
            self._history.add(snapshot)
        self._collector = SnapshotCollector()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        self._page, self._csp = render_page(refresh_s)
        self._socket = _bind(host, port)
        bound_ip, bound_port = self._socket.getsockname()[:2]
        self.port: int = bound_port
        rule = HostRule(str(bound_ip), bound_port, allowed_hosts)
        config = uvicorn.Config(
            RequestGuard(self._app(), rule, limits),
            loop="asyncio",
            http=guarded_protocol(limits),
            ws="none",
            h11_max_incomplete_event_size=limits.max_header_bytes,
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="status-page", daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return url_of(self.host, self.port)

    def update(self, snapshot: SwarmSnapshot) -> None:
        document = snapshot.to_dict()
        encoded = json.dumps(document, separators=(",", ":"), allow_nan=False).encode()
        with self._lock:
            self._snapshot_json, self._snapshot = encoded, document
            self._history.add(document)
        self._collector.update(snapshot)

    def close(self) -> None:
        """Stop serving (open connections get ``timeout_graceful_shutdown``) and release the port."""
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()

    def _app(self) -> Starlette:
        routes = [
            Route("/", self._page_route),
            Route("/api/snapshot.json", self._snapshot_route),
            Route("/api/history.json", self._history_route),
            Route("/metrics", self._metrics_route),
        ]
        return Starlette(routes=routes)

    async def _page_route(self, request: Request) -> Response:
        """The page with the latest numbers in it: it reads without its script (which then keeps it fresh)."""
        headers = {"Content-Security-Policy": self._csp, "Cache-Control": "no-store"}
        with self._lock:
            snapshot = self._snapshot
        body = fill_page(self._page, snapshot).encode()
        return Response(body, media_type="text/html; charset=utf-8", headers={**headers, **_SAFE})

    async def _snapshot_route(self, request: Request) -> Response:
        with self._lock:
            body = self._snapshot_json
        if body is None:
            message = {"error": "no snapshot yet: the monitor is still looking for the swarm's records"}
            return JSONResponse(message, status_code=503, headers={"Retry-After": "2", **_NO_STORE})
        return Response(body, media_type="application/json", headers=_NO_STORE)

    async def _history_route(self, request: Request) -> Response:
        try:
            since = float(request.query_params.get("since", "-inf"))
        except ValueError:
            return JSONResponse({"error": "since must be a number (DHT time)"}, status_code=400)
        with self._lock:
            points = self._history.since(since)
        return JSONResponse(points, headers=_NO_STORE)

    async def _metrics_route(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type=CONTENT_TYPE_LATEST, headers=_NO_STORE)


_NO_STORE = {"Cache-Control": "no-store"}
_SAFE = {"X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer"}


def render_page(refresh_s: float) -> tuple[str, str]:
    """The page template with its refresh period filled in (the snapshot goes in per request:
    :func:`peers._monitor_render.fill_page`), and a Content-Security-Policy that allows its one inline
    script (by hash), its inline style, and requests to its own origin only."""
    template = resources.files("peers").joinpath(PAGE_FILE).read_text(encoding="utf-8")
    refresh_ms = max(250, round(refresh_s * 1000))
    page = template.replace("__REFRESH_MS__", str(refresh_ms)).replace(
        "__REFRESH_S__", str(max(1, refresh_ms // 1000))
    )
    scripts = re.findall(r"<script>(.*?)</script>", page, flags=re.S)
    hashes = " ".join(f"'sha256-{_digest(script)}'" for script in scripts)
    csp = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return page, csp


def _digest(script: str) -> str:
    return base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (the first address the host resolves to)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, address = infos[0]
    return socket.create_server(address, family=family)
