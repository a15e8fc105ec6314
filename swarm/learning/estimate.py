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
* outer optimizer: float32 anchor and momentum, ``4 P`` each; the pseudo-gradient exchange's
  error-feedback residual ``4 P`` (lossy codecs); the sync path's buffers at their peak, an exchange
  plus what the training thread holds meanwhile (:func:`gossip_peak_buffer_bytes`: ``28 P`` with
  int8 and error feedback);
  these can live in host memory instead (``averaging.outer_state_device``, :func:`outer_state_on_host`);
* the state served to joiners: a CPU float32 copy of anchor and momentum, ``8 P``, always host memory;
* activations of one micro-batch of one sequence, bf16, per layer per token: ``17 h`` for attention
  and norms (flash attention: no ``s^2`` term) plus ``2 h + 4 i`` for a GELU MLP of width ``i`` or
  ``2 h + 8 i`` for a gated one; plus ``10 V`` per token for the logits (bf16, float32 copy, its
  gradient). With activation checkpointing only each block's float32 input (``4 h`` per token) is
  kept, and one block's activations are rebuilt at a time;
* the evaluation's peak, at the training micro-batch with no gradients alive: one block's
  activations, the 16-bit logits and a float32 slice of them :data:`VOCAB_CHUNK` wide (the loss is
  computed in chunks over the vocabulary). It replaces the training step's gradients and
  activations, so it counts only where it is larger;
* the checkpoint's copy of anchor and momentum, ``8 P`` of host memory while one is written.

