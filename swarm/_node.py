"""A peer on the network: DHT + p2p daemon, signed identity, periodic membership announcements.

:class:`SwarmNode` is what every program (bootstrap, trainer, monitor) opens first. It owns the
processes it starts (the DHT's worker process and its ``p2pd``) and stops them in :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import shutil
import time
from collections.abc import Callable
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import get_dht_time

from swarm import __version__
from swarm.membership import (
    PROTOCOL_VERSION,
    Announcer,
    Member,
    MemberView,
    PeerRecord,
    PeerRole,
    Reachability,
    list_members,
    membership_validators,
    read_shards,
    record_key,
    shard_of,
)
from swarm.network import (
    ANNOUNCED_LOOKUP_TIMEOUT_S,
    NetworkOptions,
    ReachabilityChecker,
    ReachabilityResult,
    check_reachability,
    connect_out,
    load_identity,
    rejoin_initial_peers,
    start_dht,
)
from swarm.p2p import note_relay_addresses, split_circuit, trust_relays

logger = logging.getLogger(__name__)

REJOIN_EVERY_S = 20.0
"""How often a peer pings the initial peers its DHT routing table lost (see :meth:`SwarmNode._rejoin`)."""


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """The static part of this peer's record."""

    run_id: str
    config_hash: str
    role: PeerRole
    public_name: str = ""
    device: str = "cpu"
    device_memory_gb: float = 0.0
    member_shards: int = 1
    """``run.member_shards``: how many DHT keys the run's records are spread over."""


