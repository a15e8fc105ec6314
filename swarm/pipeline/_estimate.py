"""What one stage peer needs: memory, and activation bytes on the wire per sample (``swarm config check``).

The pieces are :mod:`swarm.learning.estimate`'s, applied to one stage's tensors (sizes only):
weights and gradients (float32), the inner AdamW state, the outer anchor and momentum, the
error-feedback residual and the sync path's buffers (the stage's own gossip; the partners' frames
are host memory and not counted here), plus

* the activations of one micro-batch of ``pipeline.microbatch_size`` sequences through the stage's
  blocks (the logits only on the last stage);
* the server's cache of micro-batch inputs (recomputed in the backward pass): at most
  ``MAX_CACHED`` inputs of ``microbatch_size x block_size x n_embd`` float32.

Activation bytes per sample are one direction of one stage boundary: a frame of ``block_size x
n_embd`` values in ``pipeline.activation_codec``; the gradient travels back the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.compression import HEADER_SIZE, get_codec
from swarm.config import RunConfig
from swarm.learning.estimate import (
    GIB,
    Shape,
    activation_bytes,
    adamw_state_bytes,
    format_bytes,
    sync_buffer_bytes,
)
from swarm.pipeline._plan import StageSpec, check_pipeline, cut_stages, tensor_sizes


class _Tensors:
    """Stands in for a stage module where only the parameter sizes matter (no build, no memory)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def parameters(self) -> list[torch.Tensor]:
        return [torch.empty(n, device="meta") for n in self.sizes]


MAX_CACHED = 64
"""Micro-batch inputs a stage server keeps at most (the oldest are dropped first)."""


@dataclass(frozen=True)
class StageEstimate:
    """Bytes one peer of a stage needs on ``device`` (micro-batch ``pipeline.microbatch_size``)."""

    spec: StageSpec
    device: str
    parameters: int
    model: int
    outer: int
    activations: int
    activations_checkpointed: int
    cache: int
    wire_per_sample: int

    @property
    def memory(self) -> int:
        """Everything on the device, without activation checkpointing."""
        return self.model + self.outer + self.activations + self.cache

    @property
    def memory_checkpointed(self) -> int:
        return self.model + self.outer + self.activations_checkpointed + self.cache


def estimate_stage(config: RunConfig, spec: StageSpec, device: str = "cuda") -> StageEstimate:
    """Memory and activation traffic of one peer serving stage ``spec`` of ``config``."""
    stage = _Tensors(tensor_sizes(config.model, spec))
    params = sum(stage.sizes)
    m, pipe, comp = config.model, config.pipeline, config.compression
    shape = Shape(spec.blocks, m.n_embd, 4 * m.n_embd, m.vocab_size if spec.head else 0, m.block_size, False)
    activations, checkpointed = activation_bytes(shape, pipe.microbatch_size)
    lossy = comp.codec != "fp32"
    avg = config.averaging
    outer = (8 if avg.outer_momentum else 4) * params + (4 * params if lossy and comp.error_feedback else 0)
    outer += sync_buffer_bytes(params, max(stage.sizes))
    boundary = pipe.microbatch_size * m.block_size * m.n_embd * 4
    cache = 0 if spec.embeddings else MAX_CACHED * boundary
    return StageEstimate(
        spec=spec,
        device=device,
        parameters=params,
        model=8 * params + adamw_state_bytes(stage, cuda=device == "cuda"),
        outer=outer,
        activations=activations,
        activations_checkpointed=checkpointed,
        cache=cache,
        wire_per_sample=activation_wire_bytes(config),
    )


def activation_wire_bytes(config: RunConfig) -> int:
    """Bytes of one sample's activations (or their gradient) across one stage boundary, one direction."""
    m, pipe = config.model, config.pipeline
    codec = get_codec(pipe.activation_codec, config.compression.block_size, backend="torch")
    return HEADER_SIZE + codec.payload_nbytes(m.block_size * m.n_embd)


def describe_stages(config: RunConfig, device: str = "cuda") -> list[str]:
    """Lines for ``swarm config check``: one per stage, then the activation traffic."""
    specs = plan_stages(config)
    if len(specs) == 1:
        return []
    budget = config.pipeline.memory_budget_gb
    lines = [f"pipeline: {len(specs)} stages (the head is untied from the token embedding)"]
    for spec in specs:
        e = estimate_stage(config, spec, device)
        parts = ["embeddings"] if spec.embeddings else []
        parts.append(f"blocks {spec.first}-{spec.last - 1}")
        parts += ["head + loss"] if spec.head else []
        fits = (
            ""
            if budget is None
            else (" fits" if e.memory <= budget * GIB else " does NOT fit") + f" {budget} GiB"
        )
        lines.append(
            f"  stage {spec.index} ({', '.join(parts)}): {e.parameters:,} parameters, "
            f"{format_bytes(e.memory)} on {device} ({format_bytes(e.memory_checkpointed)} checkpointed){fits}"
        )
    per_sample = activation_wire_bytes(config)
    lines.append(
        f"  activations per sample per stage boundary: {format_bytes(per_sample)} each way "
        f"({config.pipeline.activation_codec}; {per_sample / config.model.block_size:.1f} B per token)"
    )
    return lines


def resolve_num_stages(config: RunConfig) -> int:
    """``pipeline.num_stages``, or for ``auto`` the smallest count whose largest stage fits the budget.

    ``auto`` sizes stages for a CUDA device (8-bit AdamW, the outer state next to the parameters,
    micro-batch ``pipeline.microbatch_size``) against ``pipeline.memory_budget_gb``.
    """
    pipeline = config.pipeline
    if pipeline.num_stages != "auto":
        return int(pipeline.num_stages)
    if config.model.kind != "gpt":
        raise ValueError("pipeline.num_stages 'auto' needs model.kind 'gpt'")
    budget = float(pipeline.memory_budget_gb or 0) * GIB
    largest = 0
    for count in range(1, config.model.n_layer + 1):
        check_pipeline(config, count)
        largest = max(estimate_stage(config, spec, "cuda").memory for spec in cut_stages(config, count))
        if largest <= budget:
            return count
    raise ValueError(
        f"pipeline.memory_budget_gb = {pipeline.memory_budget_gb}: even {config.model.n_layer} stages "
        f"need {largest / GIB:.2f} GiB for the largest one"
    )


def plan_stages(config: RunConfig, num_stages: int | None = None) -> tuple[StageSpec, ...]:
    """The stages of ``config`` (``num_stages`` overrides ``pipeline.num_stages``, resolving ``auto``)."""
    return cut_stages(config, resolve_num_stages(config) if num_stages is None else num_stages)
