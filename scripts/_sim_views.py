"""Membership views in the simulator: whom a peer knows, whom it schedules, and the bytes that costs.

Three designs (docs/simulator.md, "Membership views"), each refreshed every ``view_refresh_s`` at
phases drawn at random:

* ``full`` (the trainer today): every refresh a peer stores its record under the run's one key and
  reads every record there; its hypercube partner comes from the hash order of all listed peers.
* ``sample``: a bounded peer sample (``SAMPLE`` entries). Every refresh a peer stores its record in
  its shard (one of ``S`` keys, ``S`` sized so a shard holds about ``SHARD_TARGET`` records) and swaps
  ``SHUFFLE`` records with the oldest entry of its sample; every ``SHARD_EVERY`` refreshes it also reads
  one random shard. No partner can fill a sample: what one source offers keeps at most ``SAMPLE // 4``
  places, and the shard reads (placed by a hash, not by anyone's say) refill the rest. No schedule:
  a round's partner is a random entry.
* ``shards`` (the trainer with ``run.member_shards`` > 1): records are stored in shards as for
  ``sample``; every other refresh a peer reads one shard, the next of a random rotation of them all
  (four at once for a first view), and its view is what it read whose records have not expired (plus
  a read period), at most 32 a read: the product's :class:`swarm.membership.MemberView`. No
  schedule (the trainer needs ``averaging.partners: random``): a round's partner is a random entry.
* ``lookup``: no view of the run. Round ``r``'s partner is the live node nearest (XOR) to
  ``id(me) XOR 2^(63 - k)``, ``k = r mod d``, found by a Kademlia lookup and kept ``FINGER_TTL_S``
  (or until a dial to it fails); ``d = round(log2 N')`` with ``N'`` estimated from the distance to
  the ``BUCKET``-th nearest node, re-read by a lookup of one's own id every ``SELF_EVERY`` refreshes.
  Fallbacks are the other fingers and those nearest nodes.

Byte model (what a peer sends and receives for membership, both counted; the DHT's own upkeep
beyond the lookups below is left out): a record is ``RECORD_BYTES``; a store goes to ``REPLICAS``
nodes whose addresses are cached; a read of a key returns its records; a lookup among ``n`` nodes is
``ceil(log_BUCKET n) + 1`` hops of ``ALPHA`` requests each answered with ``BUCKET`` contacts; a ping or
a failed dial costs two ``REQUEST_BYTES``. ``sample`` and ``lookup`` hand each partner their record
at the exchange's handshake (``full`` holds it already). Bytes served by the nodes that hold a key
are counted per key: ``full`` puts every read on one key.
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING

import numpy as np

from swarm.gossip import consensus_order, hypercube_partner
from swarm.membership import Member, MemberView, shard_of

if TYPE_CHECKING:
    from scripts._sim_host import Host
    from scripts._sim_peer import Peer

RECORD_BYTES = 1024
"""A signed record: its fields (about 400 B), the RSA public key (about 300 B), the signature (256 B)
and the DHT's framing."""
REQUEST_BYTES = 128
CONTACT_BYTES = 64
"""A node in a lookup's reply: its DHT id, its peer id and framing."""
BUCKET = 20
ALPHA = 3
REPLICAS = 5
"""Contacts per reply and per k-bucket, parallel requests per hop, nodes a record is stored on
(hivemind's ``bucket_size``, a usual alpha, hivemind's ``num_replicas``)."""
SAMPLE = 16
SHUFFLE = 6
SHARD_TARGET = 8
SHARD_EVERY = 4
FINGER_TTL_S = 30.0
SELF_EVERY = 10
SALT = "sim"
KINDS = ("full", "sample", "shards", "lookup")


def lookup_bytes(n: int) -> int:
    """Bytes a Kademlia lookup among ``n`` nodes sends and receives."""
    hops = math.ceil(math.log(max(n, 2)) / math.log(BUCKET)) + 1
    return hops * ALPHA * (2 * REQUEST_BYTES + BUCKET * CONTACT_BYTES)


def shard_count(peers: int) -> int:
    """Shards for ``peers`` records, about ``SHARD_TARGET`` each (a power of two)."""
    return 2 ** max(0, round(math.log2(max(1, peers) / SHARD_TARGET)))


def node_id(pid: str) -> int:
    """A peer's 64-bit place in the key space (the top of the hash the full view orders by)."""
    return int.from_bytes(hashlib.sha256((SALT + pid).encode()).digest()[:8], "big")


