"""The typed run config: one pydantic model per section, all strict about unknown keys.

Checks that relate two keys of a section are field validators reading the already-validated earlier
field (``info.data``) rather than model validators, so that the error points at a dotted key
(``network.record_ttl_s``) instead of at the whole section. They raise a ``cross_field`` error whose
context names the other key, which lets the loader say where that key's value came from as well.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from swarm.config._view import config_hash, swarm_view

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def _cross_field(other: str, message: str, **context: Any) -> PydanticCustomError:
    return PydanticCustomError("cross_field", message, {"other": other, **context})


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


class RunSection(_Section):
    """Identity of the run; every peer of one swarm uses the same values."""

    run_id: str = Field(
        "swarm-local",
        pattern=RUN_ID_PATTERN,
        description="Name of the run; peers of one run find each other under this key in the DHT.",
    )
    seed: int = Field(0, ge=0, description="Seed for model initialisation and data order.")
    target_samples: Annotated[int, Field(gt=0)] | None = Field(
        None, description="Samples the whole swarm aims to process; the monitor shows progress and ETA."
    )


class NetworkSection(_Section):
    """How this peer joins the swarm (per peer: never part of the config hash)."""

    initial_peers: list[str] = Field(
        default_factory=list,
        description="Multiaddrs of peers already in the swarm (with /p2p/<id>); empty starts a new swarm.",
    )
    host_maddrs: list[str] = Field(
        default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"],
        description="Multiaddrs to listen on; use /ip4/0.0.0.0/tcp/<port> to accept peers from outside.",
    )
    announce_maddrs: list[str] = Field(
        default_factory=list,
        description="Public multiaddrs to advertise when they differ from the listening ones (NAT, proxy).",
    )
    identity_path: str | None = Field(
        None, description="File holding this peer's private key, so it keeps its peer id across restarts."
    )
    client_mode: bool = Field(
        False, description="Do not accept incoming connections (for peers behind NAT without relays)."
    )
    swarm_key_file: str | None = Field(
        None,
        description="File (mode 0600) holding the secret key of a private swarm; or set SWARM_KEY. "
        "See docs/security.md.",
    )
    record_interval_s: float = Field(
        3.0, gt=0, le=300, description="Seconds between refreshes of this peer's membership record."
    )
    record_ttl_s: float = Field(
        10.0,
        gt=0,
        validate_default=True,
        description="Lifetime of a membership record; at least 2 * record_interval_s.",
    )
    startup_timeout_s: float = Field(30.0, gt=0, description="Seconds to wait for the DHT to start.")
    reachability_check: bool = Field(
        True,
        description="After joining, ask other peers to dial this one back; if none can, run in client mode.",
    )

    @field_validator("record_ttl_s")
    @classmethod
    def _ttl_outlives_a_missed_refresh(cls, value: float, info: ValidationInfo) -> float:
        interval = info.data.get("record_interval_s")
        if interval is not None and value < 2 * interval:
            raise _cross_field(
                "record_interval_s",
                "must be >= 2 * record_interval_s = {minimum} so a record survives one late refresh",
                minimum=2 * interval,
            )
        return value


class ModelSection(_Section):
    """The model every peer trains."""

    kind: Literal["gpt", "hf"] = Field(
        "gpt", description="'gpt': the built-in small GPT; 'hf': a transformers model built from hf_config."
    )
    n_layer: int = Field(2, ge=1, le=256, description="Transformer blocks.")
    n_head: int = Field(2, ge=1, le=256, description="Attention heads per block.")
    n_embd: int = Field(
        64, ge=8, le=16384, validate_default=True, description="Embedding width; divisible by n_head."
    )
    block_size: int = Field(64, ge=8, le=131072, description="Context length in tokens.")
    vocab_size: int = Field(256, ge=2, le=1 << 20, description="Vocabulary size (256 for byte-level data).")
    dropout: float = Field(0.0, ge=0, le=1, description="Dropout probability.")
    hf_config: dict[str, Any] | None = Field(
        None, description="For kind 'hf': keyword arguments of the transformers config (no weights download)."
    )

    @field_validator("n_embd")
    @classmethod
    def _embd_splits_into_heads(cls, value: int, info: ValidationInfo) -> int:
        heads = info.data.get("n_head")
        if heads is not None and value % heads:
            raise _cross_field("n_head", "must be divisible by n_head = {n_head}", n_head=heads)
        return value


class DataSection(_Section):
    """Where training text comes from."""

    source: Literal["stdlib", "files", "hf"] = Field(
        "stdlib",
        description="'stdlib': the Python standard library's source (no download); "
        "'files': local text files in paths; 'hf': a streamed datasets dataset.",
    )
    paths: list[str] = Field(
        default_factory=list,
        validate_default=True,
        description="For source 'files': files or directories of text (per peer).",
    )
    hf_dataset: str | None = Field(
        None,
        validate_default=True,
        description="For source 'hf': the dataset name, e.g. 'roneneldan/TinyStories'.",
    )
    eval_fraction: float = Field(0.01, gt=0, lt=0.5, description="Share of the data held out for evaluation.")

    @field_validator("paths")
    @classmethod
    def _files_need_paths(cls, value: list[str], info: ValidationInfo) -> list[str]:
        if info.data.get("source") == "files" and not value:
            raise _cross_field("source", "must name at least one file or directory when source is 'files'")
        return value

    @field_validator("hf_dataset")
    @classmethod
    def _hf_needs_dataset(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("source") == "hf" and not value:
            raise _cross_field("source", "must name a dataset when source is 'hf'")
        return value


class TrainSection(_Section):
    """Inner (local) training loop."""

    device: str = Field(
        "auto", description="'auto' (CUDA when present, else CPU), 'cpu', 'cuda', 'cuda:1', ..."
    )
    batch_size: int = Field(16, ge=1, description="Samples per inner optimizer step.")
    micro_batch_size: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Samples per forward pass (gradient accumulation); None picks one that fits memory."
    )
    lr: float = Field(3e-4, gt=0, description="Peak learning rate of the inner AdamW.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear learning-rate warm-up, in inner steps.")
    max_steps: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Stop after this many inner steps."
    )
    grad_clip: float = Field(1.0, gt=0, description="Clip the gradient norm to this value.")
    slowdown: float = Field(
        1.0, ge=1, description="Artificial slowdown factor (tests simulate slow peers with it)."
    )
    step_time_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description=(
            "Emulated accelerator: pad each inner step to at least this many seconds by sleeping, the "
            "way a process waits on its GPU (benchmarks on one machine; 0 = off)."
        ),
    )
    checkpoint_dir: str | None = Field(
        None, description="Directory for local checkpoints; None disables them."
    )
    checkpoint_every_s: float = Field(300.0, gt=0, description="Seconds between local checkpoints.")
    activation_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass to save GPU memory (CUDA only)."
    )
    eval_every_rounds: int = Field(1, ge=1, description="Evaluate held-out loss every this many syncs.")
    eval_batches: int = Field(
        4, ge=1, le=1000, description="Held-out batches (of 32 windows) per evaluation."
    )


class AveragingSection(_Section):
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
    max_lag_rounds: int = Field(
        1,
        ge=0,
        le=16,
        description=(
            "gossip: our exchange runs in the background while the next round trains; the device "
            "waits only when it lags this many rounds behind (0 = a blocking sync)."
        ),
    )
    outer_state_device: Literal["auto", "device", "host"] = Field(
        "auto",
        description=(
            "Where the outer anchor, momentum, error-feedback residuals and exchange buffers live: next "
            "to the parameters, or in (pinned) host memory; auto picks host memory on a GPU the other "
            "layout would not fit."
        ),
    )
    outer_lr: float = Field(0.7, gt=0, description="Learning rate of the outer SGD on pseudo-gradients.")
    outer_momentum: float = Field(0.9, ge=0, lt=1, description="Momentum of the outer SGD.")
    nesterov: bool = Field(True, description="Use Nesterov momentum in the outer SGD.")
    exchange_timeout_s: float = Field(
        30.0, gt=0, description="Give up on a partner after this many seconds (per peer)."
    )
    chunk_timeout_s: float = Field(10.0, gt=0, description="Give up when one chunk takes longer (per peer).")
    max_norm_ratio: float = Field(
        100.0, gt=1, description="Reject a partner's update whose norm exceeds ours by this factor."
    )
    robust_clip: bool = Field(
        True,
        description="Clip a partner's pseudo-gradient difference to clip_ratio times the smaller norm "
        "of the pair (docs/gossip.md, 'Malicious partners').",
    )
    clip_ratio: float = Field(
        2.0, gt=0, description="Clip radius relative to the smaller pseudo-gradient norm of the pair."
    )
    clip_hard_factor: float = Field(
        10.0,
        ge=1,
        description="A difference over this many clip radii (from our own norm) counts against the partner.",
    )
    clip_strikes: int = Field(
        2, ge=1, description="Hard-clipped exchanges in a row that ban a partner (with backoff)."
    )
    ban_base_s: float = Field(
        10.0, gt=0, description="First ban of a misbehaving partner, in seconds (per peer)."
    )
    ban_max_s: float = Field(
        600.0, gt=0, validate_default=True, description="Longest ban; bans double up to it (per peer)."
    )
    param_sync_every: int = Field(
        10, ge=1, description="Average full parameters with a partner every this many syncs (drift control)."
    )
    max_drift: float = Field(
        0.02,
        gt=0,
        description="Bound on relative L2 distance to a partner; above it parameters sync every round.",
    )
    param_codec: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32", description="Codec for the occasional full-parameter exchange."
    )

    @field_validator("ban_max_s")
    @classmethod
    def _max_ban_not_below_base(cls, value: float, info: ValidationInfo) -> float:
        base = info.data.get("ban_base_s")
        if base is not None and value < base:
            raise _cross_field("ban_base_s", "must be >= ban_base_s = {ban_base_s}", ban_base_s=base)
        return value


class CompressionSection(_Section):
    """How updates are encoded on the wire."""

    codec: Literal["fp32", "fp16", "bf16", "int8", "int4"] = Field(
        "int8", description="Codec for pseudo-gradients; int8/int4 are blockwise quantized."
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


class PipelineSection(_Section):
    """Pipeline stages across peers, for models larger than one peer's device (docs/pipeline.md)."""

    num_stages: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        1,
        description="Contiguous stages the model is cut into, one per peer (1 = no pipeline); 'auto': the "
        "fewest whose largest stage fits memory_budget_gb.",
    )
    memory_budget_gb: Annotated[float, Field(gt=0, le=1e6)] | None = Field(
        None,
        validate_default=True,
        description="This peer's device memory for one stage, in GiB; needed by num_stages 'auto'.",
    )
    microbatch_size: int = Field(
        4, ge=1, le=4096, description="Samples per micro-batch sent through the stages."
    )
    activation_codec: Literal["fp32", "fp16", "bf16", "int8", "int4"] = Field(
        "int8",
        description="Codec of activations and their gradients between stages (blockwise int8: 8 bits).",
    )
    max_inflight: int = Field(
        4, ge=1, le=256, description="Micro-batches a data holder (stage 0) keeps in the pipeline at once."
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Give up on a stage peer's answer after this long and retry elsewhere.",
    )
    routing: Literal["stochastic", "fixed"] = Field(
        "stochastic",
        description="'stochastic': each micro-batch goes to a random peer per stage, weighted by measured "
        "throughput and queue; 'fixed': always the same peer per stage (benchmark baseline).",
    )
    max_queue: int = Field(
        64, ge=1, le=4096, description="Requests a stage server queues before answering busy."
    )
    rebalance_every_s: Annotated[float, Field(gt=0)] | None = Field(
        30.0,
        description="Check every this many seconds whether to move to an under-served stage; null: never.",
    )
    rebalance_min_interval_s: float = Field(
        300.0, ge=0, description="A peer moves to another stage at most once per this many seconds."
    )

    @field_validator("memory_budget_gb")
    @classmethod
    def _auto_needs_a_budget(cls, value: float | None, info: ValidationInfo) -> float | None:
        if info.data.get("num_stages") == "auto" and value is None:
            raise _cross_field("num_stages", "must be set when num_stages is 'auto'")
        return value


