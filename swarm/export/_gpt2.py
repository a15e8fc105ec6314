"""The built-in GPT as a ``transformers`` GPT-2: the same architecture, so the mapping is exact.

Both are pre-LayerNorm transformers with learned position embeddings and a head tied to the token
embedding; every tensor maps one to one (GPT-2's ``Conv1D`` stores its weight transposed)::

    swarm GPT (swarm/learning/model.py)        GPT2LMHeadModel
    wte, wpe                                   transformer.wte, transformer.wpe
    blocks.i.ln_1, ln_2 (LayerNorm, eps 1e-5)  transformer.h.i.ln_1, ln_2 (layer_norm_epsilon 1e-5)
    blocks.i.attn.qkv (C -> 3C, q|k|v, bias)   transformer.h.i.attn.c_attn (weight transposed)
    blocks.i.attn.proj (bias)                  transformer.h.i.attn.c_proj (weight transposed)
    blocks.i.mlp.up, down (4C, exact GELU)     transformer.h.i.mlp.c_fc, c_proj (n_inner 4C, "gelu")
    ln_f                                       transformer.ln_f
    lm_head (= wte, no bias)                   lm_head (tie_word_embeddings)

Attention is scaled by 1/sqrt(head size) in both. The activation is the exact (erf) GELU, which is
GPT-2's ``activation_function: gelu``, not its default tanh approximation ``gelu_new``. The files are
written without transformers (config.json and model.safetensors in the ``save_pretrained`` layout),
so exporting needs only safetensors; loading them needs transformers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from swarm.config import ModelSection

_TRANSPOSED = ("attn.qkv", "attn.proj", "mlp.up", "mlp.down")
_BLOCK_NAMES = {
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "attn.qkv": "attn.c_attn",
    "attn.proj": "attn.c_proj",
    "mlp.up": "mlp.c_fc",
    "mlp.down": "mlp.c_proj",
}
_TOP_NAMES = {"wte": "transformer.wte", "wpe": "transformer.wpe", "ln_f": "transformer.ln_f"}
_BLOCK = re.compile(r"^blocks\.(\d+)\.(ln_1|ln_2|attn\.qkv|attn\.proj|mlp\.up|mlp\.down)\.(weight|bias)$")
_HF_BLOCK = re.compile(
    r"^transformer\.h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$"
)
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which the built-in GPT uses


def gpt2_config(section: ModelSection) -> dict[str, Any]:
    """``config.json`` of the GPT-2 that computes what the built-in GPT of ``section`` computes."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": section.vocab_size,
        "n_positions": section.block_size,
        "n_ctx": section.block_size,
        "n_embd": section.n_embd,
        "n_layer": section.n_layer,
        "n_head": section.n_head,
        "n_inner": 4 * section.n_embd,
        "activation_function": "gelu",
        "resid_pdrop": section.dropout,
        "embd_pdrop": section.dropout,
        "attn_pdrop": section.dropout,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": "float32",
    }


def generation_config(section: ModelSection) -> dict[str, Any]:
    """``generation_config.json``: generation stops when the context is full (``max_length`` is
    ``n_positions``), since transformers does not crop the context and fails on positions past it."""
    return {"max_length": section.block_size}


def to_gpt2(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The built-in GPT's ``state_dict`` under GPT-2's names (the tied head stored once, as ``wte``)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue  # tied to wte.weight; transformers ties it again when loading
        block = _BLOCK.match(name)
        if block:
            index, part, kind = block.groups()
            value = tensor.t() if part in _TRANSPOSED and kind == "weight" else tensor
            out[f"transformer.h.{index}.{_BLOCK_NAMES[part]}.{kind}"] = value.detach().contiguous()
            continue
        top, _, kind = name.partition(".")
        if top not in _TOP_NAMES:
            raise ValueError(f"{name} has no GPT-2 counterpart")
        out[f"{_TOP_NAMES[top]}.{kind}"] = tensor.detach().contiguous()
    return out


def from_gpt2(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 tensors (as :func:`to_gpt2` wrote them) under the built-in GPT's names, head tied."""
    parts = {v: k for k, v in _BLOCK_NAMES.items()}
    tops = {v: k for k, v in _TOP_NAMES.items()}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        block = _HF_BLOCK.match(name)
        if block:
            index, part, kind = block.groups()
            ours = parts[part]
            state[f"blocks.{index}.{ours}.{kind}"] = (
                tensor.t() if ours in _TRANSPOSED and kind == "weight" else tensor
            )
            continue
        top, _, kind = name.rpartition(".")
        if name == "lm_head.weight":
            continue
        if top not in tops:
            raise ValueError(f"{name} is not a tensor of the built-in GPT's GPT-2 layout")
        state[f"{tops[top]}.{kind}"] = tensor
    if "wte.weight" in state:
        state["lm_head.weight"] = state["wte.weight"]
    elif "lm_head.weight" in tensors:
        state["wte.weight"] = state["lm_head.weight"] = tensors["lm_head.weight"]
    return state
