"""Signed DHT records: who signed one, and a schema check that refuses garbage instead of raising.

Every record the membership layer stores (peer records, published run configs, run announcements) sits
under a subkey that is hivemind's owner marker, ``[owner:<public key>]``: hivemind's
``RSASignatureValidator`` checks the signature against that key, and the key hashes to the signer's
peer id.
"""

from __future__ import annotations

from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils.crypto import RSAPublicKey

from swarm.network import peer_id_of

_OWNER_PREFIX, _OWNER_SUFFIX = b"[owner:", b"]"

MAX_RECORD_AHEAD_S = 600.0
"""Latest expiry a node accepts, from now: a few of the longest ttl a peer uses (the published config's
120 s), plus clock skew. hivemind alone stores any future expiry, so a record that outlives its
signer by days (a fake trainer's, say) would otherwise be listed as live for days."""


def owner_public_key(subkey: bytes) -> bytes:
    """The public key inside an owner-marker subkey; ValueError for anything else."""
    if not (subkey.startswith(_OWNER_PREFIX) and subkey.endswith(_OWNER_SUFFIX)):
        raise ValueError("subkey is not an owner marker")
    return subkey[len(_OWNER_PREFIX) : -len(_OWNER_SUFFIX)]


def signer_peer_id(subkey: object) -> str:
    """The peer id of the key that signed a record stored under ``subkey``; raises on a malformed one."""
    if not isinstance(subkey, bytes):
        raise ValueError("subkey is not bytes")
    return peer_id_of(RSAPublicKey.from_bytes(owner_public_key(subkey)))


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
