"""The signed membership record every peer announces, and its DHT schema.

Records travel through hivemind's DHT, whose ``SchemaValidator`` only understands ``pydantic.v1``
models with strict field types (a non-strict ``int`` would let ``3.0`` through), so this schema is a
v1 model. Limits are generous but finite: a record is untrusted input from an arbitrary peer.
"""

from __future__ import annotations

from typing import Literal

import pydantic.v1 as pydantic
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import DHTRecord
from pydantic.v1 import StrictBool, confloat, conint, conlist, constr

RECORD_KEY_SUFFIX = "members"

Count = conint(strict=True, ge=0, le=2**63 - 1)
NonNegative = confloat(strict=True, ge=0.0, le=1e18, allow_inf_nan=False)
ShortText = constr(strict=True, max_length=128)
Role = Literal["bootstrap", "trainer", "averager"]
State = Literal["joining", "idle", "training", "syncing", "leaving"]


class PeerRecord(pydantic.BaseModel):
    """What a peer says about itself, refreshed every few seconds (see docs/architecture.md)."""

    peer_id: constr(strict=True, regex=r"^[1-9A-HJ-NP-Za-km-z]{32,64}$")
    protocol_version: conint(strict=True, ge=0, le=1_000_000)
    package_version: constr(strict=True, max_length=32)
    config_hash: constr(strict=True, regex=r"^[0-9a-f]{0,64}$")
    public_name: constr(strict=True, max_length=64) = ""
    role: Role
    state: State = "idle"
    device: ShortText = "cpu"
    device_memory_gb: NonNegative = 0.0
    samples_per_s: NonNegative = 0.0
    round: Count = 0
    step: Count = 0
    samples_total: Count = 0
    loss: confloat(strict=True, ge=0.0, le=1e6, allow_inf_nan=False) | None = None
    eval_loss: confloat(strict=True, ge=0.0, le=1e6, allow_inf_nan=False) | None = None
    drift: NonNegative | None = None
    bytes_sent: Count = 0
    bytes_received: Count = 0
    exchanges_ok: Count = 0
    exchanges_failed: Count = 0
    exchanges_rejected: Count = 0
    client_mode: StrictBool = False
    addresses: conlist(constr(strict=True, max_length=256), max_items=16) = []
    reachability: Literal["unknown", "direct", "relay", "client"] = "unknown"
    state_hash: constr(strict=True, regex=r"^[0-9a-f]{0,64}$") = ""
    started_at: NonNegative = 0.0

    class Config:
        extra = pydantic.Extra.forbid
        frozen = True


class _MembersSchema(pydantic.BaseModel):
    """DHT schema: key ``<run_id>_members`` maps a signed subkey (the owner's public key) to a record."""

    members: dict[BytesWithPublicKey, PeerRecord]


def record_key(run_id: str) -> str:
    """The DHT key under which the members of run ``run_id`` announce themselves."""
    return f"{run_id}_{RECORD_KEY_SUFFIX}"


class StrictSchemaValidator(SchemaValidator):
    """hivemind's schema check, with garbage subkeys refused instead of raised.

    ``SchemaValidator`` deserializes an untrusted subkey into a dict key; a msgpack map or array there
    raises ``TypeError`` (unhashable), which the DHT turns into an RPC error instead of a rejection.
    """

    def validate(self, record: DHTRecord) -> bool:
        try:
            return super().validate(record)
        except (TypeError, ValueError):
            return False


def membership_validators(run_id: str, signer: RSASignatureValidator) -> list:
    """Validators that sign our records and reject unsigned, forged or malformed ones from others.

    They cover the members' records and the run config a bootstrap publishes.
    """
    from swarm.membership._run_config import run_config_validators

    return [
        signer,
        StrictSchemaValidator(_MembersSchema, allow_extra_keys=True, prefix=run_id),
        *run_config_validators(run_id),
    ]
