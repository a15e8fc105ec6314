"""Throughput a peer can see: tokens per second, model FLOPs utilisation (MFU) and peak memory.

MFU is the share of the device's peak arithmetic the training really uses: tokens per second times
the model's FLOPs per token, over the peak FLOPs of the device in the precision it computes in. The
FLOPs per token of a transformer are ``6 N`` for the weights (forward ``2 N``, backward ``4 N``) plus
``12 L h T`` for attention over a context of ``T`` tokens (PaLM's appendix B); recomputation under
activation checkpointing is not counted (it is not model work). Peak FLOPs come from the vendors'
datasheets, dense (no sparsity), for the tensor cores in 16-bit types and the vector units in fp32;
a device not in :data:`PEAK_TFLOPS` has an unknown MFU, and so has the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PEAK_TFLOPS: dict[str, tuple[float | None, float, float]] = {
    # name as torch reports it (matched by substring, longest first): (bf16, fp16, fp32) dense TFLOP/s
    "H200": (989.0, 989.0, 67.0),
    "H100 PCIe": (756.0, 756.0, 51.0),
    "H100": (989.0, 989.0, 67.0),
    "A100": (312.0, 312.0, 19.5),
    "A10G": (70.0, 70.0, 31.2),
    "A10": (125.0, 125.0, 31.2),
    "L40S": (362.0, 362.0, 91.6),
    "L40": (181.0, 181.0, 90.5),
    "L4": (121.0, 121.0, 30.3),
    "A6000": (154.8, 154.8, 38.7),
    "RTX 4090": (165.2, 165.2, 82.6),
    "RTX 4080": (97.5, 97.5, 48.7),
    "RTX 4070": (58.3, 58.3, 29.1),
    "RTX 3090": (71.0, 71.0, 35.6),
    "RTX 3080": (59.5, 59.5, 29.8),
    "RTX 3070": (40.6, 40.6, 20.3),
    "RTX 3060": (25.6, 25.6, 12.7),
    "RTX 2080 Ti": (None, 53.8, 13.4),
    "RTX 2080": (None, 40.3, 10.1),
    "RTX 2070": (None, 31.5, 7.9),
    "RTX 2060": (None, 25.8, 6.5),
    "T4": (None, 65.0, 8.1),
    "V100": (None, 125.0, 15.7),
    "MI300X": (1307.0, 1307.0, 163.4),
    "MI250X": (383.0, 383.0, 47.9),
    "MI250": (362.1, 362.1, 45.3),
}


def peak_flops(device_name: str, precision: str) -> float | None:
    """Peak FLOP/s of the device called ``device_name`` in ``precision`` (bf16/fp16/fp32), or None when
    unknown (the CPU, a device missing from the table, bf16 on a card without it)."""
    column = {"bf16": 0, "fp16": 1, "fp32": 2}[precision]
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in device_name:
            tflops = PEAK_TFLOPS[key][column]
            return None if tflops is None else tflops * 1e12
    return None


def flops_per_token(params: int, layers: int, hidden: int, context: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L h T`` (weights forward and backward, attention)."""
    return 6.0 * params + 12.0 * layers * hidden * context


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most memory torch's allocator held for tensors on ``device`` since start; None off CUDA."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


@dataclass
class Throughput:
    """Smoothed tokens per second of compute, and the MFU they give (None when the peak is unknown)."""

    flops_per_token: float
    peak_flops: float | None
    tokens_per_s: float = 0.0

    def record(self, tokens: int, compute_seconds: float) -> None:
        rate = tokens / max(compute_seconds, 1e-9)
        self.tokens_per_s = rate if self.tokens_per_s == 0.0 else 0.9 * self.tokens_per_s + 0.1 * rate

    @property
    def mfu(self) -> float | None:
        if self.peak_flops is None or self.tokens_per_s == 0.0:
            return None
        return self.tokens_per_s * self.flops_per_token / self.peak_flops


def model_dims(model: torch.nn.Module) -> tuple[int, int]:
    """``(layers, hidden)`` of the built-in GPT or a transformers model (0, 0 when unknown)."""
    blocks = getattr(model, "blocks", None)
    if blocks is not None:
        return len(blocks), int(model.wte.embedding_dim)
    config = getattr(getattr(model, "inner", None), "config", None)
    if config is not None:
        layers = getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0)
        hidden = getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0)
        return int(layers), int(hidden)
    return 0, 0
