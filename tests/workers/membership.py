"""A bare member for the membership tests: announces itself and prints the members it sees.

Output lines: ``READY <peer id> <maddr>`` once, then ``MEMBERS <id>,<id>,...`` every ``--period``.
Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import signal
import threading

from swarm import NetworkOptions, NodeInfo, SwarmNode


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--initial-peer", action="append", default=[])
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--ttl", type=float, default=4.0)
    parser.add_argument("--period", type=float, default=0.5)
    args = parser.parse_args()

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    info = NodeInfo(run_id=args.run_id, config_hash="0123abcd", role="trainer")
    options = NetworkOptions(initial_peers=args.initial_peer)
    with SwarmNode(options, info, record_interval_s=args.interval, record_ttl_s=args.ttl) as node:
        print("READY", node.peer_id, node.visible_maddrs()[0], flush=True)
        while not stop.wait(args.period):
            print("MEMBERS", ",".join(m.peer_id for m in node.members()), flush=True)


if __name__ == "__main__":
    main()
