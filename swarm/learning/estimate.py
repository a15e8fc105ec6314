"""What one peer of a run needs: GPU memory, and bytes on the wire per sync (see docs/hosting.md).

The model is built on the ``meta`` device, so counting the parameters of a 1B-parameter model costs
no memory and about a second. Memory is the sum of

* weights and gradients: float32, ``4 P`` each; the gradients are alive from the first micro-batch's
  backward to the update (and freed after it), and adding a later micro-batch's gradient to them
  holds one more gradient of the largest tensor (``4 n`` plus its 16-bit copy under autocast);
* the 16-bit copies of the weights that autocast makes (``train.precision`` bf16 or fp16, ``auto``
  on CUDA) and keeps for the backward pass, ``2 P``; with activation checkpointing autocast runs
  without its weight cache (:meth:`~swarm.learning._precision.Precision.autocast`), so only the block
  being recomputed holds copies, plus the layers outside the blocks (the head), whose copies autograd
  saves: ``2`` times the largest block's and the head's parameters (:func:`autocast_copy_bytes`);
* inner AdamW state: on CUDA bitsandbytes' 8-bit AdamW, 2 bytes per element plus a float32 scale
  per 256-element block and state, for tensors of at least 4096 elements (smaller ones: ``8 n``),
  when bitsandbytes is installed (otherwise the trainer falls back to torch's AdamW); torch's
  AdamW ``8 P``;
* outer optimizer: float32 anchor, ``4 P``, and momentum, ``4 P`` (with ``averaging.outer_momentum``);
  the exchange's error-feedback residual ``4 P`` (lossy codecs); the sync path's buffers at their
  peak (:func:`sync_buffer_bytes`: a model exchange holds its offer as a bfloat16 progress, ``2 P``,
  shared by the two exchanges that may overlap, plus one tensor's temporaries); these can live in
  host memory instead (``averaging.outer_state_device``, :func:`outer_state_on_host`);
* the partners' frames of the exchanges in flight, as they arrived (wire bytes: about ``1.06 P`` an
  int8 exchange, two at once), always host memory;
* the shared bases a gossip trainer of model exchanges keeps (:mod:`swarm.gossip._bases`): at most
  two, each the frames of a model in ``compression.codec`` (about ``1.06 P`` in int8), host memory
  (:func:`base_bytes`);
* nothing for the state served to joiners (written to a spool file on disk, :mod:`swarm.state`) or for
  a checkpoint (written from the live tensors, one at a time);
* activations of one micro-batch of one sequence, bf16, per layer per token: ``17 h`` for attention
  and norms (flash attention: no ``s^2`` term) plus ``2 h + 4 i`` for a GELU MLP of width ``i`` or
  ``2 h + 8 i`` for a gated one; plus ``10 V`` per token for the logits (bf16, float32 copy, its
  gradient). With activation checkpointing only each block's float32 input (``4 h`` per token) is
  kept, and one block's activations are rebuilt at a time;
* the evaluation's peak, at the training micro-batch with no gradients alive: one block's
  activations, the 16-bit logits and a float32 slice of them :data:`VOCAB_CHUNK` wide (the loss is
  computed in chunks over the vocabulary). It replaces the training step's gradients and
  activations, so it counts only where it is larger;
* on the device besides the tensors: the caching allocator's slack (:data:`ALLOCATOR_SLACK` of what
  the tensors take) and the CUDA context with cuBLAS' workspace and the kernels of torch and
  bitsandbytes (:data:`DEVICE_CONTEXT`): :meth:`PeerEstimate.device_footprint`, what the card must hold;
* in host memory besides the state: the program itself (:data:`PROGRAM_BYTES`: Python, torch with its
  CUDA libraries where the device is CUDA, hivemind and its p2pd daemon), the page-locked batches the
  prefetcher draws ahead (:func:`pinned_bytes`, each rounded up to a power of two by torch's caching
  host allocator; the outer state is not page-locked), the shared bases, and a joiner's peak
  (:func:`joining_bytes`: the downloaded state beside the anchor) where that is more than the exchanges'
  frames.
It is an estimate: temporary buffers come on top.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import nn

from swarm.compression import HEADER_SIZE, get_codec
from swarm.config import RunConfig
from swarm.learning._optimizer import adamw8bit_works, bitsandbytes_installed, optimizer_state_bytes
from swarm.learning.evaluation import VOCAB_CHUNK
from swarm.learning.model import build_model, count_parameters

GIB = 1 << 30
MIB = 1 << 20

ALLOCATOR_SLACK = 0.05
"""Device memory the caching allocator reserves beyond what the tensors take (its fragmentation), as a
share of the tensors' peak."""
DEVICE_CONTEXT = 768 * MIB
"""The CUDA context, cuBLAS' workspace and the loaded kernels of torch and bitsandbytes: device memory
that no tensor accounts for."""
PROGRAM_BYTES = {"cpu": 512 * MIB, "cuda": 2560 * MIB}
"""Host memory of the program itself at its peak, before any state: the interpreter, torch (with its CUDA
libraries and the host side of the context on CUDA), hivemind and its p2pd daemon, the data pipeline
(tests/test_estimate.py holds the CPU figure against a measured peak)."""
PREFETCH_DEPTH = 2
"""Batches the prefetcher draws ahead (:class:`swarm.learning.Prefetcher`'s default depth)."""
BASES_KEPT = 2
"""Shared bases a gossip averager keeps at most (:data:`swarm.gossip._bases.MAX_BASES`; not imported:
the gossip package brings hivemind, which an estimate does not need; tests/test_estimate.py holds the
two equal)."""


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
    """Bytes one peer needs. ``wire_*`` are per exchange, in each direction (sent = received).

    ``outer_state`` (anchor and momentum), ``residuals`` (error feedback) and ``exchange_buffers``
    (what the sync path holds at its peak on the state's device, :func:`sync_buffer_bytes`) live next
    to the parameters, or in host memory when ``averaging.outer_state_device`` puts them there;
    ``exchange_frames`` (the partners' frames of the exchanges in flight) and ``bases`` (the shared bases,
    :func:`base_bytes`) are always host memory.
    """

    parameters: int
    device: str
    weights: int
    gradients: int
    inner_optimizer: int
    outer_state: int
    residuals: int
    exchange_buffers: int
    exchange_frames: int
    activations: int
    activations_checkpointed: int
    wire_delta: int
    """A whole model in ``compression.codec``: an exchange without a shared base, or the base itself."""
    wire_change: int = 0
    """An exchange through a shared base: each model's change, in ``compression.delta_codec``."""
    autocast_weights: int = 0
    autocast_weights_checkpointed: int = 0
    accumulation: int = 0
    evaluation: int = 0
    optimizer: str = "adamw"
    precision: str = "fp32"
    program: int = 0
    pinned: int = 0
    joining: int = 0
    joining_on_host: int = 0
    device_context: int = 0
    bases: int = 0

    @property
    def outer(self) -> int:
        """Everything the averaging keeps beside the model: state, residuals, exchange buffers."""
        return self.outer_state + self.residuals + self.exchange_buffers

    def device_memory(self, checkpointing: bool, *, host_state: bool = False) -> int:
        """Bytes on the training device, with the outer state there or (``host_state``) in host memory."""
        autocast = self.autocast_weights_checkpointed if checkpointing else self.autocast_weights
        model = self.weights + self.inner_optimizer + autocast
        activations = self.activations_checkpointed if checkpointing else self.activations
        step = self.gradients + self.accumulation + activations
        return model + max(step, self.evaluation) + (0 if host_state else self.outer)

    def device_footprint(self, checkpointing: bool, *, host_state: bool = False) -> int:
        """What the card must hold: :meth:`device_memory` with the allocator's slack, plus the context."""
        return int(self.device_memory(checkpointing, host_state=host_state) * (1 + ALLOCATOR_SLACK)) + (
            self.device_context
        )

    def host_memory(self, *, host_state: bool = False) -> int:
        """Bytes in host memory: the program, the page-locked batches, the shared bases, and the larger
        of the partners' frames of the exchanges in flight (with the outer state, where it lives there)
        and a joiner's peak (the downloaded state, beside the anchor where it lives there)."""
        steady = self.exchange_frames + (self.outer if host_state else 0)
        joining = self.joining + (self.joining_on_host if host_state else 0)
        return self.program + self.pinned + self.bases + max(steady, joining)

    def memory(self, checkpointing: bool) -> int:
        """Total bytes with or without activation checkpointing, on a machine whose device is its host
        (a CPU peer): everything."""
        return self.device_memory(checkpointing) + self.host_memory()

    @property
    def wire_per_sync(self) -> float:
        """What a peer sends per round (a round is one exchange, whether the peer started it or was
        dialled): each model's change from the pair's shared base in ``compression.delta_codec`` after
        the round, and the base itself (the model in ``compression.codec``) while it trains, pushed
        by one of the pair: about every other round for each peer."""
        return self.wire_change + self.wire_delta / 2


