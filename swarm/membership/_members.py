"""Reading the live members of a run from the DHT."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from swarm.membership._record import PeerRecord, record_key
from swarm.membership._signed import MAX_RECORD_AHEAD_S, signer_peer_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """A live peer: its validated record and when that record expires (DHT time, seconds)."""

    peer_id: str
    record: PeerRecord
    expires_at: float


def list_members(
    dht: hivemind.DHT, run_id: str, *, latest: bool = True, timeout_s: float = 30.0
) -> list[Member]:
    """Return the peers whose signed records for ``run_id`` have not expired, sorted by peer id.

    Records reach us only after hivemind's signature and schema validators accepted them; on top of
    that, a record is dropped unless the key that signed it hashes to the peer id it claims, so a
    peer cannot announce itself under someone else's identity. A lookup that does not finish within
    ``timeout_s`` returns no members rather than blocking the caller.
    """
    try:
        found = dht.get(record_key(run_id), latest=latest, return_future=True).result(timeout=timeout_s)
    except TimeoutError:
        logger.warning("membership lookup timed out after %.0fs", timeout_s)
        return []
    if found is None or not isinstance(found.value, dict):
        return []
    now = get_dht_time()
    members: dict[str, Member] = {}
    for subkey, item in found.value.items():
        member = _to_member(subkey, item)
        if member is None or not now < member.expires_at <= now + MAX_RECORD_AHEAD_S:
            continue
        previous = members.get(member.peer_id)
        if previous is None or previous.expires_at < member.expires_at:
            members[member.peer_id] = member
    return sorted(members.values(), key=lambda m: m.peer_id)


def _to_member(subkey: object, item: object) -> Member | None:
    value = getattr(item, "value", None)
    expires_at = getattr(item, "expiration_time", None)
    if not isinstance(subkey, bytes) or not isinstance(value, dict) or not isinstance(expires_at, float):
        return None
    try:
        record = PeerRecord.parse_obj(value)
        signer = signer_peer_id(subkey)
    except Exception as exc:  # untrusted input: anything wrong means "not a member"
        logger.debug("ignoring malformed member record: %s", exc)
        return None
    if signer != record.peer_id:
        logger.warning("ignoring record claiming peer id %s, signed by %s", record.peer_id, signer)
        return None
    return Member(peer_id=record.peer_id, record=record, expires_at=expires_at)