class SwarmNode:
    """One peer's presence in a run.

    :param status: called at each announcement; returns the dynamic record fields (state, step, loss,
        samples_per_s, byte counters, ...). Unknown keys raise, so a typo cannot go unnoticed.
    :param announce: whether to publish a record at all (a monitor only reads). An announcing peer
        that is not in client mode also answers other members' reachability checks.
    """

    def __init__(
        self,
        network: NetworkOptions,
        info: NodeInfo,
        *,
        status: Callable[[], dict[str, Any]] | None = None,
        announce: bool = True,
        record_interval_s: float = 3.0,
        record_ttl_s: float = 10.0,
    ):
        self.info, self.network = info, network
        self._record_interval_s = record_interval_s
        identity_path = network.resolved_identity_path()
        self._identity_key = load_identity(identity_path)
        self._signer = RSASignatureValidator(self._identity_key)
        self._status = status or (lambda: {})
        self._started_at = time.time()
        self._client_mode = network.client_mode
        self._relay_addresses: list[str] = []
        self.reachability: Reachability = "client" if network.client_mode else "unknown"
        self._checker: ReachabilityChecker | None = None
        self._view: MemberView | None = None  # made by the first recent_members(): peers that pick partners
        self._next_rejoin = time.monotonic() + REJOIN_EVERY_S
        self._rejoining: Any = None  # the pings in flight (an MPFuture of how many answered)
        self._connecting: Any = None  # connections out to direct members, while relayed (an MPFuture)
        try:
            self.dht = start_dht(network, identity_path, membership_validators(info.run_id, self._signer))
        finally:
            if network.identity_path is None:  # the daemon has read the throwaway key; drop it
                shutil.rmtree(identity_path.parent, ignore_errors=True)
        self.peer_id: str = self.dht.peer_id.to_base58()
        self._announcer: Announcer | None = None
        if announce:
            self._announcer = Announcer(
                self.dht,
                record_key(info.run_id, shard_of(self.peer_id, info.member_shards)),
                self._signer,
                self.record,
                interval_s=record_interval_s,
                ttl_s=record_ttl_s,
                after=self._after_announcing,
            )
            try:
                if not self._client_mode:  # answer checks before others can see our record
                    self._checker = ReachabilityChecker(self._announced_addresses, self.dht, info.run_id)
                self._announcer.start()
            except BaseException:
                self.close()
                raise

    @property
    def signer(self) -> RSASignatureValidator:
        """The validator holding this peer's identity key; it signs everything the peer stores in the DHT."""
        return self._signer

    @property
    def identity_key(self) -> RSAPrivateKey:
        """This peer's identity key (fixes its peer id; signs its DHT records)."""
        return self._identity_key

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with ``/p2p/<peer id>``) at which other peers can reach this one."""
        return [str(maddr) for maddr in self.dht.get_visible_maddrs()]

    def record(self) -> PeerRecord:
        """This peer's current record: static info plus whatever ``status`` reports now."""
        return PeerRecord(
            peer_id=self.peer_id,
            protocol_version=PROTOCOL_VERSION,
            package_version=__version__,
            config_hash=self.info.config_hash,
            public_name=self.info.public_name,
            role=self.info.role,
            device=self.info.device,
            device_memory_gb=float(self.info.device_memory_gb),
            client_mode=self._client_mode,
            addresses=self._announced_maddrs(),
            reachability=self.reachability,
            started_at=self._started_at,
            **self._status(),
        )

    def _announced_maddrs(self) -> list[str]:
        if self._client_mode:
            return []
        return (self._relay_addresses or self.visible_maddrs())[:16]

    def announce_now(self) -> None:
        """Publish the current record at once (e.g. right after the state it describes changed)."""
        if self._announcer is not None:
            self._announcer.announce_now()

    def announce_soon(self) -> None:
        """Publish the current record in the background, soon: for the training thread, which must
        not wait on the DHT (``announce_now`` blocks until a DHT node accepted the record)."""
        if self._announcer is not None:
            self._announcer.announce_soon()

    @property
    def client_mode(self) -> bool:
        """Whether this peer only dials out (configured, or switched to after a failed reachability check)."""
        return self._client_mode

    def check_reachability(self, max_checkers: int = 3) -> ReachabilityResult:
        """Ask up to ``max_checkers`` other live members to dial this peer back at its announced addresses.

        ``direct``: some checker reached us, the record says so. ``relay`` (checkers answered, none
        reached us; ``network.behind_nat``, with initial peers): the record announces our
        ``/p2p-circuit`` addresses through the initial peers, which forward streams to us
        (:mod:`swarm.p2p._forward`), and says ``reachability: relay``; we keep serving.
        ``unreachable`` (the same without relays): this node switches to client mode, so its record
        lists no addresses and nobody picks it as a partner; components that serve (gossip averagers,
        state server) must be switched by their owner. ``skipped``: no other member to ask (or already
        in client mode or relayed); ``unknown``: nobody answered. Both leave the record as it was.
        """
        if self._client_mode or self._relay_addresses:
            return ReachabilityResult("skipped")
        addresses = self.visible_maddrs()[:16]
        checkers = [
            m.peer_id
            for m in self.members()
            if m.peer_id != self.peer_id
            and not m.record.client_mode
            and m.record.addresses
            and m.record.protocol_version == PROTOCOL_VERSION
        ]
        if not checkers:
            logger.info("no other member to check reachability with: skipped")
            return ReachabilityResult("skipped", tuple(addresses))
        random.shuffle(checkers)
        self.announce_now()  # checkers compare our request with the addresses in our stored record
        run_id = self.info.run_id
        result = check_reachability(self.dht, run_id, checkers, addresses, max_checkers=max_checkers)
        logger.info("reachability check: %s (errors: %s)", result.status, "; ".join(result.errors) or "none")
        if result.status == "direct":
            self.reachability = "direct"
        elif result.unreachable and (relayed := self._relay_candidates()):
            self._relay_addresses, self.reachability = relayed, "relay"
            result = dataclasses.replace(result, status="relay", relay_addresses=tuple(relayed))
        elif result.unreachable:
            self.enter_client_mode()
        self.announce_now()
        return result

    def _relay_candidates(self) -> list[str]:
        """Our circuit addresses through the initial peers, which forward streams to us, if we are
        ``network.behind_nat`` (:mod:`swarm.p2p._forward`); from now on we serve what they forward."""
        if not self.network.behind_nat:
            return []
        addresses = [
            a for a in self.network.relay_addresses(self.peer_id) if f"/p2p/{self.peer_id}/" not in a
        ]
        relays = [split_circuit(a) for a in addresses]
        trust_relays(relay_id for _, relay_id in filter(None, relays))
        return addresses

    def enter_client_mode(self) -> None:
        """From now on announce ``client_mode=True`` with no addresses, and stop answering checks."""
        self._client_mode, self.reachability, self._relay_addresses = True, "client", []
        if self._checker is not None:
            self._checker.close()
            self._checker = None

    def _announced_addresses(self, peer_id: str) -> list[str] | None:
        """The addresses in ``peer_id``'s live record (for the checks we answer); None without one."""
        run_id, shards = self.info.run_id, self.info.member_shards
        own = [shard_of(peer_id, shards)]
        for member in list_members(
            self.dht, run_id, member_shards=shards, shards=own, timeout_s=ANNOUNCED_LOOKUP_TIMEOUT_S
        ):
            if member.peer_id == peer_id:
                return list(member.record.addresses) or None
        return None

    def observe_run(self, run_id: str, config_hash: str, member_shards: int = 1) -> None:
        """Read run ``run_id`` from now on (a node that does not announce, opened before it knew the run,
        e.g. a monitor that found the run through its initial peers): that run's record validators are
        added to the DHT, and :meth:`members` reads its members. Saves starting a second DHT."""
        if self._announcer is not None:
            raise RuntimeError("an announcing node cannot change its run")
        if run_id != self.info.run_id:
            self.dht.add_validators(membership_validators(run_id, self._signer))
        self.info = dataclasses.replace(
            self.info, run_id=run_id, config_hash=config_hash, member_shards=member_shards
        )

    def members(self) -> list[Member]:
        """The live members of this run (every shard of it, read at once), this peer included once its
        record is stored. For a whole view taken once (a monitor, a joiner choosing donors); a trainer's
        rounds use :meth:`recent_members`, whose reads stay bounded as the run grows.

        The circuit addresses of relayed members are noted for :func:`swarm.p2p.dial`, which reaches
        them through those relays.
        """
        members = list_members(self.dht, self.info.run_id, member_shards=self.info.member_shards)
        self._note_relays(members)
        return members

    def _note_relays(self, members: list[Member]) -> None:
        for member in members:
            if member.peer_id != self.peer_id:
                note_relay_addresses(member.peer_id, member.record.addresses)

    def recent_members(self) -> list[Member]:
        """This peer's view of the live members (:class:`~swarm.membership.MemberView`), as the announcer
        thread last refreshed it, right after its last announcement (every record interval, and after
        :meth:`announce_soon`); the first call reads it here.

        For the training thread, which must not wait on a DHT lookup after every round; the view is at
        most one record interval old. With one member shard it is the whole list; with more, the
        members of the shards read within one record lifetime.
        """
        if self._view is None:  # from now on the announcer thread keeps it current
            self._view = MemberView.for_run(self.info.member_shards, self._record_interval_s)
            self._read_view(self._view)
        return self._view.members(get_dht_time())

    def _read_view(self, view: MemberView) -> None:
        shards = view.next_shards()
        if not shards:
            return
        read = read_shards(self.dht, self.info.run_id, view.shards, shards, latest=view.latest)
        view.update(read, get_dht_time())
        self._note_relays([m for found in read.values() for m in found or ()])

    def _after_announcing(self) -> None:
        """On the announcer's thread, after each periodic announcement."""
        self._read_members()
        if self._relay_addresses:
            self._connect_out()
        if self.network.initial_peers and time.monotonic() >= self._next_rejoin:
            self._next_rejoin = time.monotonic() + REJOIN_EVERY_S
            self._rejoin()

    def _read_members(self) -> None:
        view = self._view
        if view is not None:  # only for nodes that use the view (not bootstraps, monitors)
            self._read_view(view)

    def _connect_out(self) -> None:
        """While relayed: connect out to the direct members, so that their streams to us need no relay
        (:func:`swarm.network.connect_out`). One batch of connects at a time, from the latest member list."""
        pending = self._connecting
        if pending is not None and not pending.done():
            return
        members = self._view.members(get_dht_time()) if self._view is not None else []
        direct = {
            m.peer_id: list(m.record.addresses)
            for m in members
            if m.record.reachability == "direct" and not m.record.client_mode
        }
        self._connecting = connect_out(self.dht, direct, return_future=True) if direct else None

    def _rejoin(self) -> None:
        """Get the initial peers back into our DHT routing table if it lost them (a healed partition).

        The pings run in the DHT process while we go on announcing; their outcome is read at the next
        call, which starts no new pings while the last ones are still out.
        """
        pending = self._rejoining
        if pending is not None:
            if not pending.done():
                return
            self._rejoining = None
            try:
                answered = pending.result()
            except Exception as exc:
                logger.info("could not ping the initial peers: %s: %s", type(exc).__name__, exc)
            else:
                if answered:
                    logger.info("reached %d initial peer(s) our DHT had lost: rejoined the swarm", answered)
        self._rejoining = rejoin_initial_peers(self.dht, self.network.initial_peers, return_future=True)

    def close(self) -> None:
        """Stop announcing and answering checks, and shut down the DHT process and its p2p daemon."""
        if self._checker is not None:
            self._checker.close()
            self._checker = None
        if self._announcer is not None:
            self._announcer.stop()
            self._announcer = None
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None

    def __enter__(self) -> SwarmNode:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
