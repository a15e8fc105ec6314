"""A peer on the network: DHT + p2p daemon, signed identity, periodic membership announcements.

:class:`SwarmNode` is what every program (bootstrap, trainer, monitor) opens first. It owns the
processes it starts (the DHT's worker process and its ``p2pd``) and stops them in :meth:`close`.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Callable
from typing import Any

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from swarm import __version__
from swarm.membership import (
    PROTOCOL_VERSION,
    Announcer,
    Member,
    PeerRecord,
    list_members,
    membership_validators,
)
from swarm.network import NetworkOptions, load_identity, start_dht

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    """The static part of this peer's record."""

    run_id: str
    config_hash: str
    role: str
    public_name: str = ""
    device: str = "cpu"
    device_memory_gb: float = 0.0


class SwarmNode:
    """One peer's presence in a run.

    :param status: called at each announcement; returns the dynamic record fields (state, step, loss,
        samples_per_s, byte counters, ...). Unknown keys raise, so a typo cannot go unnoticed.
    :param announce: whether to publish a record at all (a monitor only reads).
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
        identity_path = network.resolved_identity_path()
        self._identity_key = load_identity(identity_path)
        self._signer = RSASignatureValidator(self._identity_key)
        self._status = status or (lambda: {})
        self._started_at = time.time()
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
                info.run_id,
                self._signer,
                self.record,
                interval_s=record_interval_s,
                ttl_s=record_ttl_s,
            )
            try:
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
            client_mode=self.network.client_mode,
            addresses=[] if self.network.client_mode else self.visible_maddrs()[:16],
            reachability="client" if self.network.client_mode else "unknown",
            started_at=self._started_at,
            **self._status(),
        )

    def announce_now(self) -> None:
        """Publish the current record at once (e.g. right after the state it describes changed)."""
        if self._announcer is not None:
            self._announcer.announce_now()

    def members(self) -> list[Member]:
        """The live members of this run, this peer included once its record is stored."""
        return list_members(self.dht, self.info.run_id)

    def close(self) -> None:
        """Stop announcing and shut down the DHT process and its p2p daemon."""
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