class Views:
    """The membership design every peer of a simulation uses; ``served`` counts bytes per DHT key."""

    name = ""

    def __init__(self, sim: Host) -> None:
        self.sim = sim
        self.served: dict[str, float] = {}

    def add(self, peer: Peer) -> None:
        """A new member (its record is stored: it can be found from now on)."""

    def start(self, peer: Peer, joining: bool) -> None:
        """``peer``'s first view (at the start, or as it joins)."""
        self.refresh(peer)

    def refresh(self, peer: Peer) -> None:
        raise NotImplementedError

    def left(self, peer: Peer) -> None:
        """``peer`` died (its record stays until it expires)."""

    def scheduled(self, peer: Peer) -> str | None:
        return None

    def pushes(self, peer: Peer, partner: str) -> bool:
        """``based``: whether ``peer`` pushes the base to its scheduled ``partner`` (one of the two)."""
        return False

    def candidates(self, peer: Peer) -> list[str]:
        return list(peer.view)

    def failed(self, peer: Peer, pid: str) -> None:
        """A dial from ``peer`` to ``pid`` found nobody."""
        self.count(peer, REQUEST_BYTES, REQUEST_BYTES)

    def on_exchange(self, a: Peer, b: Peer) -> None:
        """Each side hands the other its record at the handshake."""
        self.count(a, RECORD_BYTES, RECORD_BYTES)
        self.count(b, RECORD_BYTES, RECORD_BYTES)

    def count(self, peer: Peer, sent: float, received: float) -> None:
        peer.membership_sent += sent
        peer.membership_received += received

    def serve(self, key: str, nbytes: float) -> None:
        self.served[key] = self.served.get(key, 0.0) + nbytes

    def listed(self, peer: Peer) -> bool:
        """Whether ``peer``'s record is still in the DHT: live, or dead for less than its lifetime."""
        return peer.alive or (
            peer.died is not None and self.sim.clock.now - peer.died < self.sim.cfg.record_ttl_s
        )


