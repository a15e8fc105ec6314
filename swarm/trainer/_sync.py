"""The gossip trainer's own exchanges, off the training thread.

:class:`SyncWorker` runs one round's exchanges in a background thread when the training thread asks
for it, so that round ``r``'s exchange overlaps round ``r + 1``'s inner steps; its results come back
through :class:`~swarm.trainer._live.LiveModel`'s queue. :func:`make_averager` configures a gossip
averager from the run config.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarm.config import RunConfig
from swarm.gossip import GossipAverager, GossipOptions, Offerer

if TYPE_CHECKING:
    from hivemind.dht import DHT

logger = logging.getLogger(__name__)


def make_averager(
    config: RunConfig,
    dht: DHT,
    offerer: Offerer,
    *,
    suffix: str = "",
    namespace: str = "",
    codec: str | None = None,
    client_mode: bool | None = None,
    respect_bans_of: GossipAverager | None = None,
) -> GossipAverager:
    """A gossip averager, configured from the run config; ``suffix`` separates independent exchanges
    (``.params`` for the anchors), ``namespace`` a group of peers that averages on its own
    (``.stage<k>`` for a pipeline stage).

    ``client_mode`` overrides ``network.client_mode`` (a peer that nobody could dial back);
    ``respect_bans_of`` makes this averager honour another one's bans and share its exchange lock
    (docs/gossip.md). The model averager
    (no suffix) sends relative to a base the pair shares in ``compression.delta_codec`` (docs/gossip.md,
    "Nothing waits on the full model")."""
    return GossipAverager(
        run_id=config.run.run_id + namespace + suffix,
        dht=dht,
        offerer=offerer,
        options=gossip_options(config, codec=codec, anchors=bool(suffix)),
        config_hash=config.config_hash(),
        respect_bans_of=respect_bans_of,
        # one exchange of either kind at a time: their buffers never add up, and the CPU work neither
        exclusive_with=respect_bans_of,
        client_mode=config.network.client_mode if client_mode is None else client_mode,
    )


def gossip_options(config: RunConfig, *, codec: str | None = None, anchors: bool = False) -> GossipOptions:
    """The run config's averaging and compression sections as an averager's options; ``anchors``: the
    anchor averager's (no error feedback, no bases)."""
    avg, comp = config.averaging, config.compression
    return GossipOptions(
        codec=codec or comp.codec,
        block_size=comp.block_size,
        chunk_bytes=comp.chunk_bytes,
        # anchors: the mass-conserving mix keeps the pair's sum exact, and a residual would cost 4 bytes
        # per parameter for an exchange that only serves joiners
        error_feedback=comp.error_feedback and not anchors,
        exchange_timeout_s=avg.exchange_timeout_s,
        max_exchange_timeout_s=avg.max_exchange_timeout_s,
        chunk_timeout_s=avg.chunk_timeout_s,
        max_norm_ratio=avg.max_norm_ratio,
        ban_base_s=avg.ban_base_s,
        ban_max_s=avg.ban_max_s,
        robust_clip=avg.robust_clip,
        # models and anchors are clipped relative to the parameters' norm, so by a small ratio
        clip_ratio=avg.param_clip_ratio,
        # a model offer is judged against our progress since the anchor
        blame_ratio=None if anchors else avg.clip_ratio,
        clip_hard_factor=avg.clip_hard_factor,
        clip_strikes=avg.clip_strikes,
        # a round's model exchange goes relative to the base its pair shares, when it shares one
        delta_codec=None if anchors else comp.delta_codec,
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
