"""The gossip trainer's own exchanges, off the training thread.

:class:`SyncWorker` runs one round's exchanges in a background thread when the training thread asks
for it, so that round ``r``'s exchange overlaps round ``r + 1``'s inner steps; its results come back
through :class:`~swarm.trainer._live.LiveModel`'s queue. :func:`make_averager` configures a gossip
averager from the run config.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from swarm.config import RunConfig
from swarm.gossip import GossipAverager, Offerer, PartnerInfo

if TYPE_CHECKING:
    from hivemind.dht import DHT

logger = logging.getLogger(__name__)

PartnerSource = Callable[[], Sequence[PartnerInfo]]


def make_averager(
    config: RunConfig,
    dht: DHT,
    partners: PartnerSource,
    offerer: Offerer,
    *,
    suffix: str = "",
    namespace: str = "",
    codec: str | None = None,
    client_mode: bool | None = None,
    respect_bans_of: GossipAverager | None = None,
    with_anchor: bool = False,
    models: bool = False,
    preferred_partner: Callable[[], str | None] | None = None,
) -> GossipAverager:
    """A gossip averager in offer mode, configured from the run config; ``suffix`` separates
    independent exchanges (``.params`` for the anchors), ``namespace`` a group of peers that averages
    on its own (``.stage<k>`` for a pipeline stage).

    ``client_mode`` overrides ``network.client_mode`` (a peer that nobody could dial back);
    ``respect_bans_of`` makes this averager honour another one's bans and share its exchange lock
    (docs/gossip.md); ``with_anchor`` makes every exchange carry the offer's anchor as its companion
    part, in ``param_codec`` and clipped by ``param_clip_ratio`` (``averaging.anchor_pull: folded``);
    ``models``: the exchange averages parameters (``averaging.exchange: model``), clipped by
    ``param_clip_ratio`` like anchors, and relative to a base the pair shares in
    ``compression.delta_codec`` (docs/gossip.md, "Nothing waits on the full model");
    ``preferred_partner``: the schedule's partner, dialled first."""
    avg, comp = config.averaging, config.compression
    return GossipAverager(
        run_id=config.run.run_id + namespace + suffix,
        dht=dht,
        partner_source=partners,
        offerer=offerer,
        config_hash=config.config_hash(),
        codec=codec or comp.codec,
        block_size=comp.block_size,
        chunk_bytes=comp.chunk_bytes,
        # anchors: the mass-conserving mix keeps the pair's sum exact, and a residual would cost 4 bytes
        # per parameter for an exchange that runs every few rounds
        error_feedback=comp.error_feedback and not suffix,
        exchange_timeout_s=avg.exchange_timeout_s,
        max_exchange_timeout_s=avg.max_exchange_timeout_s,
        chunk_timeout_s=avg.chunk_timeout_s,
        max_norm_ratio=avg.max_norm_ratio,
        ban_base_s=avg.ban_base_s,
        ban_max_s=avg.ban_max_s,
        # anchors are clipped relative to the parameters' norm, so by a much smaller ratio
        robust_clip=avg.robust_clip,
        clip_ratio=avg.param_clip_ratio if suffix or models else avg.clip_ratio,
        # a model offer is judged against our progress since the anchor, like a pseudo-gradient
        blame_ratio=avg.clip_ratio if models else None,
        clip_hard_factor=avg.clip_hard_factor,
        clip_strikes=avg.clip_strikes,
        respect_bans_of=respect_bans_of,
        # one exchange of either kind at a time: their buffers never add up, and the CPU work neither
        exclusive_with=respect_bans_of,
        companion_codec=avg.param_codec if with_anchor else None,
        # a round's model exchange goes relative to the base its pair shares, when it shares one
        delta_codec=comp.delta_codec if models else None,
        companion_clip_ratio=avg.param_clip_ratio,
        client_mode=config.network.client_mode if client_mode is None else client_mode,
        preferred_partner=preferred_partner,
    )


class SyncWorker:
    """Runs ``job()`` in a background thread each time :meth:`request` is called while idle."""

    def __init__(self, job: Callable[[], None], name: str = "gossip-sync") -> None:
        self._job = job
        self._wake = threading.Condition()
        self._requested = False
        self._running = False
        self._stopped = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def request(self) -> bool:
        """Start a job unless one is queued or running; returns whether this call started one."""
        with self._wake:
            if self._requested or self._running or self._stopped:
                return False
            self._requested = True
            self._wake.notify_all()
            return True

    @property
    def busy(self) -> bool:
        with self._wake:
            return self._requested or self._running

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no job is queued or running; False if ``timeout`` passed first."""
        with self._wake:
            return self._wake.wait_for(lambda: not (self._requested or self._running), timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Let a running job finish (abort the averagers first to make it quick), then end the thread."""
        with self._wake:
            self._stopped = True
            self._requested = False
            self._wake.notify_all()
        self._thread.join(timeout)

    def _main(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._requested or self._stopped)
                if self._stopped:
                    return
                self._requested, self._running = False, True
            try:
                self._job()
            except Exception:
                logger.exception("a background sync failed")
            finally:
                with self._wake:
                    self._running = False
                    self._wake.notify_all()
