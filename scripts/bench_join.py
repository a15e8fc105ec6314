"""How fast a joiner on a home link takes a state over, from two donors, and when one dies half-way.

On the emulated internet (testbed/netlab.py; needs root): two donors (hosts 0 and 1, links unshaped)
each run a ``StateServer`` serving the same state of ``--mbytes`` MB on the wire (bf16 frames); a
joiner (host 2, its link shaped to ``--rate`` both ways) trusts both and downloads the state with
``swarm.state.download_state``, in two runs, each with fresh processes:

* ``both``: both donors serve it to the end;
* ``one_leaves``: the second donor is SIGKILLed (its whole process group, its ``p2pd`` too: a
  machine switched off) once half of the state's bytes have reached the joiner's network interface
  (its namespace's ``eth0`` receive counter); the first donor takes its part over and sends only
  the frames of it that did not arrive.

Each run prints the download time (the ``download_state`` call, timed in the joiner), the ideal
(the state's bytes at the link's nominal rate: TCP/IP headers alone cost about 4.5% of a ``tbf``
link, docs/testbed.md), their ratio, the bytes the joiner verified (``received_bytes``: more than
the state's bytes only if a frame came twice) and the donors it took complete parts from. Every
number comes from what the library returned in the processes (written as JSON files), nothing from
their logs. The target is a ratio of at most 1.3 in both runs.

    .venv/bin/python -m scripts.bench_join                # 64 MB at 20 Mbit/s: about 1 min
    .venv/bin/python -m scripts.bench_join --quick --json # 8 MB: the smoke run of tests/test_bench_join.py

The donor and joiner roles are this script too (``--role``), started inside the lab's hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUN = "bench-join"
CHUNK_BYTES = 1 << 20
TARGET_RATIO = 1.3
QUICK_MBYTES = 8.0
START_TIMEOUT_S = 120.0  # a donor imports torch, encodes the state and starts p2pd on shared cores
POLL_S = 0.02  # the joiner's receive counter, read while it downloads


# ----------------------------------------------------------------------------- the roles in the lab


def _state(mbytes: float) -> dict[str, Any]:
    """The served state: anchor and momentum of a model with ``mbytes`` MB of bf16 values, in tensors
    of 1M values (the same in every donor: a fixed seed)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    values = int(mbytes * 1e6) // 2
    sizes = [1 << 20] * (values >> 20) + ([values % (1 << 20)] if values % (1 << 20) else [])
    kinds = ("param", "momentum")
    return {f"{kinds[i % 2]}/t{i:04d}": torch.randn(n, generator=generator) for i, n in enumerate(sizes)}


def _write(path: Path, result: dict[str, Any]) -> None:
    """Write ``result`` as JSON so that a reader never sees half of it."""
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(result))
    partial.rename(path)


def _donor(args: argparse.Namespace) -> None:
    """Serve the state on a StateServer over our own p2pd on ``--host``; write who we are, then serve
    until SIGTERM."""
    from hivemind.p2p import P2P

    from swarm.state import StateServer, spool_state

    stop = threading.Event()
    maddrs: list[str] = []

    async def own_daemon() -> P2P:
        p2p = await P2P.create(host_maddrs=[f"/ip4/{args.host}/tcp/0"])
        maddrs.extend(str(m) for m in await p2p.get_visible_maddrs())
        return p2p

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with StateServer(run_id=RUN, p2p_factory=own_daemon) as server:
        state = spool_state(_state(args.mbytes), {"round": 1, "step": 10, "samples_total": 320}, CHUNK_BYTES)
        server.publish(state)
        ready = {
            "peer_id": server.peer_id,
            "maddr": maddrs[0],
            "digest": state.digest,
            "nbytes": state.nbytes,
        }
        _write(args.out, ready)
        while not stop.wait(1.0):
            pass


def _joiner(args: argparse.Namespace) -> None:
    """Download the state the donors in ``--donors`` announce (both trusted) and write how it went."""
    from hivemind.p2p import P2P

    from swarm.p2p import LoopThread
    from swarm.state import download_state

    donors = json.loads(args.donors.read_text())
    loop = LoopThread("bench-joiner")
    create = P2P.create(initial_peers=[d["maddr"] for d in donors], host_maddrs=[f"/ip4/{args.host}/tcp/0"])
    p2p = loop.run(create, START_TIMEOUT_S)
    try:
        announced = [(d["peer_id"], d["digest"]) for d in donors]
        trusted = {d["peer_id"] for d in donors}
        started = time.monotonic()
        state = download_state(p2p, announced, run_id=RUN, trusted=trusted, timeout_s=60)
        seconds = time.monotonic() - started
    finally:
        loop.run(p2p.shutdown(), 30)
        loop.stop()
    result = {"seconds": seconds, "digest": state.digest, "received_bytes": state.received_bytes}
    _write(args.out, {**result, "sources": list(state.sources)})


# ----------------------------------------------------------------------------- the two runs


