"""The DHT record validators of a run: what a node checks before it stores or returns a record."""

from __future__ import annotations

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import RecordValidatorBase

from swarm.membership._record import members_validator
from swarm.membership._run_config import run_config_validators


def membership_validators(run_id: str, signer: RSASignatureValidator) -> list[RecordValidatorBase]:
    """Validators that sign our records and reject unsigned, forged or malformed ones from others.

    They cover the members' records and the run config a bootstrap publishes.
    """
    return [signer, members_validator(run_id), *run_config_validators(run_id)]
