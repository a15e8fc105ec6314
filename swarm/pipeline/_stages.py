"""The module of one pipeline stage, built on its own from the seed (never the whole model first).

A :class:`StageModule` holds the parts of the GPT its :class:`~swarm.pipeline.StageSpec` names, under
the names the whole model would give them (``blocks.7.attn.qkv.weight``), and initialises each tensor
from a generator seeded by ``(seed, name)``. So a stage is the same on every peer, a peer never holds
more than its stage, and the stages of any cut put together are one model: the one :func:`build_full`
builds (one stage holding everything), which is the data-parallel reference of the same network.

Contract: stage 0 takes token ids ``(batch, time)`` int64, the others activations ``(batch, time,
n_embd)``; every stage but the last returns activations of that shape, the last one logits, and
:meth:`StageModule.loss` the mean next-token cross-entropy in nats.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.config import ModelSection
from swarm.learning.model import Block
from swarm.pipeline._plan import StageSpec

INIT_STD = 0.02


class StageModule(nn.Module):
    """Blocks ``spec.first .. spec.last - 1``, with the embeddings on stage 0 and norm + head on the last."""

    def __init__(self, model: ModelSection, spec: StageSpec) -> None:
        super().__init__()
        self.spec = spec
        self.block_size = model.block_size
        self.activation_checkpointing = False
        if spec.embeddings:
            self.wte = nn.Embedding(model.vocab_size, model.n_embd)
            self.wpe = nn.Embedding(model.block_size, model.n_embd)
            self.drop = nn.Dropout(model.dropout)
        self.blocks = nn.ModuleDict(
            {str(i): Block(model.n_embd, model.n_head, model.dropout) for i in range(spec.first, spec.last)}
        )
        if spec.head:
            self.ln_f = nn.LayerNorm(model.n_embd)
            self.lm_head = nn.Linear(model.n_embd, model.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.embeddings:
            time = x.shape[1]
            if time > self.block_size:
                raise ValueError(f"sequence of {time} tokens is longer than block_size {self.block_size}")
            x = self.drop(self.wte(x) + self.wpe(torch.arange(time, device=x.device)))
        for block in self.blocks.values():
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.spec.head:
            return self.lm_head(self.ln_f(x))
        return x

    def loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats (last stage only)."""
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"swarm.pipeline.init/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def _initialise(module: StageModule, seed: int, n_layer: int) -> None:
    """GPT-2 initialisation, each tensor drawn from its own generator (so it does not depend on the cut)."""
    for name, param in module.named_parameters():
        if name.endswith("bias"):
            param.zero_()
        elif param.dim() == 1:  # LayerNorm gains
            param.fill_(1.0)
        else:
            std = (
                INIT_STD / math.sqrt(2 * n_layer)
                if name.endswith(("attn.proj.weight", "mlp.down.weight"))
                else INIT_STD
            )
            generator = torch.Generator().manual_seed(_seed_of(seed, name))
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_stage(model: ModelSection, spec: StageSpec, seed: int) -> StageModule:
    """Stage ``spec`` of the configured GPT, on the CPU, initialised from ``seed`` (on the current default
    device when it is ``meta``: no memory, no initialisation, for estimates)."""
    stage = StageModule(model, spec)
    if next(stage.parameters()).device.type != "meta":
        _initialise(stage, seed, model.n_layer)
    return stage


def build_full(model: ModelSection, seed: int) -> StageModule:
    """The whole pipelined network as one stage: what the stages of any cut add up to (untied head)."""
    sizes_spec = StageSpec(0, 1, 0, model.n_layer, parameters=0)
    return build_stage(model, sizes_spec, seed)


def stage_parameters(stage: nn.Module) -> int:
    """Trainable parameters of a stage."""
    return sum(p.numel() for p in stage.parameters() if p.requires_grad)
