"""Averaging benchmark on loopback: swarm's gossip averager vs hivemind's DecentralizedAverager.

Every peer is a separate process with its own hivemind DHT (and p2pd). Each peer starts from its own
random vector of ``--params`` float32 values; all peers average concurrently, back to back, until
every peer is within 1% (relative L2) of the true mean or ``--timeout`` passes. A monitor thread in
each peer measures its distance to the true mean every 0.25 s.

Reported per row: ``seconds_to_1pct`` (null if not reached), ``final_rel_distance`` (worst peer),
``wire_bytes_per_peer`` (tensor bytes a peer sent, averaged over peers: for swarm the exact stream
bytes incl. headers; for hivemind the serialized payload its compression produced, i.e. without
protocol overhead), ``failed`` (failed gossip exchanges / failed hivemind rounds), ``rounds``.

    .venv/bin/python -m scripts.bench_averaging            # 4 and 8 peers, 10M params
    .venv/bin/python -m scripts.bench_averaging --quick    # 4 peers, 2M params, 4 rows, 15 s cap each
    .venv/bin/python -m scripts.bench_averaging --quick --json   # last line: {"rows": [...]}
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

import torch

from scripts._cli import bench_parser

CONTEXT = mp.get_context("forkserver")
SWARM_CODECS = ("int8", "fp16", "fp32")
HIVEMIND_CODECS = ("fp16", "blockwise8")
TARGET = 0.01
logger = logging.getLogger("bench_averaging")


def make_vector(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- peer process


def _monitor(index: int, snapshot: Any, mean: torch.Tensor, stop: Any, reports: Any) -> None:
    norm = float(mean.norm())
    while not stop.wait(0.25):
        current = snapshot()
        reports.put((index, time.monotonic(), float((current - mean).norm()) / norm))


def _run_swarm(index: int, dht: Any, cfg: dict, x: torch.Tensor, stop: Any, reports: Any) -> dict:
    from scripts._held import gossip_averager
    from swarm.gossip import PROTOCOL_VERSION, PartnerInfo

    partners = [PartnerInfo(p, PROTOCOL_VERSION, "") for p in cfg["peer_ids"]]
    averager = gossip_averager(
        run_id=cfg["run_id"], dht=dht, partner_source=lambda: partners, codec=cfg["codec"], ban_base_s=2.0
    )

    def snapshot() -> torch.Tensor:
        with averager.reading():  # not paused(): a reader must not stop the exchanges in flight
            return x.clone()

    averager.set_tensors([x])
    cfg["ready"].wait()
    monitor = threading.Thread(target=_monitor, args=(index, snapshot, cfg["mean"], stop, reports))
    monitor.start()
    try:
        while not stop.is_set():
            averager.sync()
        monitor.join()
        cfg["ready"].wait()  # everybody stopped initiating: nothing is in flight any more
        m = averager.metrics()
    finally:
        averager.close()
    return {
        "bytes": m.bytes_sent,
        "failed": m.exchanges_failed + m.exchanges_rejected,
        "rounds": m.exchanges_ok,
    }


def _counting(base: type, counter: Any) -> Any:
    """The hivemind compression ``base``, counting the bytes of every buffer it produces."""

    class Counting(base):
        def compress(self, tensor: torch.Tensor, info: Any, allow_inplace: bool = False) -> Any:
            out = super().compress(tensor, info, allow_inplace)
            with counter.get_lock():
                counter.value += len(out.buffer)
            return out

    return Counting()


def _run_hivemind(index: int, dht: Any, cfg: dict, x: torch.Tensor, stop: Any, reports: Any) -> dict:
    from hivemind import DecentralizedAverager
    from hivemind.compression import BlockwiseQuantization, Float16Compression

    base = {"fp16": Float16Compression, "blockwise8": BlockwiseQuantization}[cfg["codec"]]
    counter = mp.get_context("fork").Value("q", 0)
    averager = DecentralizedAverager(
        [x],
        dht,
        start=True,
        prefix=cfg["run_id"],
        target_group_size=len(cfg["peer_ids"]),
        min_group_size=2,
        min_matchmaking_time=1.0,
        request_timeout=2.0,
        compression=_counting(base, counter),
    )

    def snapshot() -> torch.Tensor:
        with averager.get_tensors() as tensors:
            return tensors[0].clone()

    cfg["ready"].wait()
    monitor = threading.Thread(target=_monitor, args=(index, snapshot, cfg["mean"], stop, reports))
    monitor.start()
    rounds = failed = 0
    try:
        while not stop.is_set():
            try:
                ok = averager.step(timeout=10.0) is not None
            except Exception as exc:
                logger.info("hivemind step failed: %s", exc)
                ok = False
            rounds += ok
            failed += not ok
        monitor.join()
        cfg["ready"].wait()
    finally:
        averager.shutdown()
    return {"bytes": counter.value, "failed": failed, "rounds": rounds}


def worker_main(conn: Any, index: int, stop: Any, reports: Any) -> None:
    os.setpgid(0, 0)  # own process group: the controller kills worker, DHT process and p2pd together
    mp.set_start_method("fork", force=True)  # hivemind's averager process must inherit its tensors
    logging.basicConfig(level=os.environ.get("BENCH_LOG_LEVEL", "ERROR"))
    import hivemind

    dht = None
    while True:
        try:
            command, kwargs = conn.recv()
        except EOFError:
            break
        if command == "stop":
            break
        try:
            if command == "dht":
                dht = hivemind.DHT(initial_peers=kwargs["initial_peers"] or None, start=True)
                reply: Any = {
                    "peer_id": dht.peer_id.to_base58(),
                    "maddrs": [str(a) for a in dht.get_visible_maddrs()],
                }
            else:
                cfg = kwargs | {"mean": torch.load(kwargs["mean_path"]), "ready": _Ready(conn)}
                x = make_vector(kwargs["seed"], kwargs["numel"])
                run = _run_swarm if kwargs["backend"] == "swarm" else _run_hivemind
                reply = run(index, dht, cfg, x, stop, reports)
            conn.send(("ok", reply))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    if dht is not None:
        dht.shutdown()


class _Ready:
    """Tells the controller this peer is set up, then waits for its go."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def wait(self) -> None:
        self._conn.send(("ready", None))
        self._conn.recv()


