#!/usr/bin/env python
"""What membership costs with N real peers on one machine, and whether 32 of them train and exchange.

For each ``--peers N``: a ``swarm bootstrap`` and N ``swarm join`` trainers of configs/membership-bench.yaml
(the tests' tiny GPT, steps padded to 0.25 s on an emulated device, a round every 20 steps, records
every 3 s), each started through scripts/_membership_probe.py, which counts the DHT stores and finds
its node answers by key. Once every trainer has joined and ``--warmup-s`` have passed, two readings
``--window-s`` apart give, per second:

* each trainer's own membership traffic (its record stores and member-list reads, key
  ``<run_id>_members``): the request bytes it sent and the answers it got, as every other node counted
  them;
* what the nodes holding that key serve (the five that serve the most: hivemind's ``num_replicas``);
* with ``--netns`` (root: one network namespace per peer, testbed/netlab.py, unshaped), each trainer's
  whole traffic on its interface; with ``--backend none`` that is DHT traffic only.

Bytes are RPC messages (protobuf); the interface numbers add libp2p, encryption, TCP and IP. Then
``--monitor`` times ``swarm monitor --once --format json`` against the run, once with the run's
config file and once reading the config the swarm publishes (``--profile``: under cProfile as well,
the top entries printed; ``--peer-nice 19``: the bootstrap and trainers yield the CPU to the monitor,
as if it ran on a machine of its own). Every trainer then gets SIGTERM and writes its summary
(rounds, and those that found a partner), then the bootstrap; whatever of any peer's session is still
running 30 s after its peer exited is named, killed, and makes the exit status 1. Memory: resident and
proportional bytes of each peer's processes (the peer, its DHT worker, ``p2pd``), read mid-window.

    .venv/bin/python -m scripts.bench_membership --peers 8 16 32 --backend none --netns   # traffic
    .venv/bin/python -m scripts.bench_membership --peers 32 --netns --monitor --profile    # training
    .venv/bin/python -m scripts.bench_membership --peers 16 32 --backend none --monitor --peer-nice 19
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts import _membership_stats as stats
from scripts._membership_monitor import time_monitor
from scripts._membership_swarm import REPO, Swarm, read_json, signal_name

CONFIG = "configs/membership-bench.yaml"
RUN_ID = "membership-bench"
START_TIMEOUT_S = 600.0  # 32 peers importing torch and starting daemons on two busy cores
POLL_S = 1.0


def _say(text: str) -> None:
    print(f"[bench-membership] {text}", file=sys.stderr, flush=True)


def _common(args: argparse.Namespace, peers: int) -> list[str]:
    sets = [f"averaging.backend={args.backend}", *_shard_sets(args, peers), *args.set]
    return ["--config", CONFIG, *[a for s in sets for a in ("--set", s)]]


def _member_shards(args: argparse.Namespace, peers: int) -> int:
    """The run's ``run.member_shards``: about N / K keys with ``--records-per-shard K``, else one."""
    return max(1, round(peers / args.records_per_shard)) if args.records_per_shard else 1


def _shard_sets(args: argparse.Namespace, peers: int) -> list[str]:
    """The overrides that spread the run's records over :func:`_member_shards` keys."""
    shards = _member_shards(args, peers)
    return [f"run.member_shards={shards}", "averaging.partners=random"] if shards > 1 else []


