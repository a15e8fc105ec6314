"""The signed membership record every peer announces, and its DHT schema.

Records travel through hivemind's DHT, whose ``SchemaValidator`` only understands ``pydantic.v1``
models with strict field types (a non-strict ``int`` would let ``3.0`` through), so this schema is a
v1 model. Limits are generous but finite: a record is untrusted input from an arbitrary peer.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Literal

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey
from pydantic.v1 import StrictBool, confloat, conint, conlist, constr

from swarm._protocol import MAX_MEMBER_SHARDS
from swarm.membership._signed import StrictSchemaValidator

RECORD_KEY_SUFFIX = "members"

if TYPE_CHECKING:  # a type checker cannot read pydantic.v1's constrained types; to it they are plain types
    Count = int
    ProtocolVersion = int
    NonNegative = float
    Loss = float
    ShortText = str
    PeerId = str
    PackageVersion = str
    HexDigest = str
    PublicName = str
    Addresses = list[str]
    StageIndex = int
else:
    Count = conint(strict=True, ge=0, le=2**63 - 1)
    ProtocolVersion = conint(strict=True, ge=0, le=1_000_000)
    NonNegative = confloat(strict=True, ge=0.0, le=1e18, allow_inf_nan=False)
    Loss = confloat(strict=True, ge=0.0, le=1e6, allow_inf_nan=False)
    ShortText = constr(strict=True, max_length=128)
    PeerId = constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")
    PackageVersion = constr(strict=True, max_length=32)
    HexDigest = constr(strict=True, regex=r"^[0-9a-f]{0,64}$")
    PublicName = constr(strict=True, max_length=64)
    Addresses = conlist(constr(strict=True, max_length=256), max_items=16)
    StageIndex = conint(strict=True, ge=0, le=255)

PeerRole = Literal["bootstrap", "trainer", "averager"]
PeerState = Literal["joining", "idle", "training", "syncing", "leaving"]
Reachability = Literal["unknown", "direct", "relay", "client"]
"""What a peer says about how others reach it (``client``: they cannot, it only dials out)."""
LossUnit = Literal["bits/byte", "bits/token"]
"""The unit of a record's losses: bits per token of the run's data, a byte for byte-level data."""


class FrozenModel(pydantic.BaseModel):
    """A record model that refuses unknown fields and cannot be changed once validated."""

    class Config:
        extra = pydantic.Extra.forbid
        frozen = True


class PeerRecord(FrozenModel):
    """What a peer says about itself, refreshed every few seconds (see docs/architecture.md)."""

    peer_id: PeerId
    protocol_version: ProtocolVersion
    package_version: PackageVersion
    config_hash: HexDigest
    public_name: PublicName = ""
    role: PeerRole
    state: PeerState = "idle"
    device: ShortText = "cpu"
    device_memory_gb: NonNegative = 0.0
    samples_per_s: NonNegative = 0.0
    round: Count = 0
    step: Count = 0
    samples_total: Count = 0
    # losses in loss_unit, converted at the source (the trainer publishes bits, never nats): loss the
    # smoothed training loss, eval_loss the last held-out one; eval_bits_per_byte is that held-out loss
    # per UTF-8 byte of text (equal to eval_loss for byte-level data; compares across tokenizers)
    loss: Loss | None = None
    eval_loss: Loss | None = None
    eval_bits_per_byte: Loss | None = None
    loss_unit: LossUnit = "bits/byte"
    drift: NonNegative | None = None
    rollbacks: Count = 0  # times its parameters went non-finite and were put back (docs/security.md)
    bytes_sent: Count = 0
    bytes_received: Count = 0
    exchanges_ok: Count = 0
    exchanges_failed: Count = 0
    exchanges_rejected: Count = 0
    client_mode: StrictBool = False
    addresses: Addresses = []
    reachability: Reachability = "unknown"
    state_hash: HexDigest = ""
    # pipeline (docs/pipeline.md): the stage this peer serves, and the samples per second it can process
    # when busy (0: not measured yet)
    stage: StageIndex = 0
    stage_capacity: NonNegative = 0.0
    started_at: NonNegative = 0.0


def shard_field(shard: int) -> str:
    """The schema field (and key suffix) of shard ``shard``: ``members`` for shard 0, as before shards."""
    return RECORD_KEY_SUFFIX if shard == 0 else f"{RECORD_KEY_SUFFIX}_{shard}"


def record_key(run_id: str, shard: int = 0) -> str:
    """The DHT key under which the members of run ``run_id`` in shard ``shard`` announce themselves."""
    if not 0 <= shard < MAX_MEMBER_SHARDS:
        raise ValueError(f"member shard {shard} is outside 0..{MAX_MEMBER_SHARDS - 1}")
    return f"{run_id}_{shard_field(shard)}"


def shard_of(peer_id: str, shards: int) -> int:
    """The shard (of ``shards``) that holds ``peer_id``'s record: a hash, so nobody chooses it cheaply."""
    digest = hashlib.sha256(peer_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % max(1, shards)


# DHT schema: each shard key ``<run_id>_members[_<s>]`` maps a signed subkey (its owner's public key) to
# that owner's record
_SHARD_FIELDS: dict[str, Any] = {
    shard_field(s): (dict[BytesWithPublicKey, PeerRecord], None) for s in range(MAX_MEMBER_SHARDS)
}
# named here (its module and name), so that validators holding it pickle into the DHT's process
_MembersSchema = pydantic.create_model("_MembersSchema", __module__=__name__, **_SHARD_FIELDS)


def members_validator(run_id: str) -> StrictSchemaValidator:
    """The schema check of the members' records of run ``run_id`` (see :func:`membership_validators`)."""
    return StrictSchemaValidator(_MembersSchema, allow_extra_keys=True, prefix=run_id)
