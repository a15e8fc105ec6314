"""The sections about how peers exchange: averaging, compression, pipeline stages (docs/configuration.md)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from swarm.config._section import Section, cross_field, per_peer_field

_EXCHANGE_TIMEOUT = (
    "Shortest deadline of one exchange, and how long a sync looks for a partner that accepts; an "
    "exchange's deadline grows with its size over the rate measured to that partner, up to "
    "max_exchange_timeout_s (per peer)."
)
_CHUNK_TIMEOUT = (
    "Give up on dialling, on a handshake, or on a transfer in which nothing moved for this long: a "
    "stalled partner is dropped this fast, whatever the exchange's size (per peer)."
)


class AveragingSection(Section):
    """Gossip averaging: outer optimizer and exchange policy."""

    backend: Literal["gossip", "allreduce", "hivemind", "none"] = Field(
        "gossip",
        description="'gossip': quantized pairwise averaging; 'allreduce': group all-reduce of "
        "pseudo-gradients (OpenDiLoCo, baseline); 'hivemind': hivemind.Optimizer (baseline); "
        "'none': every peer trains alone.",
    )
    sync_every_steps: int = Field(20, ge=1, description="Inner steps between syncs (H of DiLoCo).")
    sync_every_seconds: Annotated[float, Field(gt=0)] | None = Field(
        None, description="Also sync when this many seconds passed since the last one."
    )
    max_lag_rounds: int = per_peer_field(
        1,
        ge=0,
        le=16,
        description=(
            "gossip: our exchange runs in the background while the next round trains; the device "
            "waits only when it lags this many rounds behind (0 = a blocking sync)."
        ),
    )
    outer_state_device: Literal["auto", "device", "host"] = per_peer_field(
        "auto",
        description=(
            "Where the outer anchor, momentum, error-feedback residuals and exchange buffers live: next "
            "to the parameters, or in (pinned) host memory; auto picks host memory on a GPU the other "
            "layout would not fit."
        ),
    )
    outer_lr: float = Field(
        0.7,
        gt=0,
        description="Learning rate of the outer SGD, which steps the anchor toward the pair's mean.",
    )
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Momentum of the outer SGD.")
    nesterov: bool = Field(True, description="Use Nesterov momentum in the outer SGD.")
    exchange_timeout_s: float = per_peer_field(30.0, gt=0, description=_EXCHANGE_TIMEOUT)
    max_exchange_timeout_s: float = per_peer_field(
        600.0,
        gt=0,
        description="Longest deadline of one exchange, however slow the link; never below "
        "exchange_timeout_s (per peer).",
    )
    chunk_timeout_s: float = per_peer_field(10.0, gt=0, description=_CHUNK_TIMEOUT)
    max_norm_ratio: float = Field(
        100.0, gt=1, description="Reject a partner's update whose norm exceeds ours by this factor."
    )
    robust_clip: bool = Field(
        True,
        description="Clip a partner's model difference to param_clip_ratio times the smaller "
        "parameter norm of the pair (and to a few rounds' progress), and judge the partner by it "
        "(docs/gossip.md, 'Malicious partners').",
    )
    clip_ratio: float = Field(
        2.0,
        gt=0,
        description="How far an honest partner's model may plausibly be from ours, in multiples of our "
        "progress since the anchor: the radius a partner is judged against.",
    )
    param_clip_ratio: float = Field(
        0.1,
        gt=0,
        description="Clip radius of an exchange (models, or a joiner's anchors), relative to the "
        "smaller parameter norm of the pair.",
    )
    clip_hard_factor: float = Field(
        10.0,
        ge=1,
        description="A difference over this many clip radii (from our own norm) counts against the partner.",
    )
    clip_strikes: int = Field(
        2, ge=1, description="Hard clips that ban a partner (with backoff); ordinary exchanges wear them off."
    )
    ban_base_s: float = per_peer_field(
        10.0, gt=0, description="First ban of a misbehaving partner, in seconds (per peer)."
    )
    ban_max_s: float = per_peer_field(
        600.0, gt=0, validate_default=True, description="Longest ban; bans double up to it (per peer)."
    )
    param_codec: Literal["fp32", "fp16", "bf16", "int8"] = Field(
        "fp32",
        description="Codec of the anchor exchange a joiner takes a partner's state over with. 4-bit "
        "anchors are refused: NF4 noise on raw weights stalled training (docs/benchmarks.md).",
    )

    partners: Literal["hypercube", "random"] = Field(
        "hypercube",
        description="Whom a gossip round dials. 'hypercube': dimension exchange over the live trainers "
        "in a shared hash order (round r: position i meets i XOR 2^(r mod log2 N)), a random live "
        "partner when the scheduled one is missing or busy; 'random': a random live partner.",
    )

    @field_validator("ban_max_s")
    @classmethod
    def _max_ban_not_below_base(cls, value: float, info: ValidationInfo) -> float:
        base = info.data.get("ban_base_s")
        if base is not None and value < base:
            raise cross_field("ban_base_s", "must be >= ban_base_s = {ban_base_s}", ban_base_s=base)
        return value


class CompressionSection(Section):
    """How updates are encoded on the wire."""

    codec: Literal["fp32", "fp16", "bf16", "int8", "int4"] = Field(
        "int8",
        description="Codec of whole tensors on the wire: a model exchange without a shared base, and "
        "the base itself; int8/int4 are blockwise quantized.",
    )
    delta_codec: Literal["fp32", "fp16", "bf16", "int8", "int4"] = Field(
        "int4",
        description="Codec of what waits at a round's end: a model exchange between two peers that share "
        "a base (the pushing member sent its anchor in `codec` while the round trained) sends each "
        "model relative to it, with error feedback (docs/gossip.md, 'Nothing waits on the full model').",
    )
    block_size: int = Field(
        64, ge=16, le=4096, description="Elements per quantization block (a power of two)."
    )
    chunk_bytes: int = Field(1 << 20, ge=4096, le=64 << 20, description="Bytes per streamed chunk.")
    error_feedback: bool = Field(True, description="Carry quantization error over to the next sync.")
    max_tensor_elements: int = Field(
        1 << 30, ge=1, description="Largest tensor a decoder accepts, in elements."
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value


class PipelineSection(Section):
    """Pipeline stages across peers, for models larger than one peer's device (docs/pipeline.md)."""

    num_stages: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        1,
        description="Contiguous stages the model is cut into, one per peer (1 = no pipeline); 'auto': the "
        "fewest whose largest stage fits memory_budget_gb.",
    )
    memory_budget_gb: Annotated[float, Field(gt=0, le=1e6)] | None = Field(
        None,
        validate_default=True,
        description="Device memory for one stage, in GiB, that num_stages 'auto' sizes the cut for (so "
        "shared); `swarm config check` also says whether each stage fits it.",
    )
    microbatch_size: int = Field(
        4, ge=1, le=4096, description="Samples per micro-batch sent through the stages."
    )
    activation_codec: Literal["fp32", "fp16", "bf16", "int8", "int4"] = Field(
        "int8",
        description="Codec of activations and their gradients between stages (blockwise int8: 8 bits).",
    )
    max_inflight: int = per_peer_field(
        4, ge=1, le=256, description="Micro-batches a data holder (stage 0) keeps in the pipeline at once."
    )
    request_timeout_s: float = per_peer_field(
        30.0,
        gt=0,
        le=3600,
        description="Give up on a stage peer's answer after this long and retry elsewhere.",
    )
    routing: Literal["stochastic", "fixed"] = per_peer_field(
        "stochastic",
        description="'stochastic': each micro-batch goes to a random peer per stage, weighted by measured "
        "throughput and queue; 'fixed': always the same peer per stage (benchmark baseline).",
    )
    max_queue: int = per_peer_field(
        64, ge=1, le=4096, description="Requests a stage server queues before answering busy."
    )
    rebalance_every_s: Annotated[float, Field(gt=0)] | None = per_peer_field(
        30.0,
        description="Check every this many seconds whether to move to an under-served stage; null: never.",
    )
    rebalance_min_interval_s: float = per_peer_field(
        300.0, ge=0, description="A peer moves to another stage at most once per this many seconds."
    )

    @field_validator("memory_budget_gb")
    @classmethod
    def _auto_needs_a_budget(cls, value: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("num_stages") == "auto" and value is None:
            raise cross_field("num_stages", "must be set when num_stages is 'auto'")
        return value