# ---------------------------------------------------------------------------- controller


class Cluster:
    def __init__(self, size: int) -> None:
        self.stop = CONTEXT.Event()
        self.reports = CONTEXT.Queue()
        self.procs, self.conns = [], []
        for index in range(size):
            parent, child = CONTEXT.Pipe()
            proc = CONTEXT.Process(target=worker_main, args=(child, index, self.stop, self.reports))
            proc.start()
            self.procs.append(proc)
            self.conns.append(parent)
        first = self._ask([0], "dht", initial_peers=[])[0]
        rest = self._ask(range(1, size), "dht", initial_peers=first["maddrs"])
        self.peer_ids = [first["peer_id"]] + [r["peer_id"] for r in rest]

    def _ask(self, indices: Any, command: str, timeout: float = 120.0, **kwargs: Any) -> list:
        indices = list(indices)
        for i in indices:
            self.conns[i].send((command, kwargs))
        return [self._recv(i, timeout) for i in indices]

    def _recv(self, index: int, timeout: float) -> Any:
        if not self.conns[index].poll(timeout):
            raise TimeoutError(f"peer {index} did not answer in {timeout} s")
        status, value = self.conns[index].recv()
        if status == "error":
            raise RuntimeError(f"peer {index}: {value}")
        return value

    def measure(
        self, backend: str, codec: str, peers: int, numel: int, mean_path: str, timeout: float
    ) -> dict:
        indices = list(range(peers))
        self.stop.clear()
        run_id = f"bench-{backend}-{codec}-{peers}-{time.monotonic_ns()}"
        common = dict(backend=backend, codec=codec, numel=numel, mean_path=mean_path, run_id=run_id)
        for i in indices:
            self.conns[i].send(("run", common | {"seed": i, "peer_ids": self.peer_ids[:peers]}))
        for i in indices:
            self._recv(i, 120)  # "ready"
        started = time.monotonic()
        for i in indices:
            self.conns[i].send("go")
        reached, latest = self._watch(peers, started, timeout)
        self.stop.set()
        for i in indices:
            self._recv(i, 120)  # stopped averaging
        for i in indices:
            self.conns[i].send("go")
        stats = [self._recv(i, 120) for i in indices]
        return {
            "backend": backend,
            "codec": codec,
            "peers": peers,
            "params": numel,
            "seconds_to_1pct": None if reached is None else round(reached - started, 2),
            "final_rel_distance": round(max(latest.values(), default=float("nan")), 5),
            "wire_bytes_per_peer": int(sum(s["bytes"] for s in stats) / peers),
            "failed": sum(s["failed"] for s in stats),
            "rounds": sum(s["rounds"] for s in stats),
        }

    def _watch(self, peers: int, started: float, timeout: float) -> tuple[float | None, dict[int, float]]:
        latest: dict[int, float] = {}
        while time.monotonic() < started + timeout:
            try:
                index, at, distance = self.reports.get(timeout=0.5)
            except queue.Empty:
                continue
            latest[index] = distance
            if len(latest) == peers and max(latest.values()) < TARGET:
                return at, latest
        return None, latest

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send(("stop", {}))
        for proc in self.procs:
            proc.join(15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.join(5)


def _mean_file(directory: str, peers: int, numel: int) -> str:
    path = os.path.join(directory, f"mean-{peers}-{numel}.pt")
    if not os.path.exists(path):
        total = torch.zeros(numel, dtype=torch.float64)
        for seed in range(peers):
            total += make_vector(seed, numel).double()
        torch.save((total / peers).float(), path)
    return path


def main() -> None:
    parser = bench_parser(__doc__, "4 peers, 2M params, no swarm fp16 row, 15 s per row")
    parser.add_argument("--peers", type=int, nargs="+", default=None)
    parser.add_argument("--params", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=None, help="seconds per row")
    parser.add_argument("--only", nargs="+", default=None, help="rows to run, e.g. swarm:int8 hivemind:fp16")
    args = parser.parse_args()
    peer_counts = args.peers or ([4] if args.quick else [4, 8])
    numel = args.params or (2_000_000 if args.quick else 10_000_000)
    timeout = args.timeout or (15.0 if args.quick else 90.0)
    CONTEXT.set_forkserver_preload(["torch", "hivemind", "swarm.gossip"])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # still run cluster.close() below
    rows = []
    cluster = Cluster(max(peer_counts))
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for peers in peer_counts:
                mean_path = _mean_file(tmp, peers, numel)
                swarm_codecs = [c for c in SWARM_CODECS if not (args.quick and c == "fp16")]
                plan = [("swarm", c) for c in swarm_codecs] + [("hivemind", c) for c in HIVEMIND_CODECS]
                plan = [p for p in plan if args.only is None or ":".join(p) in args.only]
                for backend, codec in plan:
                    row = cluster.measure(backend, codec, peers, numel, mean_path, timeout)
                    rows.append(row)
                    print(
                        f"{backend:9s} {codec:10s} peers={peers} to_1%={row['seconds_to_1pct']} s "
                        f"worst={row['final_rel_distance']} bytes/peer={row['wire_bytes_per_peer']:,} "
                        f"failed={row['failed']} rounds={row['rounds']}",
                        flush=True,
                    )
    finally:
        cluster.close()
    if args.json:
        print(json.dumps({"rows": rows, "params": numel, "timeout_s": timeout}))


if __name__ == "__main__":
    main()