TEMPORARY_COPIES = 8
"""Float32 copies of the largest tensor that a whole-model operation holds at once while it works on
one tensor (ours, what our frames decode to, the partner's, the mix, the gradient, the move...)."""


def sync_buffer_bytes(params: int, largest: int) -> int:
    """Peak bytes, beyond the steady state, of a gossip trainer's sync path on the state's device
    (the partners' frames, host memory, are :func:`frame_bytes`).

    An exchange offers our parameters as the anchor plus their progress in bfloat16 (``2 P``),
    computed per tensor when read; an exchange that overlaps it (our own beside a served one) offers
    the same snapshot, and one that serves a joiner reads the live anchor; the update is applied
    tensor by tensor. So: ``2 P`` plus one tensor's temporaries."""
    return 2 * params + TEMPORARY_COPIES * 4 * largest


def frame_bytes(wire_delta: int) -> int:
    """Host bytes of the partners' frames that the exchanges in flight keep (our own are re-encoded
    when needed): two exchanges at once (our own beside a served one), each at most the wire size of
    a whole model in one direction. A joiner's anchor exchange with us keeps none of its frames."""
    return 2 * wire_delta


def pinned_bytes(batch_size: int, block_size: int, cuda: bool) -> int:
    """Page-locked host bytes of the prefetcher on CUDA: inputs and targets (int64) of the batches it
    holds (:data:`PREFETCH_DEPTH` queued, one being copied, one handed out), each block rounded up to a
    power of two as torch's caching host allocator does."""
    if not cuda:
        return 0
    one = 8 * batch_size * block_size
    return 2 * (PREFETCH_DEPTH + 2) * (1 << max(one - 1, 1).bit_length())