def bench(mbytes: float, rate: str) -> dict[str, Any]:
    """Build the lab, run ``both`` and ``one_leaves``; return their numbers. Needs root."""
    from testbed.netlab import NetLab, parse_rate

    root = Path(tempfile.mkdtemp(prefix="bench-join-"))
    try:
        with NetLab(hosts=3) as lab:
            lab.shape(2, rate)  # the joiner's home link; the donors' are unshaped
            runs = {
                name: _run(lab, root / name, mbytes, kill)
                for name, kill in (("both", None), ("one_leaves", 0.5))
            }
    finally:
        shutil.rmtree(root, ignore_errors=True)
    bits_per_s = parse_rate(rate)
    for run in runs.values():
        run["ideal_s"] = run["state_bytes"] * 8 / bits_per_s
        run["ratio"] = run["seconds"] / run["ideal_s"]
    return {"mbytes": mbytes, "rate": rate, **runs}


def _run(lab: Any, folder: Path, mbytes: float, kill_at: float | None) -> dict[str, Any]:
    """Two donors and a joiner, fresh processes; with ``kill_at`` (a fraction of the state's bytes)
    the second donor is SIGKILLed once the joiner's interface received that much."""
    folder.mkdir(parents=True)
    try:
        donors = [_start(lab, i, folder, "donor", "--mbytes", str(mbytes)) for i in (0, 1)]
        ready = [
            _wait_for(folder / f"donor-{i}.json", proc, START_TIMEOUT_S) for i, proc in enumerate(donors)
        ]
        if ready[0]["digest"] != ready[1]["digest"]:
            raise RuntimeError("the two donors serve different states")
        (folder / "donors.json").write_text(json.dumps(ready))
        baseline = _received(lab.hosts[2])
        joiner = _start(lab, 2, folder, "joiner", "--donors", str(folder / "donors.json"))
        killed_after = None
        if kill_at is not None:
            threshold = baseline + int(kill_at * ready[1]["nbytes"])
            killed_after = _kill_when(lab.hosts[2], joiner, donors[1], threshold) - baseline
        result = _wait_for(folder / "joiner.json", joiner, START_TIMEOUT_S + 300)
    finally:
        for host in lab.hosts:
            host.stop_processes()
    if result["digest"] != ready[0]["digest"]:
        raise RuntimeError("the joiner took another state than the donors serve")
    sources = [[d["peer_id"] for d in ready].index(peer) for peer in result["sources"]]
    return {
        "seconds": result["seconds"],
        "state_bytes": ready[0]["nbytes"],
        "received_bytes": result["received_bytes"],
        "complete_parts_from": sources,
        "killed_after_bytes": killed_after,
    }


def _start(lab: Any, host: int, folder: Path, role: str, *extra: str) -> subprocess.Popen:
    """This script in ``role`` inside lab host ``host``, its output in ``<role>-<host>.log``."""
    name = f"{role}-{host}" if role == "donor" else role
    argv = [sys.executable, "-m", "scripts.bench_join", "--role", role, "--host", lab.hosts[host].ip]
    argv += ["--out", str(folder / f"{name}.json"), *extra]
    with (folder / f"{name}.log").open("wb") as log:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return lab.hosts[host].popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> dict[str, Any]:
    """The JSON that ``proc`` writes to ``path``; RuntimeError (with its log's tail) if it exits first
    or takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            log = path.with_suffix(".log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{path.stem} gave no result (exit code {proc.poll()}):\n{log}")
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def _received(host: Any) -> int:
    """Bytes the host's interface has received so far (its namespace's counter)."""
    return int(host.run(["cat", "/sys/class/net/eth0/statistics/rx_bytes"]))


def _kill_when(host: Any, joiner: subprocess.Popen, victim: subprocess.Popen, threshold: int) -> int:
    """SIGKILL ``victim``'s process group once ``host`` has received ``threshold`` bytes; return the
    count then. RuntimeError if the joiner ended first."""
    while (received := _received(host)) < threshold:
        if joiner.poll() is not None:
            raise RuntimeError("the joiner ended before the donor was to be killed")
        time.sleep(POLL_S)
    os.killpg(victim.pid, signal.SIGKILL)
    return received


# ----------------------------------------------------------------------------- command line


def _report(numbers: dict[str, Any]) -> None:
    print(f"state {numbers['mbytes']:g} MB, joiner link {numbers['rate']}, two trusted donors")
    for name in ("both", "one_leaves"):
        run = numbers[name]
        killed = (
            ""
            if run["killed_after_bytes"] is None
            else f", donor 1 killed after {run['killed_after_bytes']:,} B"
        )
        print(
            f"{name:>11}: {run['seconds']:6.2f} s, ideal {run['ideal_s']:6.2f} s, ratio {run['ratio']:.3f}"
            f" (target {TARGET_RATIO}); received {run['received_bytes']:,} B of {run['state_bytes']:,}"
            f"; complete parts from donor(s) {run['complete_parts_from']}{killed}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbytes", type=float, default=64.0, help="the state's size on the wire, MB")
    parser.add_argument("--rate", default="20mbit", help="the joiner's link, both ways (tc units)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: an 8 MB state")
    parser.add_argument("--json", action="store_true", help="also print the numbers as one JSON line")
    parser.add_argument("--role", choices=("donor", "joiner"), help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--donors", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role is not None:
        (_donor if args.role == "donor" else _joiner)(args)
        return
    numbers = bench(QUICK_MBYTES if args.quick else args.mbytes, args.rate)
    _report(numbers)
    if args.json:
        print(json.dumps(numbers))


if __name__ == "__main__":
    main()
