"""Finding 10 of issue 28: the monitor shows peer text as text.

A peer chooses its ``public_name``, ``device`` and ``package_version``; the monitor must neither read
them as rich markup (``[/oops]`` used to raise and end the monitor and its ``--http`` page) nor pass
control characters or terminal escape sequences through to the user's terminal.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time
import urllib.request

import pytest
from rich.console import Console

from peers._monitor_guard import HostRule, HttpLimits, _Gate
from peers._monitor_http import StatusServer
from peers._monitor_output import TerminalOutput
from peers._monitor_table import render, shown
from swarm.metrics import build_snapshot
from tests._processes import wait_until
from tests.test_metrics import POLICY, T0, member

HOSTILE = {
    1: "[/oops]",
    2: "[bold red]x",
    3: "\x1b[2J\x1b]0;pwned\x07clear",
    4: "a\rb\x08c\x9bd",
    5: "left\u202eright",
}
RAW = ("\x1b[2J", "\x1b]0;", "\x07", "\r", "\x08", "\x9b", "\u202e")


def hostile_snapshot():
    members = [
        member(
            n,
            T0,
            public_name=name,
            device=f"gpu{name}",
            package_version=f"9{name}",
            config_hash=f"{n:02d}" * 8,
        )
        for n, name in HOSTILE.items()
    ]
    return build_snapshot(members, None, T0, POLICY)


def _assert_safe(out: str, live: bool = False) -> None:
    for raw in RAW:
        if live and raw == "\r":  # rich.live moves the cursor with it
            continue
        assert raw not in out, (raw, out)


@pytest.mark.parametrize("terminal", [True, False])
def test_table_shows_markup_as_text_and_escapes_control_characters(terminal: bool) -> None:
    console = Console(file=io.StringIO(), width=200, force_terminal=terminal, color_system="standard")
    console.print(render(hostile_snapshot(), console.width))
    out = console.file.getvalue()
    _assert_safe(out)
    assert "[/oops]" in out and "[bold red]x" in out
    assert "\\x1b[2J" in out and "\\x07clear" in out and "\\u202e" in out


def test_warning_lines_are_escaped() -> None:
    snapshot = hostile_snapshot()
    assert any("[bold red]x" in w.message for w in snapshot.warnings)
    console = Console(file=io.StringIO(), width=300, force_terminal=False)
    console.print(render(snapshot, console.width))
    out = console.file.getvalue()
    _assert_safe(out)
    assert "[bold red]x: config hash" in out and "\\x1b[2J\\x1b]0;pwned\\x07clear: config" in out


@pytest.mark.parametrize("live", [True, False])
def test_terminal_output_survives_hostile_names(live: bool) -> None:
    console = Console(file=io.StringIO(), force_terminal=live, width=120)
    output = TerminalOutput("table", live=live, console=console)
    output.show(hostile_snapshot())
    output.show(hostile_snapshot())
    output.close()
    out = console.file.getvalue()
    _assert_safe(out, live)
    assert "[/oops]" in out


def test_shown_escapes_only_what_a_terminal_would_act_on() -> None:
    assert shown("Zürich-Ω 東京 [x]") == "Zürich-Ω 東京 [x]"
    assert shown("\x1b\x00\x7f\x85\u2028\u200b") == "\\x1b\\x00\\x7f\\x85\\u2028\\u200b"


def test_monitor_sinks_and_status_page_keep_serving_hostile_names(capsys) -> None:
    from peers.monitor import _Sinks

    sinks = _Sinks("table", once=False)
    server = StatusServer("127.0.0.1", 0, refresh_s=1.0)
    sinks.extras.append(server)
    try:
        sinks.emit(hostile_snapshot())
        sinks.emit(hostile_snapshot())
        with urllib.request.urlopen(f"{server.url}api/snapshot.json", timeout=10) as response:
            names = {p["public_name"] for p in json.load(response)["peers"]}
    finally:
        sinks.close()
    assert names == set(HOSTILE.values())
    out = capsys.readouterr().out
    _assert_safe(out)
    assert "[/oops]" in out


def test_plot_labels_are_text_never_matplotlib_mathematics() -> None:
    """A public name like ``$\\alpha$`` would be typeset (or, malformed, raise) as a legend label."""
    from peers._monitor_plot import series

    snapshot = {
        "time": 0.0,
        "peers": [{"public_name": "$\\alpha$\x1b[31m", "role": "trainer", "loss": 2.0}],
        "totals": {},
    }
    labels = list(series([snapshot], "loss", "loss"))
    assert "\\$\\alpha\\$\\x1b[31m" in labels, labels


# Issue 41, N9: the status page's connections, request heads and Host names (peers/_monitor_guard.py).

DEADLINE_S = 30.0  # to wait on a condition; never a measured time


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S, source_address=(source, 0))
    return sock


def _response(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _request(port: int, head: str, source: str = "127.0.0.1") -> tuple[int, bytes]:
    """One raw request (``head`` without its blank line; it asks to close); status and body."""
    with _connect(port, source) as sock:
        sock.sendall(head.encode("latin-1") + b"Connection: close\r\n\r\n")
        status_line, _, rest = _response(sock).partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _get(port: int, host: str | None, path: str = "/api/history.json", source: str = "127.0.0.1"):
    if host is None:  # HTTP/1.1 requires a Host (h11 answers 400 without); 1.0 does not
        return _request(port, f"GET {path} HTTP/1.0\r\n", source)
    return _request(port, f"GET {path} HTTP/1.1\r\nHost: {host}\r\n", source)


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False


def test_idle_connections_beyond_the_limits_do_not_keep_a_real_client_out() -> None:
    """Idle connections (no request head yet) hold slots only until a newer connection needs one:
    the one waiting longest gives it up, per address and in all."""
    limits = HttpLimits(max_connections=4, max_per_ip=3, header_timeout_s=DEADLINE_S * 10)
    server = StatusServer("127.0.0.1", 0, limits=limits)
    idle = [_connect(server.port) for _ in range(6)] + [_connect(server.port, "127.0.0.2")]
    for sock in idle:
        sock.settimeout(0.05)

    def closed() -> int:
        return sum(_closed_by_server(sock) for sock in idle)

    try:
        wait_until(lambda: closed() >= 3, DEADLINE_S, "127.0.0.1 kept to its 3 connections")
        # all 4 taken (3 + 1): a real client from elsewhere still gets in
        assert _get(server.port, f"127.0.0.1:{server.port}", source="127.0.0.3")[0] == 200
        wait_until(lambda: closed() >= 4, DEADLINE_S, "the longest idle connection gave its slot")
    finally:
        for sock in idle:
            sock.close()
        server.close()


class _Conn:
    """What the gate sees of a connection."""

    def __init__(self, gate: _Gate, ip: str, waiting_since: float | None) -> None:
        self.gate, self.ip, self.waiting_since, self.dropped = gate, ip, waiting_since, False

    def drop(self) -> None:
        self.dropped = True
        self.gate.release(self)


def test_a_connection_is_refused_only_when_every_slot_is_answering() -> None:
    gate = _Gate(HttpLimits(max_connections=2, max_per_ip=2))
    busy = [_Conn(gate, "10.0.0.1", None), _Conn(gate, "10.0.0.2", None)]
    assert all(gate.admit(conn) for conn in busy)
    newcomer = _Conn(gate, "10.0.0.3", 5.0)
    assert not gate.admit(newcomer)  # both are answering requests: 503
    busy[1].waiting_since = 1.0  # its response was sent; it waits for its next head
    assert gate.admit(newcomer) and busy[1].dropped and not busy[0].dropped


@pytest.mark.parametrize("trickle", [False, True])
def test_a_connection_without_a_complete_request_head_is_closed_at_the_header_timeout(trickle: bool) -> None:
    """An idle connection, and a slowloris head that trickles a header line at a time, are both
    closed; then the slots they held serve a real client."""
    server = StatusServer("127.0.0.1", 0, limits=HttpLimits(max_per_ip=2, header_timeout_s=0.5))
    held = [_connect(server.port) for _ in range(2)]
    try:
        for sock in held:
            sock.settimeout(0.05)
            if trickle:
                sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n".encode())
        deadline = time.monotonic() + DEADLINE_S
        while not all(_closed_by_server(sock) for sock in held):
            assert time.monotonic() < deadline, "the server kept a connection without a request head"
            if trickle:
                for sock in held:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X-Slow: 1\r\n")
        assert _get(server.port, f"127.0.0.1:{server.port}")[0] == 200
    finally:
        for sock in held:
            sock.close()
        server.close()


def test_a_foreign_host_is_refused_on_a_loopback_server() -> None:
    """DNS rebinding: a page the user's browser shows resolves its own name to 127.0.0.1 and reads the
    API; the request then carries that name as Host."""
    server = StatusServer("127.0.0.1", 0, allowed_hosts=["Monitor.LAN"])
    port = server.port
    try:
        status, body = _get(port, f"rebind.attacker.example:{port}")
        assert status == 421 and b"DNS rebinding" in body and b"--http-allow-host" in body
        assert _get(port, None)[0] == 421  # no Host at all
        assert _get(port, f"localhost:{port + 1 if port < 65535 else 1}")[0] == 421  # another port's name
        assert _get(port, f"192.0.2.1:{port}")[0] == 421  # an address, but not a loopback one
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"127.9.9.9:{port}", f"[::1]:{port}"):
            assert _get(port, host)[0] == 200, host
        assert _get(port, "monitor.lan.:8443")[0] == 200  # allowed by the user (any port: a proxy's)
    finally:
        server.close()


def test_header_floods_and_request_bodies_are_refused() -> None:
    server = StatusServer("127.0.0.1", 0, limits=HttpLimits(max_headers=32, max_header_bytes=4096))
    head = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
    try:
        assert _request(server.port, head + "X-A: b\r\n" * 40)[0] == 431
        assert _request(server.port, head + f"X-Big: {'b' * 5000}\r\n")[0] == 431
        assert _request(server.port, head + "Content-Length: 5\r\n")[0] == 413
        assert _request(server.port, head + "X-A: b\r\n" * 20)[0] == 200
    finally:
        server.close()


@pytest.mark.parametrize(
    ("bound", "allowed", "host", "answered"),
    [
        ("0.0.0.0", (), "anything.example", True),  # shared by name: rebinding can read it (docs)
        ("::", (), "anything.example:1", True),
        ("0.0.0.0", ("stats.example",), "anything.example:8080", False),
        ("0.0.0.0", ("stats.example",), "STATS.example", True),
        ("0.0.0.0", ("stats.example",), "10.1.2.3:8080", True),  # an address: no rebinding
        ("192.0.2.7", (), "192.0.2.7:8080", True),
        ("192.0.2.7", (), "192.0.2.7:9090", False),
        ("192.0.2.7", (), "box.example:8080", False),
        ("::1", (), "[::1]:8080", True),
        ("::1", (), "[::1", False),
        ("127.0.0.1", (), "localhost:8080:8080", False),
    ],
)
def test_host_rule_of_each_binding(bound: str, allowed: tuple[str, ...], host: str, answered: bool) -> None:
    assert (HostRule(bound, 8080, allowed).refusal(host) is None) is answered
