"""The DHT record validators of a run: what a node checks before it stores or returns a record."""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils.timed_storage import get_dht_time

from swarm.membership._record import members_validator
from swarm.membership._run_config import run_config_validators
from swarm.membership._signed import MAX_RECORD_AHEAD_S


class ExpiryCap(RecordValidatorBase):
    """Refuses records that expire more than ``max_ahead_s`` from now (DHT time)."""

    def __init__(self, max_ahead_s: float = MAX_RECORD_AHEAD_S) -> None:
        self.max_ahead_s = max_ahead_s

    def validate(self, record: DHTRecord) -> bool:
        return bool(record.expiration_time <= get_dht_time() + self.max_ahead_s)

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, ExpiryCap):
            return False
        self.max_ahead_s = min(self.max_ahead_s, other.max_ahead_s)
        return True


def membership_validators(run_id: str, signer: RSASignatureValidator) -> list[RecordValidatorBase]:
    """Validators that sign our records and reject unsigned, forged, malformed or far-expiring ones.

    They cover the members' records and the run config a bootstrap publishes.
    """
    return [signer, members_validator(run_id), *run_config_validators(run_id), ExpiryCap()]