def _wait(swarm: Swarm, seconds: float, what: str, done: Any = None) -> float:
    """Wait ``seconds`` (or until ``done()``), failing if a peer exits; return the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if failed := swarm.failed():
            statuses = {n: signal_name(s) for n, s in failed.items()}
            raise RuntimeError(f"{what}: exited early: {statuses}; see {swarm.log_dir}")
        if done is not None and done():
            return time.monotonic() - started
        time.sleep(POLL_S)  # polling files and the process table that other processes change
    if done is not None:
        raise RuntimeError(f"{what} within {seconds:.0f} s; see {swarm.log_dir}")
    return time.monotonic() - started


def _joined(log_dir: Path, first: int, last: int) -> bool:
    """Trainers ``first``..``last`` wrote their first history line (once joined and announced)."""
    paths = [log_dir / f"peer-{i}.history.jsonl" for i in range(first, last + 1)]
    return all(p.exists() and p.stat().st_size > 0 for p in paths)


def _reading(swarm: Swarm) -> dict[str, Any]:
    counters = {n: read_json(p.rpc_file) for n, p in swarm.peers.items()}
    return {
        "time": time.time(),
        "rpc": counters,
        "wire": swarm.wire_bytes(),
        "cpu": swarm.cpu_seconds(),
        "load": os.getloadavg()[0],
    }


def _start(swarm: Swarm, peers: int, args: argparse.Namespace) -> tuple[str, float]:
    """The bootstrap, then the trainers in batches of ``--start-batch``, each batch once the last has
    joined (32 processes importing torch at once on two cores: a bootstrap too busy to answer a
    joiner's ping in time); return the bootstrap's address and the seconds until all had joined."""
    from peers.local import wait_for_join_line

    common = _common(args, peers)
    boot = swarm.start("bootstrap", 0, ["bootstrap", *common, "--public-name", "bench-bootstrap"])
    maddr = wait_for_join_line(boot.log.with_suffix(".out"), boot.proc, timeout_s=START_TIMEOUT_S)
    started = time.monotonic()
    for first in range(1, peers + 1, args.start_batch):
        last = min(peers, first + args.start_batch - 1)
        for i in range(first, last + 1):
            swarm.start(f"peer-{i}", i, ["join", *common, "--initial-peers", maddr, *_trainer_args(swarm, i)])
        joined = lambda first=first, last=last: _joined(swarm.log_dir, first, last)  # noqa: E731
        _wait(swarm, START_TIMEOUT_S, f"trainers {first}-{last} did not join", joined)
    return maddr, time.monotonic() - started


def _trainer_args(swarm: Swarm, index: int) -> list[str]:
    name, log_dir = f"peer-{index}", swarm.log_dir
    files = [
        "--summary",
        str(log_dir / f"{name}.summary.json"),
        "--history",
        str(log_dir / f"{name}.history.jsonl"),
    ]
    checkpoints = ["--set", f"train.checkpoint_dir={log_dir / name / 'checkpoints'}"]
    return ["--public-name", name, *files, *checkpoints]


def _measure(swarm: Swarm, peers: int, args: argparse.Namespace, joined_s: float) -> dict[str, Any]:
    """Both readings and the memory between them; the run's row (without the summaries)."""
    _say(f"N={peers}: all trainers joined after {joined_s:.0f} s; warming up {args.warmup_s:.0f} s")
    _wait(swarm, args.warmup_s, "warm-up")
    before = _reading(swarm)
    _wait(swarm, args.window_s / 2, "window")
    memory = swarm.memory()
    _wait(swarm, args.window_s / 2, "window")
    after = _reading(swarm)
    trainers = [f"peer-{i}" for i in range(1, peers + 1)]
    rates = stats.rpc_rates(before["rpc"], after["rpc"])
    other = stats.rpc_rates(before["rpc"], after["rpc"], kind="other")
    wire = stats.wire_rates(before["wire"], after["wire"], after["time"] - before["time"])
    return {
        "joined_s": joined_s,
        "window_s": after["time"] - before["time"],
        "membership": stats.summarize(rates, trainers, wire),
        "other_dht_per_peer": stats.summarize(other, trainers, {})["peer_total"],
        "sizes": stats.message_sizes(before["rpc"], after["rpc"]),
        "by_rpc": stats.by_rpc(before["rpc"], after["rpc"]),
        "memory": _memory_row(memory, trainers),
        "cpu_cores_per_trainer": _cpu(before, after, trainers),
        "load_average": (before["load"] + after["load"]) / 2,
        "per_node": rates,
        "wire": wire,
    }


def _cpu(before: dict[str, Any], after: dict[str, Any], trainers: list[str]) -> float | None:
    """Mean CPU cores a trainer's processes used in the window (peer, DHT worker, ``p2pd``)."""
    seconds = after["time"] - before["time"]
    used = [after["cpu"][n] - before["cpu"][n] for n in trainers if n in before["cpu"] and n in after["cpu"]]
    return statistics.fmean(used) / seconds if used and seconds > 0 else None


def _memory_row(memory: dict[str, dict[str, int]], trainers: list[str]) -> dict[str, Any]:
    rows = [memory[n] for n in trainers if n in memory]
    if not rows:
        return {}
    keys = sorted({k for r in rows for k in r})
    return {k: sum(r.get(k, 0) for r in rows) / len(rows) for k in keys} | {
        "machine_pss": sum(r.get("pss", 0) for r in memory.values())
    }


def _rounds(log_dir: Path, peers: int) -> dict[str, Any]:
    """From the trainers' summaries: rounds, those that found a partner, peak resident memory."""
    found = alone = 0
    rss, written = [], 0
    for i in range(1, peers + 1):
        summary = read_json(log_dir / f"peer-{i}.summary.json")
        if summary is None:
            continue
        written += 1
        roles = summary.get("rounds_by_role") or {}
        found += roles.get("initiator", 0) + roles.get("responder", 0)
        alone += roles.get("local", 0)
        rss.append(summary.get("peak_rss_bytes") or 0)
    total = found + alone
    return {
        "summaries": written,
        "rounds": total,
        "rounds_with_partner": found,
        "partner_share": found / total if total else None,
        "peak_rss_mean": sum(rss) / len(rss) if rss else None,
    }


def run_one(peers: int, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One run of ``peers`` trainers; its row (``error`` set if it failed)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    lab = None
    if args.netns:
        from testbed import netlab

        lab = netlab.NetLab(hosts=peers + 2, rate=None)
        lab.start()
    swarm = Swarm(log_dir, RUN_ID, lab, nice=args.peer_nice)
    row: dict[str, Any] = {"peers": peers, "backend": args.backend, "netns": args.netns, "logs": str(log_dir)}
    row["member_shards"] = _member_shards(args, peers)
    try:
        maddr, joined_s = _start(swarm, peers, args)
        row |= _measure(swarm, peers, args, joined_s)
        if args.monitor:
            row["monitor"] = time_monitor(swarm, peers + 1, maddr, _common(args, peers), args.profile, _say)
    except (RuntimeError, KeyboardInterrupt) as exc:
        row["error"] = str(exc) or type(exc).__name__
    finally:
        swarm.stop([f"peer-{i}" for i in range(1, peers + 1)])
        swarm.stop(["bootstrap"])
        row["leftover"] = swarm.leftovers()
        swarm.kill_all()
        if lab is not None:
            lab.close()
    row |= _rounds(log_dir, peers)
    return row


def _report(rows: list[dict[str, Any]]) -> None:
    ok = [r for r in rows if "error" not in r]
    print(stats.table(ok))
    fit = stats.fits(ok) if len(ok) > 1 else None
    for line in stats.fit_lines(fit) if fit else []:
        print(line)
    for r in rows:
        print(_run_line(r))
        for name, result in (r.get("monitor") or {}).items():
            seconds, totals = result.get("seconds") or 0.0, result.get("totals")
            print(f"  monitor --once ({name}): {seconds:.1f} s, exit {result.get('status')}, totals {totals}")
        if "error" in r:
            print(f"  error: {r['error']}")


def _run_line(r: dict[str, Any]) -> str:
    """A run's memory, rounds, leftovers and load in one line."""
    memory = {k: v / 2**20 for k, v in (r.get("memory") or {}).items()}
    share = r.get("partner_share")
    parts = (
        f"peer {memory.get('main_rss', 0):.0f}, DHT worker {memory.get('worker_rss', 0):.0f}, "
        f"p2pd {memory.get('p2pd_rss', 0):.0f}"
    )
    return (
        f"N={r['peers']}: joined in {r.get('joined_s', 0):.0f} s; memory per trainer: rss "
        f"{memory.get('rss', 0):.0f} MiB ({parts}), pss {memory.get('pss', 0):.0f} MiB; rounds "
        f"{r.get('rounds')}, with a partner {'-' if share is None else f'{share:.0%}'}; summaries "
        f"{r.get('summaries')}/{r['peers']}; leftover {r.get('leftover') or 'none'}; cpu per trainer "
        f"{r.get('cpu_cores_per_trainer') or 0:.2f} cores, load average {r.get('load_average') or 0:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, nargs="+", default=[8], help="trainer counts, one run each")
    parser.add_argument("--backend", default="gossip", choices=("gossip", "none"), help="averaging.backend")
    parser.add_argument("--start-batch", type=int, default=8, help="trainers started at once")
    parser.add_argument("--warmup-s", type=float, default=20.0, help="after the last join, before the window")
    parser.add_argument("--window-s", type=float, default=30.0, help="between the two readings")
    parser.add_argument("--netns", action="store_true", help="one network namespace per peer (root)")
    parser.add_argument("--monitor", action="store_true", help="time `swarm monitor --once` at the end")
    parser.add_argument("--profile", action="store_true", help="also run the monitor under cProfile")
    parser.add_argument(
        "--peer-nice",
        type=int,
        default=0,
        help="run the bootstrap and trainers at this niceness; the monitor runs at 0, as on its own machine",
    )
    parser.add_argument(
        "--records-per-shard",
        type=int,
        default=0,
        help="spread the records over N / K keys (run.member_shards; averaging.partners: random); 0: one key",
    )
    parser.add_argument("--set", action="append", default=[], help="more config overrides")
    parser.add_argument("--log-dir", type=Path, help="where the logs go (default: a new folder in runs/)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    root = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-membership-", dir=_runs()))
    rows = []
    for peers in args.peers:
        _say(f"N={peers}: starting; logs in {root / f'n{peers}'}")
        rows.append(run_one(peers, args, root / f"n{peers}"))
    _report(rows)
    if args.json is not None:
        ok = [r for r in rows if "error" not in r]
        args.json.write_text(
            json.dumps({"rows": rows, "fit": stats.fits(ok) if len(ok) > 1 else None}, indent=1)
        )
    return 1 if any("error" in r or r.get("leftover") for r in rows) else 0


def _runs() -> Path:
    runs = REPO / "runs"
    runs.mkdir(exist_ok=True)
    return runs


if __name__ == "__main__":
    sys.exit(main())
