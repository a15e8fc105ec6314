"""One gossip averager in its own process, for the slow-link tests (tests/test_gossip_deadlines.py).

``python -m tests.workers.link_peer --listen MADDR [--initial-peer MADDR] --numel N [--stall]
[--dial PEER_ID ...] [averager options]``: starts a DHT listening on ``MADDR`` and an averager over a
vector of ``N`` values, and prints one JSON line ``{"peer_id": ..., "maddrs": [...]}``. With ``--stall``
its exchanges stop sending after the first DATA frame, for good. With ``--dial`` it then syncs once
with each given peer, in order, and prints each result as a JSON line ``{"result": {...}}``. It serves
until SIGTERM or SIGINT, then closes everything it started.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading

import hivemind
import torch

from scripts._held import gossip_averager
from swarm.gossip import PartnerInfo
from swarm.gossip._protocol import PROTOCOL_VERSION
from tests._faults import stalling

RUN_ID = "link-test"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", required=True)
    parser.add_argument("--initial-peer", default=None)
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--stall", action="store_true")
    parser.add_argument("--dial", nargs="*", default=[])
    parser.add_argument("--exchange-timeout-s", type=float, default=30.0)
    parser.add_argument("--chunk-timeout-s", type=float, default=10.0)
    return parser.parse_args()


def main() -> None:
    args = _args()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    initial = [args.initial_peer] if args.initial_peer else None
    dht = hivemind.DHT(initial_peers=initial, host_maddrs=[args.listen], start=True, startup_timeout=60)
    partners: list[PartnerInfo] = []
    averager = gossip_averager(
        run_id=RUN_ID,
        dht=dht,
        partner_source=lambda: partners,
        exchange_timeout_s=args.exchange_timeout_s,
        chunk_timeout_s=args.chunk_timeout_s,
        max_attempts=1,
        busy_patience_s=0.0,
        seed=0,
        wrap_channel=stalling(1) if args.stall else lambda channel: channel,
    )
    try:
        averager.set_tensors(
            [torch.randn(args.numel, generator=torch.Generator().manual_seed(len(args.dial)))]
        )
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        print(json.dumps({"peer_id": averager.peer_id, "maddrs": maddrs}), flush=True)
        for peer in args.dial:
            partners[:] = [PartnerInfo(peer, PROTOCOL_VERSION, "")]
            result = averager.sync()
            reply = {
                "outcome": result.outcome.value,
                "reason": result.reason,
                "latency_s": result.latency_s,
                "bytes_sent": result.bytes_sent,
                "bytes_received": result.bytes_received,
            }
            print(json.dumps({"result": reply}), flush=True)
        stop.wait()
    finally:
        averager.close()
        dht.shutdown()


if __name__ == "__main__":
    main()
