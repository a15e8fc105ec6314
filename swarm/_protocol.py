"""The one protocol version of swarm's wire formats (membership records, gossip exchanges).

Peers announce it in their records; a peer with another version is never chosen as a partner and the
monitor flags it. Bump it on any incompatible change to what crosses the network.
"""

PROTOCOL_VERSION = 7
"""2: both sides of a gossip exchange use it (offer mode); HELLO may carry an anchor probe.
3: records carry losses in bits (``loss_unit``), ``eval_bits_per_byte`` and ``rollbacks``; a peer
going away says ``leaving`` (its record, and BUSY "leaving").
4: a gossip exchange averages the pair's models by default (``averaging.exchange: model``) and a
model offer's probe carries its schedule round; a version-3 peer would read those parameters as a
pseudo-gradient, so the two never exchange.
5: a state is served as bf16 frames and a request names the frames of its part to skip; a gossip
exchange whose offer changed under it ends mid-stream with NACK "not committed", which blames
nobody.
6: a round's exchange sends each model relative to a base the pair shares (HELLO ``base``), pushed
by the dialling member at the round's start (HELLO ``push``); a version-5 peer would read those
frames as whole models.
7: every exchange averages the pair's models (the pseudo-gradient exchange and the HELLO's
``companion`` part are gone), so a version-6 peer that still offers pseudo-gradients never meets one
that reads them as a model."""

MAX_MEMBER_SHARDS = 256
"""The most DHT keys a run's membership records may be spread over (``run.member_shards``); every
node's record schema covers that many keys."""


def protocol_id(service: str, run_id: str) -> str:
    """The libp2p protocol id of one of swarm's stream services (``gossip``, ``state``, ``reach``...)
    for a run: namespaced by service, protocol version and run, so that peers of another version or
    run never reach each other's handlers."""
    return f"swarm.{service}.v{PROTOCOL_VERSION}.{run_id}"
