"""Run a ``swarm`` program with the DHT RPCs its node serves counted, by key, for the membership benchmark.

``python -m scripts._membership_probe bootstrap|join ARGS`` is ``swarm bootstrap|join ARGS`` with
hivemind's ``DHTProtocol.rpc_store`` and ``rpc_find`` wrapped, before the DHT worker forks, in a
counter: for every store and find this node answers, the protobuf bytes of the request and of the
response, by kind (the membership key ``<run_id>_members``, the run's published config, any other key)
and by the peer that asked. Pings are not counted (a find or store answered also runs the ping
handler inside, which would count twice). The worker rewrites the counters as JSON to the file named by
:data:`ENV_FILE` every second; nothing else of the program changes.

Every DHT RPC has one server and one client, so once every node of a run is counted, a peer's own
traffic as a client (its record stores and member-list reads) is what all the others answered it:
:mod:`scripts._membership_stats` adds it up. The bytes are the RPC messages; the libp2p framing and
encryption, TCP and IP headers come on top (the benchmark also reads each peer's network interface
where it runs in its own namespace).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ENV_FILE = "MEMBERSHIP_BENCH_RPC_FILE"
"""Where the DHT worker writes its counters (one file per peer)."""
ENV_RUN = "MEMBERSHIP_BENCH_RUN_ID"
"""The run whose keys get names of their own in the counters."""
ENV_PROFILE = "MEMBERSHIP_BENCH_PROFILE"
DUMP_EVERY_S = 1.0
KINDS = tuple(
    f"{key}.{rpc}"
    for key in ("members", "config", "other")
    for rpc in ("store", "store_all", "find", "find_miss")
)
"""What the counters are split by: the key an RPC is about, then the RPC."""

_counters: dict[str, Any] = {}
_lock = threading.Lock()
_dumper_pid: int | None = None


def _empty() -> dict[str, int]:
    return {"calls": 0, "request_bytes": 0, "response_bytes": 0}


def _reset() -> None:
    _counters.clear()
    _counters.update(node=None, served={k: _empty() for k in KINDS}, by_client=defaultdict(dict))


def key_kinds(run_id: str) -> dict[bytes, str]:
    """The DHT ids (as sent in RPCs) of ``run_id``'s membership and published-config keys."""
    from hivemind.dht.routing import DHTID

    from swarm.membership import MAX_MEMBER_SHARDS, record_key, run_config_key

    members = {
        DHTID.generate(source=record_key(run_id, s)).to_bytes(): "members" for s in range(MAX_MEMBER_SHARDS)
    }
    return {**members, DHTID.generate(source=run_config_key(run_id)).to_bytes(): "config"}


def _kind(keys: list[bytes], kinds: dict[bytes, str]) -> str:
    """An RPC's kind: the membership key wins over the config key over anything else."""
    found = {kinds.get(bytes(k), "other") for k in keys}
    return next((k for k in ("members", "config") if k in found), "other")


def _store(request: Any) -> str:
    """``.store`` for one record (a subkey), ``.store_all`` for a whole dictionary: hivemind caches a
    value it found on the nearest node that lacked it, and hands its values over to a new neighbour."""
    from hivemind.dht.protocol import DHTProtocol

    return ".store_all" if DHTProtocol.IS_DICTIONARY in list(request.subkeys) else ".store"


def _find(response: Any) -> str:
    """``.find`` for an answer holding a value, ``.find_miss`` for one holding none (only neighbours)."""
    from hivemind.proto import dht_pb2

    return ".find_miss" if all(r.type == dht_pb2.NOT_FOUND for r in response.results) else ".find"


def _count(kind: str, context: Any, request: Any, response: Any) -> None:
    request_bytes, response_bytes = request.ByteSize(), response.ByteSize()
    client = context.remote_id.to_base58() if context.remote_id is not None else "?"
    with _lock:
        _counters["node"] = context.local_id.to_base58()
        for row in (_counters["served"][kind], _counters["by_client"][client].setdefault(kind, _empty())):
            row["calls"] += 1
            row["request_bytes"] += request_bytes
            row["response_bytes"] += response_bytes
    _ensure_dumper()


def _counted(method: Callable[..., Awaitable[Any]], kind_of: Callable[[Any, Any], str]) -> Callable:
    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: Any) -> Any:
        response = await method(self, request, context)
        _count(kind_of(request, response), context, request, response)
        return response

    return wrapper


def install(run_id: str) -> None:
    """Wrap the RPC handlers of hivemind's DHT protocol (call before the DHT worker forks)."""
    from hivemind.dht.protocol import DHTProtocol

    kinds = key_kinds(run_id)
    _reset()
    store = _counted(DHTProtocol.rpc_store, lambda r, _: _kind(list(r.keys), kinds) + _store(r))
    find = _counted(DHTProtocol.rpc_find, lambda r, answer: _kind(list(r.keys), kinds) + _find(answer))
    DHTProtocol.rpc_store, DHTProtocol.rpc_find = store, find


def _ensure_dumper() -> None:
    """Start the writer thread in this process (the DHT worker) once: threads do not survive a fork."""
    global _dumper_pid
    if _dumper_pid == os.getpid() or not os.environ.get(ENV_FILE):
        return
    _dumper_pid = os.getpid()
    threading.Thread(target=_dump_forever, args=(Path(os.environ[ENV_FILE]),), daemon=True).start()


def _dump_forever(path: Path) -> None:
    while True:
        write_counters(path)
        time.sleep(DUMP_EVERY_S)  # a periodic file for another process to read; nothing to wait on


def write_counters(path: Path) -> None:
    """Write the counters so far, with the time (``time.time()``), so that a reader never sees half."""
    with _lock:
        document = {"time": time.time(), "pid": os.getpid(), **json.loads(json.dumps(_counters))}
    partial = path.with_name(path.name + ".part")
    partial.write_text(json.dumps(document))
    partial.replace(path)


def _profile_to(path: str) -> None:
    """Profile this process (its main thread) from now on; write the stats to ``path`` at exit (the
    ``swarm`` programs end with ``os._exit`` after the exit handlers, so a profile written after
    ``main`` returned would never be)."""
    import atexit
    import cProfile

    profiler = cProfile.Profile()
    atexit.register(lambda: (profiler.disable(), profiler.dump_stats(path)))
    profiler.enable()


def main() -> None:
    """``swarm ARGS`` with the DHT's RPCs counted (:data:`ENV_RUN` names the run; :data:`ENV_PROFILE`,
    if set, a file for a cProfile of the whole program)."""
    if os.environ.get(ENV_PROFILE):
        _profile_to(os.environ[ENV_PROFILE])
    install(os.environ.get(ENV_RUN, "local-tiny"))
    from peers.cli import main as swarm_main

    sys.argv = ["swarm", *sys.argv[1:]]
    swarm_main()


if __name__ == "__main__":
    main()
