"""Sampling text from the built-in byte-level GPT (one token per byte)."""

from __future__ import annotations

import torch
from torch import nn

from swarm.learning import GPT

BYTE_VOCAB = 256


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: bytes,
    max_new_bytes: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
) -> bytes:
    """Sample ``max_new_bytes`` bytes following ``prompt``; the same seed gives the same bytes.

    The model sees at most its last ``block_size`` bytes (a longer prompt is cropped to its end).
    ``temperature`` 0 picks the most likely byte each time; ``top_k`` keeps only the k most likely
    bytes before sampling (None: all). Raises ValueError on bad arguments or a model that is not the
    byte-level GPT (``model.kind: gpt`` with ``vocab_size: 256``).
    """
    if not isinstance(model, GPT):
        raise ValueError("text generation supports the built-in byte-level GPT (model.kind gpt) only")
    if model.wte.num_embeddings != BYTE_VOCAB:
        raise ValueError(
            f"text generation needs model.vocab_size {BYTE_VOCAB} (bytes), this model has "
            f"{model.wte.num_embeddings}"
        )
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_bytes < 1:
        raise ValueError(f"max_new_bytes must be positive, got {max_new_bytes}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be positive, got {top_k}")
    block = model.block_size
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    context = torch.tensor(list(prompt[-block:]), dtype=torch.long, device=device)[None]
    was_training = model.training
    model.eval()
    new: list[int] = []
    try:
        for _ in range(max_new_bytes):
            logits = model(context[:, -block:])[0, -1].float().cpu()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
            new.append(token)
            context = torch.cat([context, torch.tensor([[token]], device=device)], dim=1)[:, -block:]
    finally:
        model.train(was_training)
    return bytes(new)
