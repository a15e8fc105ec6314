"""Gossip averaging: quantized, weighted, atomic pairwise exchanges with random live partners.

See docs/gossip.md for the protocol, the commit rule and the averaging semantics.
"""

from swarm.gossip._averager import GossipAverager
from swarm.gossip._metrics import FAILURES, ExchangeMetrics, SyncOutcome, SyncResult
from swarm.gossip._mixing import MixedTensors
from swarm.gossip._offer import Committed, Offer, Offerer
from swarm.gossip._options import GossipOptions
from swarm.gossip._partners import (
    PartnerInfo,
    consensus_order,
    hypercube_partner,
)
from swarm.gossip._protocol import PROTOCOL_VERSION, handler_name

__all__ = [
    "FAILURES",
    "PROTOCOL_VERSION",
    "Committed",
    "ExchangeMetrics",
    "GossipAverager",
    "GossipOptions",
    "MixedTensors",
    "Offer",
    "Offerer",
    "PartnerInfo",
    "SyncOutcome",
    "SyncResult",
    "consensus_order",
    "handler_name",
    "hypercube_partner",
]