def base_bytes(config: RunConfig, wire_whole: int) -> int:
    """Host bytes of the shared bases (:mod:`swarm.gossip._bases`): a gossip trainer keeps at most
    :data:`BASES_KEPT`, each the frames of a whole model in ``compression.codec`` (``wire_whole``, the
    wire size of one). Other backends keep none."""
    return BASES_KEPT * wire_whole if config.averaging.backend == "gossip" else 0


def joining_bytes(params: int, momentum: bool) -> tuple[int, int]:
    """A joiner's host peak while it takes over a donor's state (:func:`swarm.trainer._joining.adopt`):
    the download (float32 parameters and momentum, host memory); with the outer state in host memory
    the anchor is there beside it (rebuilt in place). Returns (always, with the state on the host)."""
    return (8 if momentum else 4) * params, 4 * params


def model_shape(config: RunConfig, model: nn.Module) -> Shape:
    """Layers and widths of the configured model (from the transformers config for kind 'hf')."""
    m = config.model
    if m.kind == "gpt":
        return Shape(m.n_layer, m.n_embd, 4 * m.n_embd, m.vocab_size, m.block_size, gated_mlp=False)
    hf = model.inner.config
    hidden = hf.hidden_size
    gated = getattr(hf, "hidden_act", "") == "silu" or hasattr(hf, "mlp_bias")
    context = getattr(hf, "max_position_embeddings", 0) or getattr(hf, "n_positions", m.block_size)
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


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the children of the model's largest :class:`~torch.nn.ModuleList`."""
    lists: list[nn.ModuleList] = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        return []
    sizes = [sum(p.numel() for p in m.parameters()) for m in lists]
    return list(lists[sizes.index(max(sizes))])


def autocast_copy_bytes(model: nn.Module, half: int) -> tuple[int, int]:
    """The 16-bit copies of the weights that autocast holds at once (``half`` bytes per element, 0:
    no autocast), without and with activation checkpointing.

    Without it the copy of every weight lives until the backward pass used it: ``half * P``. With it
    (and the weight cache off) a checkpointed block saves nothing, so its copies go with each op in
    the forward pass and its recomputation in the backward pass holds that block's copies; the
    linear layers outside the blocks (the head) keep theirs for the backward pass as before."""
    blocks = _blocks(model)
    total = half * count_parameters(model)
    if not blocks:  # nothing checkpointed block by block: every copy is held, as without checkpointing
        return total, total
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    largest = max(sum(p.numel() for p in block.parameters()) for block in blocks)
    outside = {
        id(p): p.numel()
        for module in model.modules()
        if isinstance(module, nn.Linear)
        for p in module.parameters()
        if id(p) not in in_blocks
    }
    return total, half * (largest + sum(outside.values()))


def adamw_state_bytes(model: nn.Module, cuda: bool) -> int:
    """Inner AdamW state: 8-bit blockwise on CUDA (as bitsandbytes stores it), float32 on the CPU."""
    return optimizer_state_bytes(model, eight_bit=cuda)


def evaluation_bytes(shape: Shape, half: int, micro_batch: int = 1) -> int:
    """Peak of an evaluation at ``micro_batch`` beyond the weights: one block's activations, the logits
    (``half`` bytes per element, 4 without autocast) and a float32 slice of them per vocabulary chunk."""
    tokens = micro_batch * shape.block_size
    mlp = 2 * shape.hidden + (8 if shape.gated_mlp else 4) * shape.intermediate
    block = tokens * (17 * shape.hidden + mlp)
    logits = tokens * ((half or 4) * shape.vocab + 4 * min(shape.vocab, VOCAB_CHUNK))
    return block + logits


