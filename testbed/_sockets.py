"""The lab's check servers and clients (:meth:`testbed.NetLab.probe`), run inside its hosts.

NetLab runs this file by its path with ``python -I`` (testbed/netlab.py ``_helper``): it imports
nothing but the standard library, so that it works in any host whatever the interpreter's path.

    python -I testbed/_sockets.py _serve --port 5201
    python -I testbed/_sockets.py _client IP PORT echo|sink NBYTES TIMEOUT   # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Sequence

SERVER_PORT = 5201


def _serve(port: int) -> None:
    """Accept connections forever; first byte ``e``: echo until EOF, ``s``: count bytes, reply JSON."""
    listener = socket.create_server(("0.0.0.0", port), backlog=16)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _handle(conn: socket.socket) -> None:
    with conn:
        mode, first, total = conn.recv(1), None, 0
        while chunk := conn.recv(1 << 16):
            if mode == b"e":
                conn.sendall(chunk)
            elif first is None:  # the clock starts at the first chunk, so its bytes are not counted
                first = time.monotonic()
            else:
                total += len(chunk)
        if mode == b"s":
            seconds = time.monotonic() - first if first else 0.0
            conn.sendall(json.dumps({"bytes": total, "seconds": seconds}).encode())


def _client(ip: str, port: int, mode: str, nbytes: int, timeout: float) -> dict:
    try:
        with socket.create_connection((ip, port), timeout=timeout) as conn:
            conn.sendall(mode[0].encode())
            return {"ok": True, **(_echo(conn) if mode == "echo" else _sink(conn, nbytes))}
    except OSError as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}


def _echo(conn: socket.socket, rounds: int = 5) -> dict:
    rtts = []
    for _ in range(rounds):
        start = time.monotonic()
        conn.sendall(b"x" * 64)
        got = 0
        while got < 64:
            chunk = conn.recv(64 - got)
            if not chunk:
                raise ConnectionError("echo server closed the connection")
            got += len(chunk)
        rtts.append((time.monotonic() - start) * 1000)
    return {"rtt_ms": sorted(rtts)[rounds // 2]}


def _sink(conn: socket.socket, nbytes: int) -> dict:
    block = b"\0" * (1 << 16)
    for offset in range(0, nbytes, len(block)):
        conn.sendall(block[: nbytes - offset])
    conn.shutdown(socket.SHUT_WR)
    reply = b"".join(iter(lambda: conn.recv(4096), b""))
    return json.loads(reply)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("_serve")
    serve.add_argument("--port", type=int, default=SERVER_PORT)
    client = sub.add_parser("_client")
    for name, kind in (("ip", str), ("port", int), ("mode", str), ("nbytes", int), ("timeout", float)):
        client.add_argument(name, type=kind)
    args = parser.parse_args(argv)
    if args.cmd == "_serve":
        _serve(args.port)
    else:
        print(json.dumps(_client(args.ip, args.port, args.mode, args.nbytes, args.timeout)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
