"""The outer loop's two exchanges: averaging pseudo-gradients, and the occasional parameter exchange.

Every exchange here is *initiator-applies*: the peer that starts a sync uses the result; a peer
that is dialled only contributes what it currently serves (its live pseudo-gradient, or a copy of
its anchor) and keeps training. Its served copy may be mixed by the averager, but it is replaced
by a fresh one after the next inner step, so nothing a partner does ever touches a peer's model
outside that peer's own sync. Information still flows both ways because every peer initiates on
its own schedule.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swarm.config import RunConfig
from swarm.gossip import GossipAverager, PartnerInfo, SyncOutcome, SyncResult
from swarm.training import OuterOptimizer

logger = logging.getLogger(__name__)

PartnerSource = Callable[[], Sequence[PartnerInfo]]


def make_averager(
    config: RunConfig,
    dht: object,
    partners: PartnerSource,
    *,
    suffix: str = "",
    codec: str | None = None,
    client_mode: bool | None = None,
    respect_bans_of: GossipAverager | None = None,
) -> GossipAverager:
    """A gossip averager configured from the run config; ``suffix`` separates independent exchanges.

    ``client_mode`` overrides ``network.client_mode`` (a peer that nobody could dial back);
    ``respect_bans_of`` makes this averager honour another one's bans (docs/gossip.md)."""
    avg, comp = config.averaging, config.compression
    return GossipAverager(
        run_id=config.run.run_id + suffix,
        dht=dht,
        partner_source=partners,
        config_hash=config.config_hash(),
        codec=codec or comp.codec,
        block_size=comp.block_size,
        chunk_bytes=comp.chunk_bytes,
        error_feedback=comp.error_feedback,
        exchange_timeout_s=avg.exchange_timeout_s,
        chunk_timeout_s=avg.chunk_timeout_s,
        max_norm_ratio=avg.max_norm_ratio,
        ban_base_s=avg.ban_base_s,
        ban_max_s=avg.ban_max_s,
        # pseudo-gradients only: the parameter exchange adopts a partner's state and measures drift
        robust_clip=avg.robust_clip and not suffix,
        clip_ratio=avg.clip_ratio,
        clip_hard_factor=avg.clip_hard_factor,
        clip_strikes=avg.clip_strikes,
        respect_bans_of=respect_bans_of,
        client_mode=config.network.client_mode if client_mode is None else client_mode,
    )


@dataclass(frozen=True)
class ParamSyncResult:
    """Outcome of a full-parameter exchange; ``drift`` is the relative distance to the partner before it."""

    result: SyncResult
    drift: float | None


class OuterSync:
    """Pseudo-gradient averaging followed by the outer step, plus drift measurement and correction.

    :param deltas: averager for pseudo-gradients (the configured, usually quantized, codec).
    :param params: averager for full parameters (``averaging.param_codec``, usually fp32).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        outer: OuterOptimizer,
        deltas: GossipAverager | None,
        params: GossipAverager | None,
    ):
        self.model, self.outer, self.deltas, self.params = model, outer, deltas, params

    def serve_current(self, weight: float) -> None:
        """Offer this peer's live pseudo-gradient to partners that dial in (called after each inner step)."""
        if self.deltas is not None:
            self.deltas.set_tensors(self.outer.pseudo_gradient(), weight=max(weight, 1e-9))

    def serve_anchor(self) -> None:
        """Offer a copy of the anchor for partners' parameter exchanges (after each outer step)."""
        if self.params is not None:
            self.params.set_tensors(_copy(self.outer.anchor), weight=1.0)

    def step(self, weight: float) -> SyncResult | None:
        """Average the pseudo-gradient with one partner (or keep our own), then take the outer step."""
        pseudo_gradient = self.outer.pseudo_gradient()
        result = None
        if self.deltas is not None:
            result = self.deltas.sync(pseudo_gradient, weight=max(weight, 1e-9))
            if result.outcome is not SyncOutcome.OK:
                logger.info(
                    "sync without a partner (%s): outer step on our own pseudo-gradient", result.outcome
                )
        self.outer.apply(pseudo_gradient)
        self.serve_anchor()
        return result

    def exchange_parameters(self, *, adopt_partner: bool = False) -> ParamSyncResult | None:
        """Average parameters with one partner and move our model there; measure the drift on the way.

        With ``adopt_partner`` (a fresh joiner) our weight is negligible, so we take the partner's
        parameters; otherwise both count equally.
        """
        if self.params is None:
            return None
        before = _copy(self.outer.anchor)
        mixed = _copy(before)
        weight = 1e-9 if adopt_partner else 1.0
        result = self.params.sync(mixed, weight=weight)
        if result.outcome is not SyncOutcome.OK:
            return ParamSyncResult(result, None)
        # After a committed exchange our weight is the pair's mean, which gives the partner's weight.
        partner_weight = max(2 * result.weight - weight, 0.0)
        partner_share = partner_weight / (partner_weight + weight)
        drift = _relative_distance(before, mixed) / max(partner_share, 1e-12)
        self._move_to(mixed)
        return ParamSyncResult(result, drift)

    @torch.no_grad()
    def _move_to(self, parameters: dict[str, torch.Tensor]) -> None:
        for name, param in self.model.named_parameters():
            param.copy_(parameters[name])
        self.outer.reset_anchor()
        self.serve_anchor()


def _copy(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tensors.items()}


def _relative_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    diff = sum(float((a[n] - b[n]).double().pow(2).sum()) for n in a)
    norm = sum(float(a[n].double().pow(2).sum()) for n in a)
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-12)
