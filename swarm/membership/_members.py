"""Reading the live members of a run from the DHT."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import hivemind
from hivemind.utils.timed_storage import get_dht_time

from swarm.membership._record import PeerRecord, record_key, shard_of
from swarm.membership._signed import MAX_RECORD_AHEAD_S, signer_peer_id

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """A live peer: its validated record and when that record expires (DHT time, seconds)."""

    peer_id: str
    record: PeerRecord
    expires_at: float


def list_members(
    dht: hivemind.DHT,
    run_id: str,
    *,
    member_shards: int = 1,
    shards: Iterable[int] | None = None,
    latest: bool = True,
    timeout_s: float = 30.0,
) -> list[Member]:
    """Return the peers whose signed records for ``run_id`` have not expired, sorted by peer id: those
    of ``shards`` of the run's ``member_shards`` (``run.member_shards``), or of all of them.

    Records reach us only after hivemind's signature and schema validators accepted them; on top of
    that, a record is dropped unless the key that signed it hashes to the peer id it claims, so a
    peer cannot announce itself under someone else's identity. A shard whose lookup does not finish
    within ``timeout_s`` adds no members rather than blocking the caller.
    """
    wanted = range(member_shards) if shards is None else shards
    read = read_shards(dht, run_id, member_shards, wanted, latest=latest, timeout_s=timeout_s)
    members: dict[str, Member] = {}
    for found in read.values():
        for member in found or ():
            previous = members.get(member.peer_id)
            if previous is None or previous.expires_at < member.expires_at:
                members[member.peer_id] = member
    return sorted(members.values(), key=lambda m: m.peer_id)


def read_shards(
    dht: hivemind.DHT,
    run_id: str,
    member_shards: int,
    shards: Iterable[int],
    *,
    latest: bool = True,
    timeout_s: float = 30.0,
) -> dict[int, list[Member] | None]:
    """The live members listed under each of ``shards`` (read at once), or None for a shard whose
    lookup did not finish within ``timeout_s``. A record stored in a shard its peer id does not hash
    to (:func:`~swarm.membership.shard_of`) is dropped: nobody is listed in every shard."""
    keys = {s: record_key(run_id, s) for s in dict.fromkeys(shards)}
    pending = {s: dht.get(key, latest=latest, return_future=True) for s, key in keys.items()}
    deadline = time.monotonic() + timeout_s
    read: dict[int, list[Member] | None] = {}
    for shard, future in pending.items():
        try:
            found = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            logger.warning("membership lookup of shard %d timed out after %.0fs", shard, timeout_s)
            future.cancel()
            read[shard] = None
            continue
        read[shard] = [m for m in _live_members(found) if shard_of(m.peer_id, member_shards) == shard]
    return read


def _live_members(found: object) -> list[Member]:
    """The valid, unexpired records of one key's answer, one per peer (the latest)."""
    value = getattr(found, "value", None)
    if not isinstance(value, dict):
        return []
    now = get_dht_time()
    members: dict[str, Member] = {}
    for subkey, item in value.items():
        member = _to_member(subkey, item)
        if member is None or not now < member.expires_at <= now + MAX_RECORD_AHEAD_S:
            continue
        previous = members.get(member.peer_id)
        if previous is None or previous.expires_at < member.expires_at:
            members[member.peer_id] = member
    return list(members.values())


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
