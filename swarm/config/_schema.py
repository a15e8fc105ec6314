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

from swarm._protocol import MAX_MEMBER_SHARDS
from swarm._tokenizer import Tokenizer, TokenizerError, load_tokenizer
from swarm.config._exchange_sections import AveragingSection, CompressionSection, PipelineSection
from swarm.config._section import Section, cross_field, per_peer_field
from swarm.config._view import config_hash, per_peer_keys, swarm_view

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


def _tokenizer_of(spec: str) -> Tokenizer:
    """``data.tokenizer``, loaded (once per process); a failure is a config error naming the key."""
    try:
        return load_tokenizer(spec)
    except TokenizerError as error:
        raise PydanticCustomError("tokenizer", "{reason}", {"reason": str(error)}) from error


class RunSection(Section):
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
    member_shards: int = Field(
        1,
        ge=1,
        le=MAX_MEMBER_SHARDS,
        description="DHT keys the members' records are spread over. 1: every peer reads the whole member "
        "list each record interval. More (about peers / 8 for runs of hundreds): each trainer reads one "
        "key per interval, so its membership traffic stays flat as the run grows; needs "
        "averaging.partners: random (docs/architecture.md, 'What membership costs as the swarm grows').",
    )


class NetworkSection(Section):
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
    relay: bool = Field(
        False,
        description="Forward streams to peers behind NAT that list this peer among their initial peers "
        "(every bootstrap does); for a directly reachable trainer.",
    )
    behind_nat: bool = Field(
        False,
        description="This peer is behind NAT without a port forward: if no peer can dial it directly, it "
        "announces /p2p-circuit addresses through its initial peers, which relay streams to it, instead "
        "of running in client mode.",
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
            raise cross_field(
                "record_interval_s",
                "must be >= 2 * record_interval_s = {minimum} so a record survives one late refresh",
                minimum=2 * interval,
            )
        return value


class ModelSection(Section):
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
    vocab_size: int = Field(
        256, ge=2, le=1 << 20, description="Vocabulary size: 256 for bytes; if left out, data.tokenizer's."
    )
    dropout: float = Field(0.0, ge=0, le=1, description="Dropout probability.")
    hf_config: dict[str, Any] | None = Field(
        None, description="For kind 'hf': keyword arguments of the transformers config (no weights download)."
    )

    @field_validator("n_embd")
    @classmethod
    def _embd_splits_into_heads(cls, value: int, info: ValidationInfo) -> int:
        heads = info.data.get("n_head")
        if heads is not None and value % heads:
            raise cross_field("n_head", "must be divisible by n_head = {n_head}", n_head=heads)
        return value


class DataSection(Section):
    """Where training text comes from."""

    source: Literal["stdlib", "files", "hf", "tokens"] = Field(
        "stdlib",
        description="'stdlib': the Python standard library's source (no download); "
        "'files': local text files in paths; 'hf': a streamed datasets dataset; "
        "'tokens': the directory in paths that `swarm data prepare` wrote.",
    )
    paths: list[str] = per_peer_field(
        default_factory=list,
        validate_default=True,
        description="For source 'files': files or directories of text; for 'tokens': the one prepared "
        "directory (per peer).",
    )
    hf_dataset: str | None = Field(
        None,
        validate_default=True,
        description="For source 'hf': the dataset name, e.g. 'roneneldan/TinyStories'.",
    )
    hf_config: Annotated[str, Field(min_length=1)] | None = Field(
        None, description="For source 'hf': the dataset's configuration (subset), e.g. 'sample-10BT'."
    )
    split: str = Field("train", min_length=1, description="For source 'hf': the split to stream.")
    text_field: str = Field(
        "text", min_length=1, description="For source 'hf': the field of a record that holds its text."
    )
    eval_fraction: float = Field(0.01, gt=0, lt=0.5, description="Share of the data held out for evaluation.")
    tokenizer: str | None = Field(
        None,
        description="A transformers tokenizer (local directory or Hub name) to train on instead of bytes.",
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_loads(cls, value: str | None) -> str | None:
        if value is not None:
            _tokenizer_of(value)
        return value

    @field_validator("paths")
    @classmethod
    def _files_need_paths(cls, value: list[str], info: ValidationInfo) -> list[str]:
        source = info.data.get("source")
        if source == "files" and not value:
            raise cross_field("source", "must name at least one file or directory when source is 'files'")
        if source == "tokens" and len(value) != 1:
            raise cross_field(
                "source",
                "must name exactly one directory (written by swarm data prepare) when source is 'tokens'",
            )
        return value

    @field_validator("hf_dataset")
    @classmethod
    def _hf_needs_dataset(cls, value: str | None, info: ValidationInfo) -> str | None:
        if info.data.get("source") == "hf" and not value:
            raise cross_field("source", "must name a dataset when source is 'hf'")
        return value


class TrainSection(Section):
    """Inner (local) training loop."""

    device: str = per_peer_field(
        "auto",
        description="'auto' (CUDA when present, else Apple's MPS, else CPU), 'cpu', 'cuda', 'cuda:1', "
        "'mps', ...",
    )
    batch_size: int = Field(16, ge=1, description="Samples per inner optimizer step.")
    micro_batch_size: Annotated[int, Field(ge=1)] | None = per_peer_field(
        None, description="Samples per forward pass (gradient accumulation); None picks one that fits memory."
    )
    lr: float = Field(3e-4, gt=0, description="Peak learning rate of the inner AdamW.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(20, ge=0, description="Linear learning-rate warm-up, in inner steps.")
    max_steps: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Stop after this many inner steps."
    )
    grad_clip: float = Field(1.0, gt=0, description="Clip the gradient norm to this value.")
    checkpoint_dir: str | None = per_peer_field(
        "auto",
        description="Directory for local checkpoints (a lock file keeps it to one live peer); 'auto': "
        "$SWARM_HOME/runs/<run_id>/<peer>/checkpoints (SWARM_HOME defaults to ~/.swarm; <peer> is the "
        "peer's public name, else its identity's peer id, else 'peer'); null keeps none.",
    )
    checkpoint_every_s: float = per_peer_field(300.0, gt=0, description="Seconds between local checkpoints.")
    activation_checkpointing: bool = per_peer_field(
        False, description="Recompute activations in the backward pass to save GPU memory (CUDA only)."
    )
    precision: Literal["auto", "bf16", "fp16", "fp32"] = per_peer_field(
        "auto",
        description="Autocast type of forward and backward (per peer): 'auto' is bf16 on a GPU that has it, "
        "fp16 with loss scaling on one that does not (T4, V100, RTX 20xx), fp32 on the CPU.",
    )
    compile: bool = per_peer_field(
        False,
        description="Run the forward pass through torch.compile (per peer; slower start, faster steps).",
    )
    eval_every_rounds: int = per_peer_field(
        1, ge=1, description="Evaluate held-out loss every this many syncs."
    )
    eval_batches: int = per_peer_field(
        4, ge=1, le=1000, description="Held-out batches (of 32 windows) per evaluation."
    )


class EmulationSection(Section):
    """Benchmark aid: an emulated accelerator, so that many peers of known speeds share one machine.

    Per peer (never part of the config hash), and off by default; a real run leaves it out.
    """

    step_time_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description=(
            "Emulated accelerator: pad each inner step to at least this many seconds by sleeping, the "
            "way a process waits on its GPU (benchmarks on one machine; 0 = off)."
        ),
    )
    slowdown: float = Field(
        1.0,
        ge=1,
        le=1000,
        description="Stretch the (emulated) device time by this factor: a slow peer on the same machine "
        "(1 = off; at most 1000, so that a step never sleeps for good).",
    )


MOVED_KEYS: dict[str, str] = {
    "train.step_time_s": "emulation.step_time_s",
    "train.slowdown": "emulation.slowdown",
}
"""Keys that moved, old dotted name to new: a config that still uses an old name is told the new one."""


class MonitorSection(Section):
    """The live view (per peer: never part of the config hash)."""

    refresh_s: float = Field(2.0, gt=0, description="Seconds between monitor refreshes.")
    stale_after_s: float = Field(30.0, gt=0, description="Show a peer as stale after this many seconds.")
    prometheus_port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None, description="Serve Prometheus metrics on this port; None disables the endpoint."
    )
    history_path: str | None = Field(None, description="Append monitor snapshots to this JSON-lines file.")
    tensorboard_dir: str | None = Field(
        None,
        description="Write swarm scalars (eval and train loss, samples/s, bytes/s, peers) as TensorBoard "
        "event files in this directory on every refresh.",
    )


