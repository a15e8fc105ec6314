"""A state donor for the state-transfer tests: one StateServer on its own p2pd (no DHT), one snapshot.

Output lines: ``READY <peer id> <maddr> <digest>`` once, then ``STATS requests=.. parts=.. frames=..
refused=..`` whenever the counters change. ``--corrupt`` flips a byte in every frame it sends,
``--corrupt-from N`` in every frame of index N or more. Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

import torch

SCHEMA = {"param/w": (64, 300), "param/b": (300,), "momentum/w": (64, 300), "momentum/b": (300,)}


def make_state(seed: int, step: int = 10) -> tuple[dict[str, torch.Tensor], dict]:
    """Deterministic tensors and meta for ``seed`` (the tests regenerate them to check results). The
    values are ones bf16 holds, so a download returns exactly them."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=generator) for name, shape in SCHEMA.items()}
    tensors = {name: t.bfloat16().float() for name, t in tensors.items()}
    meta = {"round": step // 10, "step": step, "samples_total": step * 32}
    return tensors, meta


def flip_byte(index: int, frame: bytes) -> bytes:
    corrupted = bytearray(frame)
    corrupted[-1] ^= 0xFF
    return bytes(corrupted)


def main() -> None:
    from hivemind.p2p import P2P

    from swarm.state import StateServer, make_snapshot
    from tests._faults import faulty_snapshot

    parser = argparse.ArgumentParser()
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--step", type=int, default=10)
    parser.add_argument("--chunk-bytes", type=int, default=16384)
    parser.add_argument("--corrupt", action="store_true")
    parser.add_argument("--corrupt-from", type=int, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    maddrs = []

    async def own_daemon() -> P2P:  # a bare p2pd, no DHT: the client dials us by address
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs.extend(await p2p.get_visible_maddrs())
        return p2p

    server = StateServer(run_id=args.run_id, p2p_factory=own_daemon)
    try:
        snapshot = make_snapshot(*make_state(args.seed, args.step), chunk_bytes=args.chunk_bytes)
        first_bad = 0 if args.corrupt else args.corrupt_from
        if first_bad is None:
            server.publish(snapshot)
        else:
            corrupt = lambda index, frame: flip_byte(index, frame) if index >= first_bad else frame  # noqa: E731
            server.publish(faulty_snapshot(snapshot, corrupt=corrupt))
        print("READY", server.peer_id, maddrs[0], snapshot.digest, flush=True)
        last = None
        while not stop.wait(0.05):
            s = server.stats()
            line = f"STATS requests={s.requests} parts={s.parts_served} frames={s.frames_sent}"
            line += f" refused={s.refused}"
            if line != last:
                print(line, flush=True)
                last = line
    finally:
        server.close()


if __name__ == "__main__":
    main()