def wire_bytes(model: nn.Module, codec_name: str, block_size: int) -> int:
    """Bytes of one direction of an exchange: one frame (header + codec payload) per tensor."""
    codec = get_codec(codec_name, block_size, backend="torch")
    return sum(HEADER_SIZE + codec.payload_nbytes(p.numel()) for p in model.parameters())


def estimate_peer(config: RunConfig, device: str = "cuda", *, eight_bit: bool | None = None) -> PeerEstimate:
    """Memory and traffic of one peer of ``config`` on ``device`` ('cuda' or 'cpu').

    ``eight_bit``: whether the inner optimizer is bitsandbytes' 8-bit AdamW; by default on CUDA when
    bitsandbytes is installed (the trainer also checks that it runs). ``train.precision: auto`` is
    counted as 16-bit autocast on CUDA and float32 on the CPU."""
    if eight_bit is None:
        eight_bit = device == "cuda" and bitsandbytes_installed()
    precision = config.train.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    half = 0 if precision == "fp32" else 2
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' renamed checkpointing methods
        model = build_model(config.model, config.run.seed)
    params = count_parameters(model)
    shape = model_shape(config, model)
    activations, checkpointed = activation_bytes(shape)
    largest = max(p.numel() for p in model.parameters())
    autocast, autocast_checkpointed = autocast_copy_bytes(model, half)
    comp, avg = config.compression, config.averaging
    residuals = 4 * params if comp.codec != "fp32" and comp.error_feedback else 0  # anchors keep none
    wire_delta = wire_bytes(model, comp.codec, comp.block_size)
    return PeerEstimate(
        parameters=params,
        device=device,
        weights=4 * params,
        gradients=4 * params,
        inner_optimizer=optimizer_state_bytes(model, eight_bit),
        outer_state=(8 if avg.outer_momentum else 4) * params,
        residuals=residuals,
        exchange_buffers=sync_buffer_bytes(params, largest),
        exchange_frames=frame_bytes(wire_delta),
        activations=activations,
        activations_checkpointed=checkpointed,
        wire_delta=wire_delta,
        wire_change=wire_bytes(model, comp.delta_codec, comp.block_size),
        autocast_weights=autocast,
        autocast_weights_checkpointed=autocast_checkpointed,
        accumulation=(4 + half) * largest if config.train.batch_size > 1 else 0,
        evaluation=evaluation_bytes(shape, half),
        optimizer="8-bit AdamW" if eight_bit else "AdamW",
        precision=precision,
        program=PROGRAM_BYTES["cuda" if device == "cuda" else "cpu"],
        pinned=pinned_bytes(config.train.batch_size, config.model.block_size, device == "cuda"),
        joining=joining_bytes(params, bool(avg.outer_momentum))[0],
        joining_on_host=joining_bytes(params, bool(avg.outer_momentum))[1],
        device_context=DEVICE_CONTEXT if device == "cuda" else 0,
        bases=base_bytes(config, wire_delta),
    )


def outer_state_on_host(config: RunConfig, device: torch.device, *, available: int | None = None) -> bool:
    """Whether the outer state goes to host memory: ``averaging.outer_state_device`` ``host``, or
    ``auto`` on a CUDA device where the device layout would take more than 90% of the memory available
    to this process: what is free now plus what its allocator already holds (``available`` replaces
    that in tests). Not the card's total, which a card that drives displays, or that another process
    shares, does not give us."""
    choice = config.averaging.outer_state_device
    if device.type != "cuda" or choice == "device":
        return False
    if choice == "host":
        return True
    if available is None:
        available = available_device_bytes(device)
    estimate = estimate_peer(config, "cuda", eight_bit=adamw8bit_works(device))  # the trainer's choice
    need = estimate.device_memory(config.train.activation_checkpointing) * (1 + ALLOCATOR_SLACK)
    return need > 0.9 * available


def available_device_bytes(device: torch.device) -> int:
    """Device memory this process may still use: free on the card, plus what torch's allocator holds."""
    free = int(torch.cuda.mem_get_info(device)[0])
    return free + int(torch.cuda.memory_reserved(device))


def exchange_reserve_bytes(config: RunConfig, device: torch.device) -> int:
    """Device memory a micro-batch must leave free for the exchanges to come: their peak buffers when
    the outer state lives on this CUDA device (:func:`outer_state_on_host`), else nothing."""
    if device.type != "cuda" or outer_state_on_host(config, device):
        return 0
    return estimate_peer(config, "cuda", eight_bit=adamw8bit_works(device)).exchange_buffers


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, e.g. ``"1.50 MiB"``."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