It is an estimate: allocator slack, the CUDA context (~0.5 GiB) and temporary buffers come on top.
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

    ``outer_state`` (anchor and momentum), ``residuals`` (error feedback of pseudo-gradients) and
    ``exchange_buffers`` (what an exchange holds at its peak, see :func:`exchange_buffer_bytes`) live
    next to the parameters, or in host memory when ``averaging.outer_state_device`` puts them there.
    """

    parameters: int
    device: str
    weights: int
    gradients: int
    inner_optimizer: int
    outer_state: int
    residuals: int
    exchange_buffers: int
    served_state: int
    activations: int
    activations_checkpointed: int
    wire_delta: int
    wire_params: int
    param_sync_every: int
    anchor_pull: str = "separate"
    autocast_weights: int = 0
    autocast_weights_checkpointed: int = 0
    accumulation: int = 0
    evaluation: int = 0
    checkpoint_copy: int = 0
    optimizer: str = "adamw"
    precision: str = "fp32"

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

    def host_memory(self, *, host_state: bool = False) -> int:
        """Bytes in host memory besides the program itself: the state served to joiners, the copy a
        checkpoint makes, and the outer state when it lives there."""
        return self.served_state + self.checkpoint_copy + (self.outer if host_state else 0)

    def memory(self, checkpointing: bool) -> int:
        """Total bytes with or without activation checkpointing, on a machine whose device is its host
        (a CPU peer): everything."""
        return self.device_memory(checkpointing) + self.host_memory()

    @property
    def wire_per_sync(self) -> float:
        """What a peer sends per round: one pseudo-gradient exchange (a round is one exchange, whether
        the peer started it or was dialled), plus the anchor exchange amortised over its period (a peer
        starts one every ``param_sync_every`` of its own rounds, about every other round is its own, and
        it is dialled for about as many as it starts). With a folded anchor pull every exchange carries
        the anchor: both, every round, and no exchange of its own for the anchors. A model exchange
        (``anchor_pull`` "model", ``averaging.exchange: model``) sends the model in the pseudo-gradient's
        codec, and nothing else."""
        if self.anchor_pull == "model":
            return self.wire_delta
        if self.anchor_pull == "folded":
            return self.wire_delta + self.wire_params
        return self.wire_delta + self.wire_params / self.param_sync_every


def exchange_buffer_bytes(params: int, lossy: bool, error_feedback: bool = False) -> int:
    """Peak bytes of one exchange of a gossip trainer: whole float32 copies of the model alive at
    mixing time (``swarm.trainer._offers``, ``swarm.gossip._exchange``):

    * the snapshot we offer (``anchor - params`` per sample, or a copy of the anchor);
    * what our own frames decode to (lossy codecs; lossless ones send the snapshot itself);
    * with error feedback, the new residual, pending until the exchange commits (the committed one
      is counted apart, in :attr:`PeerEstimate.residuals`);
    * what the partner sent, decoded;
    * the mixed result (the robust clip's or the plain mix's, one new copy either way).

    Codec payloads, frames and float64 temporaries are per tensor, not per model.
    """
    copies = 3 + int(lossy) + int(lossy and error_feedback)
    return copies * 4 * params


def gossip_peak_buffer_bytes(
    params: int, delta_lossy: bool, error_feedback: bool, anchor_lossy: bool, folded: bool = False
) -> int:
    """Peak bytes, beyond the steady state, of a gossip trainer's sync path.

    With a folded anchor pull (``averaging.anchor_pull: folded``) one exchange holds both parts' buffers
    at once, while the training thread publishes the state served to joiners (``8 P``); no separate
    anchor exchange runs. Otherwise, the larger of

    * a pseudo-gradient exchange (:func:`exchange_buffer_bytes`) while the training thread publishes
      the state served to joiners (a new float32 copy of anchor and momentum, ``8 P``, is made before
      the old one goes) or an anchor exchange's update waits (its shift, ``4 P``);
    * an anchor exchange (no error feedback, no clip) while the training thread applies the
      pseudo-gradient update that committed just before it: the pair's gradient, our consumed
      snapshot and the outer step's move, ``12 P``.

    The two averagers share one exchange lock, so no two exchanges overlap; a peer does not offer a
    new pseudo-gradient while one is queued, nor a new anchor while an anchor shift is queued.
    """
    delta = exchange_buffer_bytes(params, delta_lossy, error_feedback) + 8 * params
    if folded:
        return delta + exchange_buffer_bytes(params, anchor_lossy)
    anchor = exchange_buffer_bytes(params, anchor_lossy) + 12 * params
    return max(delta, anchor)


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
    delta_lossy, anchor_lossy = comp.codec != "fp32", avg.param_codec != "fp32"
    folded = avg.anchor_pull == "folded"
    residuals = 4 * params if delta_lossy and comp.error_feedback else 0  # anchor exchanges keep none
    return PeerEstimate(
        parameters=params,
        device=device,
        weights=4 * params,
        gradients=4 * params,
        inner_optimizer=optimizer_state_bytes(model, eight_bit),
        outer_state=8 * params,
        residuals=residuals,
        exchange_buffers=gossip_peak_buffer_bytes(
            params, delta_lossy, delta_lossy and comp.error_feedback, anchor_lossy, folded
        ),
        served_state=8 * params,  # a CPU float32 copy of anchor and momentum, for joiners
        activations=activations,
        activations_checkpointed=checkpointed,
        wire_delta=wire_bytes(model, comp.codec, comp.block_size),
        wire_params=wire_bytes(model, avg.param_codec, comp.block_size),
        param_sync_every=avg.param_sync_every,
        anchor_pull="model" if avg.exchange == "model" else avg.anchor_pull,
        autocast_weights=autocast,
        autocast_weights_checkpointed=autocast_checkpointed,
        accumulation=(4 + half) * largest if config.train.batch_size > 1 else 0,
        evaluation=evaluation_bytes(shape, half),
        checkpoint_copy=8 * params,  # OuterOptimizer.state_dict: CPU copies of anchor and momentum
        optimizer="8-bit AdamW" if eight_bit else "AdamW",
        precision=precision,
    )


def outer_state_on_host(config: RunConfig, device: torch.device) -> bool:
    """Whether the outer state goes to host memory: ``averaging.outer_state_device`` ``host``, or
    ``auto`` on a CUDA device whose memory the device layout would not fit (90% of it)."""
    choice = config.averaging.outer_state_device
    if device.type != "cuda" or choice == "device":
        return False
    if choice == "host":
        return True
    total = torch.cuda.get_device_properties(device).total_memory
    estimate = estimate_peer(config, "cuda", eight_bit=adamw8bit_works(device))  # the trainer's choice
    need = estimate.device_memory(config.train.activation_checkpointing)
    return need > 0.9 * total


def exchange_reserve_bytes(config: RunConfig, device: torch.device) -> int:
    """Device memory a micro-batch must leave free for the exchanges to come: their peak buffers when
    the outer state lives on this CUDA device (:func:`outer_state_on_host`), else nothing."""
    if device.type != "cuda" or outer_state_on_host(config, device):
        return 0
    return estimate_peer(config, "cuda", eight_bit=adamw8bit_works(device)).exchange_buffers


def describe_estimate(estimate: PeerEstimate, checkpointing: bool = False) -> list[str]:
    """Lines for ``swarm config check``: both layouts, the breakdown, and the wire per round."""
    e, b = estimate, format_bytes
    on_device = (e.device_memory(False), e.device_memory(True))
    split = (e.device_memory(False, host_state=True), e.device_memory(True, host_state=True))
    used = " (this config)" if checkpointing else ""
    return [
        f"parameters: {e.parameters:,}",
        f"memory per peer on {e.device} (micro-batch 1), outer state on the device: {b(on_device[0])}, "
        f"{b(on_device[1])} with activation checkpointing{used}",
        f"  with the outer state in host memory: {b(split[0])} on the device, {b(split[1])} with "
        f"activation checkpointing, plus {b(e.host_memory(host_state=True))} of host memory",
        f"  model: weights {b(e.weights)} + {e.precision} autocast copies {b(e.autocast_weights)}"
        f" ({b(e.autocast_weights_checkpointed)} checkpointed)"
        f" + {e.optimizer} {b(e.inner_optimizer)} + gradients {b(e.gradients)}"
        f" + accumulation {b(e.accumulation)} + activations {b(e.activations)}"
        f" ({b(e.activations_checkpointed)} checkpointed); evaluation peak {b(e.evaluation)}"
        f" in place of gradients and activations",
        f"  outer state: anchor and momentum {b(e.outer_state)} + error feedback {b(e.residuals)}"
        f" + exchange buffers {b(e.exchange_buffers)}; host memory for the state served to joiners "
        f"{b(e.served_state)} + a checkpoint's copy {b(e.checkpoint_copy)}",
        f"wire per sync per peer, each direction: {b(e.wire_per_sync)} ({_exchange_wire(e)})",
    ]


def _exchange_wire(e: PeerEstimate) -> str:
    per_round = f"{format_bytes(e.wire_delta)} per round, initiated or served"
    if e.anchor_pull == "model":
        return f"the model {per_round}, which carries the anchors' gap too"
    if e.anchor_pull == "folded":
        return f"pseudo-gradient {per_round}; anchors {format_bytes(e.wire_params)} in the same exchange"
    every = f"anchors {format_bytes(e.wire_params)} every {e.param_sync_every} own rounds"
    return f"pseudo-gradient {per_round}; {every}"


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, e.g. ``"1.50 MiB"``."""
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
