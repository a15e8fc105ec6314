"""Membership: signed peer records in the DHT, announced periodically, read back as live members."""

from swarm._protocol import MAX_MEMBER_SHARDS, PROTOCOL_VERSION
from swarm.membership._announce import Announcer
from swarm.membership._compat import compatibility_problems
from swarm.membership._members import Member, list_members, read_shards
from swarm.membership._record import (
    PeerRecord,
    PeerRole,
    PeerState,
    Reachability,
    record_key,
    shard_of,
)
from swarm.membership._run_config import (
    ConfigPublisher,
    PublishedConfig,
    choose_published,
    discover_run_id,
    fetch_run_config,
    list_published_configs,
    parse_config_text,
    publish_run_config,
    run_config_key,
)
from swarm.membership._validators import MAX_RECORD_AHEAD_S, ExpiryCap, membership_validators
from swarm.membership._view import MemberView

__all__ = [
    "MAX_MEMBER_SHARDS",
    "MAX_RECORD_AHEAD_S",
    "PROTOCOL_VERSION",
    "Announcer",
    "ConfigPublisher",
    "ExpiryCap",
    "Member",
    "MemberView",
    "PeerRecord",
    "PeerRole",
    "PeerState",
    "PublishedConfig",
    "Reachability",
    "choose_published",
    "compatibility_problems",
    "discover_run_id",
    "fetch_run_config",
    "list_members",
    "list_published_configs",
    "membership_validators",
    "parse_config_text",
    "publish_run_config",
    "read_shards",
    "record_key",
    "run_config_key",
    "shard_of",
]
