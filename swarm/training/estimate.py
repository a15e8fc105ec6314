"""What one peer of a run needs: GPU memory, and bytes on the wire per sync (see docs/hosting.md).

The model is built on the ``meta`` device, so counting the parameters of a 1B-parameter model costs
no memory and about a second. Memory is the sum of

* weights and gradients: float32, ``4 P`` each (bf16 autocast computes in bf16, stores in float32);
* inner AdamW state: on CUDA bitsandbytes' 8-bit AdamW, 2 bytes per element plus a float32 scale
  per 256-element block and state, for tensors of at least 4096 elements (smaller ones: ``8 n``);
  on the CPU torch's AdamW, ``8 P``;
* outer optimizer: float32 anchor and momentum, ``4 P`` each; error-feedback residual ``4 P``;
* activations of one micro-batch of one sequence, bf16, per layer per token: ``17 h`` for attention
  and norms (flash attention: no ``s^2`` term) plus ``2 h + 4 i`` for a GELU MLP of width ``i`` or
  ``2 h + 8 i`` for a gated one; plus ``10 V`` per token for the logits (bf16, float32 copy, its
  gradient). With activation checkpointing only each block's float32 input (``4 h`` per token) is
  kept, and one block's activations are rebuilt at a time.

It is an estimate: allocator slack, the CUDA context (~0.5 GiB) and temporary buffers come on top.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from swarm.compression import HEADER_SIZE, get_codec
from swarm.config import RunConfig
from swarm.training.model import build_model, count_parameters

BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
GIB = 1 << 30


@dataclass(frozen=True)
class Shape:
    """What the activation estimate needs about a transformer."""

    layers: int
    hidden: int
    intermediate: int
    vocab: int
    block_size: int
    gated_mlp: bool


@dataclass(frozen=True)
class PeerEstimate:
    """Bytes one peer needs. ``wire_*`` are per sync, in each direction (sent = received)."""

    parameters: int
    device: str
    weights: int
    gradients: int
    inner_optimizer: int
    outer_state: int
    residual: int
    activations: int
    activations_checkpointed: int
    wire_delta: int
    wire_params: int
    param_sync_every: int

    def memory(self, checkpointing: bool) -> int:
        """Total bytes with or without activation checkpointing."""
        states = self.weights + self.gradients + self.inner_optimizer + self.outer_state + self.residual
        return states + (self.activations_checkpointed if checkpointing else self.activations)

    @property
    def wire_per_sync(self) -> float:
        """Pseudo-gradient exchange plus the full-parameter exchange amortised over its period."""
        return self.wire_delta + self.wire_params / self.param_sync_every


def model_shape(config: RunConfig, model: nn.Module) -> Shape:
    """Layers and widths of the configured model (from the transformers config for kind 'hf')."""
    m = config.model
    if m.kind == "gpt":
        return Shape(m.n_layer, m.n_embd, 4 * m.n_embd, m.vocab_size, m.block_size, gated_mlp=False)
    hf = model.inner.config
    hidden = hf.hidden_size
    gated = getattr(hf, "hidden_act", "") == "silu" or hasattr(hf, "mlp_bias")
    context = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", m.block_size)
    return Shape(
        layers=hf.num_hidden_layers,
        hidden=hidden,
        intermediate=getattr(hf, "intermediate_size", None) or 4 * hidden,
        vocab=hf.vocab_size,
        block_size=min(m.block_size, context),
        gated_mlp=gated,
    )


def activation_bytes(shape: Shape, micro_batch: int = 1) -> tuple[int, int]:
    """Activations of one micro-batch, without and with activation checkpointing."""
    tokens = micro_batch * shape.block_size
    mlp = 2 * shape.hidden + (8 if shape.gated_mlp else 4) * shape.intermediate
    per_layer = tokens * (17 * shape.hidden + mlp)
    logits = tokens * 10 * shape.vocab
    full = shape.layers * per_layer + logits
    checkpointed = shape.layers * tokens * 4 * shape.hidden + per_layer + logits
    return full, checkpointed


def adamw_state_bytes(model: nn.Module, cuda: bool) -> int:
    """Inner AdamW state: 8-bit blockwise on CUDA (as bitsandbytes stores it), float32 on the CPU."""
    total = 0
    for param in model.parameters():
        n = param.numel()
        if cuda and n >= BNB_MIN_8BIT_SIZE:
            total += 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
        else:
            total += 8 * n
    return total


def wire_bytes(model: nn.Module, codec_name: str, block_size: int) -> int:
    """Bytes of one direction of an exchange: one frame (header + codec payload) per tensor."""
    codec = get_codec(codec_name, block_size, backend="torch")
    return sum(HEADER_SIZE + codec.payload_nbytes(p.numel()) for p in model.parameters())


def estimate_peer(config: RunConfig, device: str = "cuda") -> PeerEstimate:
    """Memory and traffic of one peer of ``config`` on ``device`` ('cuda' or 'cpu')."""
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renamed checkpointing methods
        model = build_model(config.model, config.run.seed)
    params = count_parameters(model)
    activations, checkpointed = activation_bytes(model_shape(config, model))
    feedback = config.compression.error_feedback and config.compression.codec not in ("fp32",)
    return PeerEstimate(
        parameters=params,
        device=device,
        weights=4 * params,
        gradients=4 * params,
        inner_optimizer=adamw_state_bytes(model, cuda=device == "cuda"),
        outer_state=8 * params,
        residual=4 * params if feedback else 0,
        activations=activations,
        activations_checkpointed=checkpointed,
        wire_delta=wire_bytes(model, config.compression.codec, config.compression.block_size),
        wire_params=wire_bytes(model, config.averaging.param_codec, config.compression.block_size),
        param_sync_every=config.averaging.param_sync_every,
    )


def describe_estimate(estimate: PeerEstimate) -> list[str]:
    """Lines for ``swarm config check``."""
    e = estimate
    optimizer = "8-bit AdamW" if e.device == "cuda" else "AdamW"
    return [
        f"parameters: {e.parameters:,}",
        f"memory per peer on {e.device} (micro-batch 1): {_size(e.memory(False))}, "
        f"{_size(e.memory(True))} with activation checkpointing",
        f"  weights {_size(e.weights)} + gradients {_size(e.gradients)}"
        f" + {optimizer} {_size(e.inner_optimizer)}"
        f" + outer anchor and momentum {_size(e.outer_state)} + error feedback {_size(e.residual)}"
        f" + activations {_size(e.activations)} ({_size(e.activations_checkpointed)} checkpointed)",
        f"wire per sync per peer, each direction: {_size(e.wire_per_sync)} "
        f"(pseudo-gradient {_size(e.wire_delta)}, plus parameters {_size(e.wire_params)} "
        f"every {e.param_sync_every} syncs)",
    ]


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
