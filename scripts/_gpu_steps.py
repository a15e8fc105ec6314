"""One in-process step of scripts/gpu_check.sh: a peer's memory path in one layout, measured.

    python -m scripts._gpu_steps --config configs/llama-1b.yaml --layout host --cap-gib 12 --out F.json

Builds the config's model on the device (CUDA, else the CPU for the dry run) with its inner trainer at
micro-batch 1 and the outer state where ``--layout`` puts it; takes ``--steps`` inner steps (the last one
timed alone: tokens/s and MFU of a warm step, one process on the GPU); then one round as an exchange
makes it: the pseudo-gradient through the run's codec with error feedback (bitsandbytes' kernels on
CUDA where they work), the outer step, the parameters moved; then an evaluation. Writes what it
measured and the estimate's figures (:func:`swarm.learning.estimate.estimate_peer`) as JSON. With
``--cap-gib`` the allocator is capped (``torch.cuda.set_per_process_memory_fraction``) as on a smaller
card. ``--set KEY=VALUE`` overrides the config (the dry run's tiny sizes).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from swarm.compression import ErrorFeedback, get_codec
from swarm.config import load_config
from swarm.learning import InnerTrainer, OuterOptimizer, build_model, evaluate
from swarm.learning.estimate import estimate_peer


def _batches(vocab: int, block: int, batch: int, device: torch.device):
    generator = torch.Generator().manual_seed(0)
    while True:
        x = torch.randint(vocab, (batch, block + 1), generator=generator)
        yield x[:, :-1], x[:, 1:]


def _context_bytes(device: torch.device) -> int:
    """Device memory in use that no tensor of ours holds: the context, cuBLAS, kernels (and others')."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return int(total - free - torch.cuda.memory_reserved(device))


def _exchange(model: torch.nn.Module, outer: OuterOptimizer, compression: Any) -> dict[str, Any]:
    """One round through the real codec with error feedback: encode and decode the pseudo-gradient
    tensor by tensor, step the anchor, move the parameters to it."""
    codec_name = compression.codec
    codec = get_codec(codec_name, compression.block_size, backend="auto") if codec_name != "fp32" else None
    feedback = ErrorFeedback(codec) if codec is not None and compression.error_feedback else None
    averaged, wire = {}, 0
    for name, gradient in outer.pseudo_gradient().items():
        if codec is None:
            averaged[name] = gradient
            continue
        # on the state's device, where the residual lives (the estimate's layout)
        encoded = feedback.encode(name, gradient) if feedback is not None else codec.encode(gradient)
        wire += encoded.nbytes
        averaged[name] = codec.decode(encoded).view_as(gradient)
    outer.apply(averaged)
    return {
        "committed": True,
        "wire_bytes": wire,
        "codec": codec_name,
        "error_feedback": feedback is not None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = load_config(args.config, overrides=args.sets, env={})
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if cuda else "cpu")
    cap = args.cap_gib * 2**30 if args.cap_gib and cuda else None
    if cuda:
        torch.cuda.init()
        total = torch.cuda.get_device_properties(device).total_memory
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
    context = _context_bytes(device)
    host = args.layout == "host"
    model = build_model(config.model, config.run.seed).to(device)
    outer = OuterOptimizer.from_config(model, config.averaging, state_device="cpu" if host else None)
    trainer = InnerTrainer(
        model,
        config.train,
        device,
        micro_batch_size=1,
        block_size=config.model.block_size,
        activation_checkpointing=config.train.activation_checkpointing,
    )
    data = _batches(config.model.vocab_size, config.model.block_size, config.train.batch_size, device)
    for _ in range(max(args.steps - 1, 0)):
        trainer.step(data)
    if cuda:
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    stats = trainer.step(data)  # the warm step, timed alone
    warm_seconds = time.perf_counter() - started
    exchange = _exchange(model, outer, config.compression)
    loss = _evaluate(model, config, data, trainer)
    estimate = estimate_peer(config, device.type, eight_bit=trainer.optimizer_name == "adamw8bit")
    checkpointing = config.train.activation_checkpointing
    # the estimate of what this one process holds: no exchange's offer or frames (no partner)
    expected = estimate.device_memory(checkpointing, host_state=host) - (
        0 if host else estimate.exchange_buffers
    )
    peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
    reserved = int(torch.cuda.max_memory_reserved(device)) if cuda else None
    tokens = stats.samples * config.model.block_size
    return {
        "step": f"{Path(args.config).stem} {args.layout} layout",
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "cuda": cuda,
        "cap_bytes": cap,
        "precision": trainer.precision.name,
        "optimizer": trainer.optimizer_name,
        "steps": trainer.steps,
        "loss": stats.loss,
        "eval_loss": loss,
        "exchange": exchange,
        "tokens_per_second": tokens / warm_seconds,
        "mfu": trainer.throughput.mfu,
        "peak_allocated_bytes": peak,
        "peak_reserved_bytes": reserved,
        "context_bytes": context,
        "footprint_bytes": None if reserved is None else reserved + context,
        "estimated_device_bytes": expected,
        "estimated_footprint_bytes": estimate.device_footprint(checkpointing, host_state=host),
        "peak_over_estimate": None if peak is None else peak / expected,
        "host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "estimated_program_bytes": estimate.program,
        "pinned_bytes": _pinned_bytes(),
    }


def _evaluate(model: torch.nn.Module, config: Any, data: Any, trainer: InnerTrainer) -> float:
    from swarm.learning import EvalSet

    x, _ = next(data)
    eval_set = EvalSet(x.reshape(-1), config.model.block_size, batch_size=max(1, len(x) // 2))
    trainer.free_gradients()
    return evaluate(model, eval_set, 1, micro_batch_size=1, precision=trainer.precision)


def _pinned_bytes() -> int | None:
    """Page-locked host bytes torch's caching host allocator holds (None where torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        return int(stats().get("reserved_bytes.current", 0))
    except RuntimeError:
        return None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--layout", choices=("host", "device"), required=True)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even with a GPU (the dry run)")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    report = run(args)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
    return 0 if math.isfinite(report["eval_loss"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