class MonitorSection(_Section):
    """The live view (per peer: never part of the config hash)."""

    refresh_s: float = Field(2.0, gt=0, description="Seconds between monitor refreshes.")
    stale_after_s: float = Field(30.0, gt=0, description="Show a peer as stale after this many seconds.")
    prometheus_port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None, description="Serve Prometheus metrics on this port; None disables the endpoint."
    )
    history_path: str | None = Field(None, description="Append monitor snapshots to this JSON-lines file.")


SECTIONS: tuple[str, ...] = (
    "run",
    "network",
    "model",
    "data",
    "train",
    "averaging",
    "compression",
    "pipeline",
    "monitor",
)


class RunConfig(BaseModel):
    """A whole run config. Build it with :func:`swarm.config.load_config`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run: RunSection = Field(default_factory=RunSection, description="Identity of the run.")
    network: NetworkSection = Field(
        default_factory=NetworkSection, description="Joining the swarm (per peer)."
    )
    model: ModelSection = Field(default_factory=ModelSection, description="The model.")
    data: DataSection = Field(default_factory=DataSection, description="Training data.")
    train: TrainSection = Field(default_factory=TrainSection, description="Inner training loop.")
    averaging: AveragingSection = Field(default_factory=AveragingSection, description="Gossip averaging.")
    compression: CompressionSection = Field(default_factory=CompressionSection, description="Wire codecs.")
    pipeline: PipelineSection = Field(default_factory=PipelineSection, description="Pipeline stages.")
    monitor: MonitorSection = Field(default_factory=MonitorSection, description="Live view (per peer).")

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data: Any) -> Any:
        """A YAML section whose keys are all commented out parses as null; treat it as empty."""
        if isinstance(data, dict):
            return {key: ({} if value is None and key in SECTIONS else value) for key, value in data.items()}
        return data

    def swarm_view(self) -> dict[str, Any]:
        """The swarm-wide part of the config (everything but :data:`PER_PEER_KEYS`), JSON-ready.

        ``pipeline.num_stages: auto`` is resolved (from this peer's memory budget): peers must agree on
        the cut itself, so a peer whose budget gives another count has another hash. Without a pipeline
        (one stage) the section is left out, so the hashes of unpipelined runs did not change with it.
        """
        view = swarm_view(self.model_dump(mode="json"))
        if view["pipeline"]["num_stages"] == "auto":
            from swarm.pipeline import resolve_num_stages

            view["pipeline"]["num_stages"] = resolve_num_stages(self)
        if view["pipeline"]["num_stages"] == 1:
            del view["pipeline"]
        return view

    def config_hash(self) -> str:
        """First 16 hex digits of the sha256 of :meth:`swarm_view` as canonical JSON.

        Peers with different hashes do not average with each other; per-peer keys never change it.
        """
        return config_hash(self.swarm_view())

    def to_yaml(self) -> str:
        """The fully resolved config as YAML; ``load_config`` of it gives an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)