class FullView(Views):
    name = "full"

    def refresh(self, peer: Peer) -> None:
        peer.view = [p.pid for p in self.sim.peers.values() if self.listed(p)]
        peer.order = consensus_order(peer.view, salt=SALT)
        peer.position = {pid: i for i, pid in enumerate(peer.order)}
        got = len(peer.view) * RECORD_BYTES
        self.count(peer, REPLICAS * RECORD_BYTES + REQUEST_BYTES, got)
        self.serve("members", got)

    def scheduled(self, peer: Peer) -> str | None:
        return hypercube_partner(peer.order, peer.pid, peer.round)

    def pushes(self, peer: Peer, partner: str) -> bool:
        dims = max(1, (len(peer.order) - 1).bit_length())
        later_pushes = (peer.round // dims) % 2 == 1
        return (peer.position[partner] < peer.position[peer.pid]) == later_pushes

    def on_exchange(self, a: Peer, b: Peer) -> None:
        """Both records are in the view already."""


class SampleView(Views):
    name = "sample"

    def __init__(self, sim: Host) -> None:
        super().__init__(sim)
        self.shards = shard_count(sim.cfg.peers)
        self._members: list[list[Peer]] = [[] for _ in range(self.shards)]
        self._reads: dict[str, int] = {}

    def shard(self, pid: str) -> int:
        return node_id(pid) % self.shards

    def add(self, peer: Peer) -> None:
        self._members[self.shard(peer.pid)].append(peer)

    def start(self, peer: Peer, joining: bool) -> None:
        peer.sample = {}
        if not joining:  # bootstrapped: a random sample of the first members
            others = [p.pid for p in self.sim.peers.values() if p.pid != peer.pid]
            for pid in self.sim.rng.sample(others, min(SAMPLE, len(others))):
                peer.sample[pid] = (0.0, "dht")
        else:  # a joiner reads shards until its sample is half full
            for _ in range(4):
                self.read_shard(peer)
                if len(peer.sample) >= SAMPLE // 2:
                    break
        peer.view = list(peer.sample)

    def refresh(self, peer: Peer) -> None:
        self.count(peer, REPLICAS * RECORD_BYTES, 0)
        self._reads[peer.pid] = self._reads.get(peer.pid, 0) + 1
        if self._reads[peer.pid] % SHARD_EVERY == 0:
            self.read_shard(peer)
        self.shuffle(peer)
        peer.view = list(peer.sample)

    def read_shard(self, peer: Peer) -> None:
        index = self.sim.rng.randrange(self.shards)
        found = [p.pid for p in self._members[index] if self.listed(p) and p.pid != peer.pid]
        got = len(found) * RECORD_BYTES
        self.count(peer, REQUEST_BYTES, lookup_bytes(self.sim.cfg.peers) + got)
        self.serve(f"shard-{index}", got)
        merge(peer.sample, {pid: self.sim.clock.now for pid in found}, "dht", peer.pid)

    def shuffle(self, peer: Peer) -> None:
        """Swap ``SHUFFLE`` entries (and both own records) with the oldest entry of the sample."""
        if not peer.sample:
            return
        oldest = min(peer.sample, key=lambda pid: peer.sample[pid][0])
        other = self.sim.peers.get(oldest)
        if other is None or not other.alive:
            self.failed(peer, oldest)
            return
        now = self.sim.clock.now
        mine, theirs = self._offer(peer, other.pid), self._offer(other, peer.pid)
        nbytes = (SHUFFLE + 1) * RECORD_BYTES
        self.count(peer, nbytes, nbytes)
        self.count(other, nbytes, nbytes)
        merge(peer.sample, {**theirs, other.pid: now}, other.pid, peer.pid)
        merge(other.sample, {**mine, peer.pid: now}, peer.pid, other.pid)
        other.view = list(other.sample)

    def _offer(self, peer: Peer, to: str) -> dict[str, float]:
        pids = [pid for pid in peer.sample if pid != to]
        chosen = self.sim.rng.sample(pids, min(SHUFFLE, len(pids)))
        return {pid: peer.sample[pid][0] for pid in chosen}

    def failed(self, peer: Peer, pid: str) -> None:
        super().failed(peer, pid)
        peer.sample.pop(pid, None)
        peer.view = list(peer.sample)


def merge(sample: dict[str, tuple[float, str]], offered: dict[str, float], source: str, me: str) -> None:
    """Add ``offered`` (pid -> when it was last seen alive) from ``source`` to ``sample`` and keep the
    ``SAMPLE`` freshest entries, at most ``SAMPLE // 4`` of them from any one source other than the
    DHT's shard reads: one partner's word cannot fill a sample."""
    for pid, seen in offered.items():
        if pid != me and (pid not in sample or sample[pid][0] < seen):
            sample[pid] = (seen, source)
    per_source: dict[str, int] = {}
    kept: dict[str, tuple[float, str]] = {}
    for pid, (seen, src) in sorted(sample.items(), key=lambda item: -item[1][0]):
        if len(kept) >= SAMPLE:
            break
        if src != "dht" and per_source.get(src, 0) >= SAMPLE // 4:
            continue
        per_source[src] = per_source.get(src, 0) + 1
        kept[pid] = (seen, src)
    sample.clear()
    sample.update(kept)


class ShardView(Views):
    name = "shards"

    def __init__(self, sim: Host) -> None:
        super().__init__(sim)
        self.shards = shard_count(sim.cfg.peers)
        self._members: list[list[Peer]] = [[] for _ in range(self.shards)]
        self._views: dict[str, MemberView] = {}

    def add(self, peer: Peer) -> None:
        self._members[shard_of(peer.pid, self.shards)].append(peer)

    def start(self, peer: Peer, joining: bool) -> None:
        self._views[peer.pid] = MemberView.for_run(self.shards, self.sim.cfg.view_refresh_s, self.sim.rng)
        self.read(peer)

    def refresh(self, peer: Peer) -> None:
        self.count(peer, REPLICAS * RECORD_BYTES, 0)
        self.read(peer)

    def read(self, peer: Peer) -> None:
        """The product's refresh: the next shards of the rotation, each a lookup and its records."""
        view, now = self._views[peer.pid], self.sim.clock.now
        read: dict[int, list[Member] | None] = {}  # no shard at some refreshes: the view is kept
        for shard in view.next_shards():
            found = [p.pid for p in self._members[shard] if self.listed(p)]
            got = len(found) * RECORD_BYTES
            self.count(peer, REQUEST_BYTES, lookup_bytes(self.sim.cfg.peers) + got)
            self.serve(f"shard-{shard}", got)
            # a record read now lives on for about the rest of its lifetime: half of it, on average
            expires = now + self.sim.cfg.record_ttl_s - self.sim.cfg.view_refresh_s / 2
            read[shard] = [Member(pid, None, expires) for pid in found]  # type: ignore[arg-type]
        view.update(read, now)
        peer.view = [m.peer_id for m in view.members(now) if m.peer_id != peer.pid]

    def failed(self, peer: Peer, pid: str) -> None:
        super().failed(peer, pid)
        peer.view = [p for p in peer.view if p != pid]


class LookupView(Views):
    name = "lookup"

    def __init__(self, sim: Host) -> None:
        super().__init__(sim)
        self._peers: list[Peer] = []
        self._index: dict[str, int] = {}
        self._ids = np.zeros(0, dtype=np.uint64)
        self._died = np.zeros(0)
        self._self_reads: dict[str, int] = {}

    def add(self, peer: Peer) -> None:
        self._index[peer.pid] = len(self._peers)
        self._peers.append(peer)
        self._ids = np.append(self._ids, np.uint64(node_id(peer.pid)))
        self._died = np.append(self._died, np.inf)

    def start(self, peer: Peer, joining: bool) -> None:
        peer.fingers = {}
        self.locate(peer)

    def left(self, peer: Peer) -> None:
        self._died[self._index[peer.pid]] = self.sim.clock.now

    def refresh(self, peer: Peer) -> None:
        self._self_reads[peer.pid] = self._self_reads.get(peer.pid, 0) + 1
        if self._self_reads[peer.pid] % SELF_EVERY == 0:
            self.locate(peer)
        finger = peer.fingers.get(peer.round % peer.dims)
        if finger is not None:  # ping the next round's partner: a dead one is looked up again
            self.count(peer, 2 * REQUEST_BYTES, 2 * REQUEST_BYTES)
            if not self.sim.peers[finger[0]].alive:
                del peer.fingers[peer.round % peer.dims]
        peer.view = self.candidates(peer)

    def _visible(self, exclude: str) -> np.ndarray:
        """Which nodes a lookup can return now: joined, and not yet evicted (a dead node stays in
        routing tables until a request to it fails: one refresh interval)."""
        visible = self._died > self.sim.clock.now - self.sim.cfg.view_refresh_s
        if exclude in self._index:
            visible[self._index[exclude]] = False
        return visible

    def nearest(self, target: int, exclude: str, count: int = 1) -> list[str]:
        visible = self._visible(exclude)
        if not visible.any():
            return []
        index = np.flatnonzero(visible)
        dist = self._ids[index] ^ np.uint64(target)
        best = index[np.argsort(dist, kind="stable")[:count]]
        return [self._peers[i].pid for i in best]

    def locate(self, peer: Peer) -> None:
        """A lookup of our own id: the nearest nodes (fallbacks) and the estimate of N behind ``d``."""
        n = int(self._visible(peer.pid).sum()) + 1
        self.count(peer, 0, lookup_bytes(n))
        me = node_id(peer.pid)
        near = self.nearest(me, peer.pid, BUCKET)
        peer.neighbours = near
        if len(near) < BUCKET:
            estimate = len(near) + 1.0
        else:
            estimate = BUCKET * 2.0**64 / max(1, node_id(near[-1]) ^ me)
        peer.dims = max(1, round(math.log2(max(2.0, estimate))))

    def scheduled(self, peer: Peer) -> str | None:
        k = peer.round % peer.dims
        now = self.sim.clock.now
        cached = peer.fingers.get(k)
        if cached is not None and now - cached[1] < FINGER_TTL_S:
            return cached[0]
        n = int(self._visible(peer.pid).sum()) + 1
        self.count(peer, 0, lookup_bytes(n))
        found = self.nearest(node_id(peer.pid) ^ (1 << (63 - k)), peer.pid)
        if not found:
            return None
        peer.fingers[k] = (found[0], now)
        return found[0]

    def pushes(self, peer: Peer, partner: str) -> bool:
        later_pushes = (peer.round // peer.dims) % 2 == 1
        return (node_id(partner) < node_id(peer.pid)) == later_pushes

    def candidates(self, peer: Peer) -> list[str]:
        fingers = [pid for pid, _ in peer.fingers.values()]
        return list(dict.fromkeys(fingers + peer.neighbours))

    def failed(self, peer: Peer, pid: str) -> None:
        super().failed(peer, pid)
        peer.fingers = {k: f for k, f in peer.fingers.items() if f[0] != pid}
        peer.neighbours = [p for p in peer.neighbours if p != pid]


def make_views(kind: str, sim: Host) -> Views:
    """The design ``kind`` (one of :data:`KINDS`) for ``sim``."""
    designs = {"full": FullView, "sample": SampleView, "shards": ShardView, "lookup": LookupView}
    if kind not in designs:
        raise ValueError(f"unknown view {kind!r}: {', '.join(KINDS)}")
    return designs[kind](sim)
