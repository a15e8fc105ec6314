"""Membership: signed peer records in the DHT, announced periodically, read back as live members."""

from swarm._protocol import PROTOCOL_VERSION
from swarm.membership._announce import Announcer
from swarm.membership._members import Member, list_members
from swarm.membership._record import PeerRecord, membership_validators, record_key

__all__ = [
    "PROTOCOL_VERSION",
    "Announcer",
    "Member",
    "PeerRecord",
    "list_members",
    "membership_validators",
    "record_key",
]
