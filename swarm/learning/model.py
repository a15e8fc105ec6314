"""The model every peer trains: a small byte-level GPT, or a ``transformers`` causal LM from a config.

Both kinds share one contract, so the rest of the training code never asks which one it holds:
``model(idx) -> logits`` with ``idx`` of shape ``(batch, time)`` (int64 token ids) and logits of shape
``(batch, time, vocab)``, and :func:`lm_loss` for the next-token cross-entropy.

The built-in GPT follows nanoGPT: token + position embeddings, pre-LayerNorm blocks of causal
self-attention and an MLP, a final LayerNorm and a head tied to the token embedding.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from swarm.config import ModelSection


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        # (batch, time, channels) -> (batch, heads, time, head size)
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, time, channels)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network, four times wider than the residual stream."""

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(n_embd, 4 * n_embd)
        self.down = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    """One transformer block: pre-LayerNorm attention and MLP, each added to the residual stream."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A small GPT language model over ``vocab_size`` tokens (256: one token per byte)."""

    def __init__(self, config: ModelSection) -> None:
        super().__init__()
        self.block_size = config.block_size
        self.activation_checkpointing = False
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            Block(config.n_embd, config.n_head, config.dropout) for _ in range(config.n_layer)
        )
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self._init_weights(config.n_layer)

    def _init_weights(self, n_layer: int) -> None:
        """GPT-2 initialisation; projections into the residual stream are scaled down by depth."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, time = idx.shape
        if time > self.block_size:
            raise ValueError(f"sequence of {time} tokens is longer than block_size {self.block_size}")
        positions = torch.arange(time, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                # Recompute the block's activations in the backward pass instead of storing them.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM behind the same ``model(idx) -> logits`` contract as :class:`GPT`."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    @property
    def activation_checkpointing(self) -> bool:
        return bool(getattr(self.inner, _hf_name(self.inner, "is_{}_checkpointing"), False))

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        pattern = "{}_checkpointing_enable" if enabled else "{}_checkpointing_disable"
        getattr(self.inner, _hf_name(self.inner, pattern))()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=idx, use_cache=False).logits


def _hf_name(model: nn.Module, pattern: str) -> str:
    """transformers' name for a checkpointing method: ``activation_...`` where it has it (its
    ``gradient_...`` names are deprecated and go in v6), ``gradient_...`` in older releases."""
    new = pattern.format("activation")
    return new if hasattr(type(model), new) else pattern.format("gradient")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "model.kind 'hf' needs the 'transformers' package: pip install transformers"
        ) from error
    return transformers


# hf_config keys that are sizes or counts (hidden_size, num_attention_heads, n_layer, ...): at least 1.
_SIZE_KEY = re.compile(r"(^n_|^num_|_size$|_heads$|_layers?$|_embeddings$)")


def hf_model_config(config: ModelSection) -> Any:
    """The transformers config ``model.hf_config`` describes (``vocab_size`` from the model section).

    Raises ValueError with one line that names the offending key (``model.hf_config.model_type``, a
    size below 1, or what transformers itself rejects) rather than a transformers traceback.
    """
    transformers = _transformers()
    options: dict[str, Any] = dict(config.hf_config or {})
    model_type = options.pop("model_type", None)
    if model_type is None or model_type == "":
        raise ValueError(
            "model.hf_config.model_type: missing; name the architecture (e.g. 'gpt2' or 'llama')"
        )
    if not isinstance(model_type, str):
        raise ValueError(f"model.hf_config.model_type: must be a string (got {model_type!r})")
    if model_type not in transformers.CONFIG_MAPPING:
        raise ValueError(
            f"model.hf_config.model_type: transformers {transformers.__version__} knows no model type "
            f"{model_type!r} (e.g. 'gpt2', 'llama')"
        )
    for key, value in options.items():
        if (
            _SIZE_KEY.search(str(key))
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value < 1
        ):
            raise ValueError(f"model.hf_config.{key}: must be at least 1 (got {value})")
    options.setdefault("vocab_size", config.vocab_size)
    try:
        return transformers.AutoConfig.for_model(model_type, **options)
    except Exception as exc:  # transformers and huggingface_hub raise many kinds for a bad value
        raise ValueError(f"model.hf_config: {_one_line(exc)}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _build_hf_model(config: ModelSection) -> nn.Module:
    hf_config = hf_model_config(config)
    try:
        return HFCausalLM(_transformers().AutoModelForCausalLM.from_config(hf_config))
    except (ValueError, TypeError, ZeroDivisionError, IndexError, KeyError, RuntimeError) as exc:
        raise ValueError(f"model.hf_config: transformers cannot build this model: {_one_line(exc)}") from None


def build_model(config: ModelSection, seed: int, *, activation_checkpointing: bool = False) -> nn.Module:
    """Build the configured model on the CPU with weights determined by ``seed`` alone.

    The global random state is left as it was, so building a model does not change what other
    code draws afterwards. ``activation_checkpointing`` trades compute for memory (used on CUDA).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT(config) if config.kind == "gpt" else _build_hf_model(config)
    model.activation_checkpointing = activation_checkpointing
    return model


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in nats; ``y`` holds the token following each one in ``x``."""
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def count_parameters(model: nn.Module) -> int:
    """Number of distinct trainable parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
