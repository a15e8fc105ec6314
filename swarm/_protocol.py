"""The one protocol version of swarm's wire formats (membership records, gossip exchanges).

Peers announce it in their records; a peer with another version is never chosen as a partner and the
monitor flags it. Bump it on any incompatible change to what crosses the network.
"""

PROTOCOL_VERSION = 3
"""2: both sides of a gossip exchange use it (offer mode); HELLO may carry an anchor probe.
3: records carry losses in bits (``loss_unit``), ``eval_bits_per_byte`` and ``rollbacks``; a peer
going away says ``leaving`` (its record, and BUSY "leaving")."""
