"""Membership: signed peer records in the DHT, announced periodically, read back as live members."""

from swarm._protocol import PROTOCOL_VERSION
from swarm.membership._announce import Announcer
from swarm.membership._compat import compatibility_problems
from swarm.membership._members import Member, list_members
from swarm.membership._record import PeerRecord, membership_validators, record_key
from swarm.membership._run_config import (
    ConfigPublisher,
    PublishedConfig,
    fetch_run_config,
    publish_run_config,
    run_config_key,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Announcer",
    "ConfigPublisher",
    "Member",
    "PeerRecord",
    "PublishedConfig",
    "compatibility_problems",
    "fetch_run_config",
    "list_members",
    "membership_validators",
    "publish_run_config",
    "record_key",
    "run_config_key",
]