SECTIONS: tuple[str, ...] = (
    "run",
    "network",
    "model",
    "data",
    "train",
    "averaging",
    "compression",
    "pipeline",
    "emulation",
    "monitor",
)


class RunConfig(BaseModel):
    """A whole run config. Build it with :func:`swarm.config.load_config`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    run: RunSection = Field(default_factory=RunSection, description="Identity of the run.")
    network: NetworkSection = per_peer_field(
        default_factory=NetworkSection, description="Joining the swarm (per peer)."
    )
    model: ModelSection = Field(default_factory=ModelSection, description="The model.")
    data: DataSection = Field(default_factory=DataSection, description="Training data.")
    train: TrainSection = Field(default_factory=TrainSection, description="Inner training loop.")
    averaging: AveragingSection = Field(
        default_factory=AveragingSection, validate_default=True, description="Gossip averaging."
    )
    compression: CompressionSection = Field(default_factory=CompressionSection, description="Wire codecs.")
    pipeline: PipelineSection = Field(default_factory=PipelineSection, description="Pipeline stages.")
    emulation: EmulationSection = per_peer_field(
        default_factory=EmulationSection, description="Emulated device speed (benchmark aid; per peer)."
    )
    monitor: MonitorSection = per_peer_field(
        default_factory=MonitorSection, description="Live view (per peer)."
    )

    @model_validator(mode="before")
    @classmethod
    def _empty_section_means_defaults(cls, data: Any) -> Any:
        """A YAML section whose keys are all commented out parses as null; treat it as empty."""
        if isinstance(data, dict):
            return {key: ({} if value is None and key in SECTIONS else value) for key, value in data.items()}
        return data

    @field_validator("averaging")
    @classmethod
    def _schedule_needs_all(cls, averaging: AveragingSection, info: ValidationInfo) -> AveragingSection:
        """The hypercube schedule orders every live trainer, and the all-reduce baseline's group waits
        for every one, so both need the whole member list; a peer of a sharded run sees only part of
        it, and views that differ would pair nobody as scheduled."""
        run = info.data.get("run")
        if run is None or run.member_shards == 1:
            return averaging
        refused = {
            "backend": (
                averaging.backend == "allreduce",
                "cannot be 'allreduce' when run.member_shards > 1 (here {shards}): its group waits for "
                "every live trainer, and a peer of a sharded run sees only some",
            ),
            "partners": (
                averaging.partners == "hypercube",
                "must be 'random' when run.member_shards > 1 (here {shards}): the hypercube schedule needs "
                "every peer to read the whole member list",
            ),
        }
        for key, (bad, message) in refused.items():
            if bad:
                context = {"key": key, "value": getattr(averaging, key), "shards": run.member_shards}
                raise PydanticCustomError("section_key", message, context)
        return averaging

    @field_validator("data")
    @classmethod
    def _vocab_from_tokenizer(cls, data: DataSection, info: ValidationInfo) -> DataSection:
        """With ``data.tokenizer``, ``model.vocab_size`` is its size unless set larger (padding)."""
        model = info.data.get("model")
        if data.tokenizer is not None and model is not None:
            size = _tokenizer_of(data.tokenizer).vocab_size
            if "vocab_size" not in model.model_fields_set:
                model.vocab_size = size
            hf_size = (model.hf_config or {}).get("vocab_size")
            vocab = min(model.vocab_size, hf_size) if isinstance(hf_size, int) else model.vocab_size
            if vocab < size:
                message = (
                    "data.tokenizer has {size} tokens, more than the model's vocab_size {vocab}: "
                    "leave model.vocab_size out to take it from the tokenizer"
                )
                raise PydanticCustomError("tokenizer", message, {"size": size, "vocab": vocab})
        return data

    def swarm_view(self) -> dict[str, Any]:
        """The swarm-wide part of the config (everything but :data:`PER_PEER_KEYS`), JSON-ready.

        Every key enters as its resolved value: defaults filled in, ``model.vocab_size`` taken from the
        tokenizer, and ``data.tokenizer`` as a fingerprint of the tokenizer's content (not its name or
        path, which differ between machines holding the same tokenizer). ``pipeline.num_stages: auto``
        enters as it stands, with the ``pipeline.memory_budget_gb`` it is resolved from.
        """
        view = swarm_view(self.model_dump(mode="json"), PER_PEER_KEYS)
        if self.data.tokenizer is not None:
            view["data"]["tokenizer"] = load_tokenizer(self.data.tokenizer).fingerprint
        return view

    def config_hash(self) -> str:
        """First 16 hex digits of the sha256 of :meth:`swarm_view` as canonical JSON (and the rule's version).

        Peers with different hashes do not average with each other; per-peer keys never change it.
        """
        return config_hash(self.swarm_view())

    def to_yaml(self) -> str:
        """The fully resolved config as YAML; ``load_config`` of it gives an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


PER_PEER_KEYS: frozenset[str] = per_peer_keys(RunConfig)
"""Dotted keys (or whole sections) that each peer may set differently; excluded from the hash.

Derived from the fields marked :data:`~swarm.config._section.PER_PEER`, never kept by hand."""
