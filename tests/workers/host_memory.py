"""Measures, in a fresh process, the peak host memory of a whole-model operation beyond what was there
before it: one model exchange of two trainers (both sides in this process: offer, data phase, commit,
apply) and one checkpoint written and read back. Prints one JSON line of bytes.

``python -m tests.workers.host_memory --layers 16 --width 512`` (a model of ``layers`` linear layers of
``2 * width`` by ``width``). The peak is the kernel's high-water mark of the resident set (VmHWM),
reset before each operation (``/proc/self/clear_refs``), so nothing before it counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import torch

from swarm._device import map_large_allocations
from swarm.compression import ErrorFeedback, get_codec
from swarm.gossip import Committed, SyncOutcome, SyncResult
from swarm.gossip._exchange import ExchangeSpec, run_exchange
from swarm.gossip._robust import ClipPolicy
from swarm.gossip._validation import NormPolicy
from swarm.learning import OuterOptimizer
from swarm.state import read_checkpoint, save_checkpoint
from swarm.trainer._live import LiveModel
from swarm.trainer._offers import ModelOffers
from tests._channels import channel_pair


def resident() -> int:
    """The resident set now, in bytes."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


def reset_peak() -> int:
    """Reset the high-water mark to the resident set now, and return it."""
    Path("/proc/self/clear_refs").write_text("5")
    return resident()


def peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


class Side:
    """One trainer's model, live state, offers and error feedback."""

    def __init__(self, seed: int, layers: int, width: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            *(torch.nn.Linear(width, 2 * width, bias=False) for _ in range(layers))
        )
        self.live = LiveModel(self.model, OuterOptimizer(self.model, lr=0.7, momentum=0.9), 1)
        self.offers = ModelOffers(self.live)
        self.feedback = ErrorFeedback(get_codec("int8", 64))

    @torch.no_grad()
    def train(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with self.live.updating():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=generator), alpha=1e-3)


async def _data_phase(a: Side, b: Side) -> tuple[object, object, object, object]:
    spec = ExchangeSpec(get_codec("int8", 64), 1 << 20, NormPolicy(), ClipPolicy(clip_ratio=0.5))
    offers = a.offers.offer(), b.offers.offer()
    left, right = await channel_pair(max_data=2 << 20)
    try:
        mixed = await asyncio.gather(
            run_exchange(left, offers[0].tensors, (1.0, 1.0), spec, a.feedback),
            run_exchange(right, offers[1].tensors, (1.0, 1.0), spec, b.feedback),
        )
    finally:
        left.close()
        right.close()
    return offers[0], offers[1], mixed[0], mixed[1]


def exchange(a: Side, b: Side) -> None:
    """One model exchange as the averagers run it, committed and applied on both sides."""
    offer_a, offer_b, mixed_a, mixed_b = asyncio.run(_data_phase(a, b))
    result = SyncResult(SyncOutcome.OK, "partner", 0, 0, 0.0, 1.0)
    for side, offer, mixed in ((a, offer_a, mixed_a), (b, offer_b, mixed_b)):
        side.offers.settled(offer, Committed(mixed.tensors, 1.0, side is a, result))
        if not mixed.tensors.kept:
            mixed.tensors.fold_all()
    del offer_a, offer_b, mixed_a, mixed_b
    for side in (a, b):
        side.live.apply_pending()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    map_large_allocations()  # as a trainer does: freed tensors go back to the system at once
    a, b = Side(0, args.layers, args.width), Side(1, args.layers, args.width)
    params = sum(p.numel() for p in a.model.parameters())
    for round_ in range(2):  # the steady state: momentum and residuals exist
        a.train(round_)
        b.train(100 + round_)
        exchange(a, b)
    a.train(7)
    b.train(8)
    base = reset_peak()
    exchange(a, b)
    exchange_growth = peak() - base

    with tempfile.TemporaryDirectory() as directory:
        state = {"outer_optimizer": a.live.outer.state_dict(copy=False)}
        base = reset_peak()
        path = save_checkpoint(directory, state, step=1)
        save_growth = peak() - base
        payload = path.stat().st_size
        base = reset_peak()
        loaded = read_checkpoint(path)
        load_growth = peak() - base
        same = all(
            torch.equal(loaded["outer_optimizer"]["anchor"][n], t) for n, t in a.live.outer.anchor.items()
        )
    report = {
        "parameters": params,
        "exchange_growth": exchange_growth,
        "checkpoint_bytes": payload,
        "save_growth": save_growth,
        "load_growth": load_growth,
        "loaded_equal": same,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
