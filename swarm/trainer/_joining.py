"""A trainer's state as donors serve it, and how a joiner takes it over: a download
(:func:`download_swarm_state`), or else a live partner's anchor (:func:`adopt_a_partner`).

Every trainer publishes, after an outer step, what a newcomer needs: the anchor parameters, the
outer momentum and its progress counters, spooled to disk in bf16 (:func:`snapshot_of`); the state's
digest goes into its membership record (``state_hash``). It publishes a new one only once its server
has let the one before go (:func:`publish_state`), so a digest its records name stays served. A
joiner takes the state a trusted initial peer announces, or the coordinate-wise median of at least
three distinct donors' states, and verifies every frame against the announced digests
(:func:`swarm.state.download_state`; see docs/state-sync.md).

Which members to download from (:func:`~swarm.state.choose_donors`) and the check of a donor's
progress counters (:func:`~swarm.state.progress_of`) live in :mod:`swarm.state` with the bootstrap's
copy of the state (:class:`~swarm.state.StateMirror`); they are re-exported here for the trainer.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from swarm.compression import DecodeLimits
from swarm.gossip import SyncOutcome
from swarm.learning import OuterOptimizer, all_finite
from swarm.state import (
    ServedState,
    StateServer,
    StateSnapshot,
    StateTransferError,
    choose_donors,
    download_state,
    initial_peer_ids,
    progress_of,
    spool_state,
)
from swarm.trainer._backend import JoinResult
from swarm.trainer._offers import ANCHOR_WEIGHT
from swarm.trainer._progress import Progress
from swarm.trainer._schedule import trainer_partners

if TYPE_CHECKING:
    from swarm._node import SwarmNode
    from swarm.gossip import GossipAverager
    from swarm.membership import Member
    from swarm.trainer._live import LiveModel
    from swarm.trainer._offers import AnchorOffers

__all__ = [
    "adopt",
    "adopt_a_partner",
    "choose_donors",
    "download_swarm_state",
    "other_trainers",
    "progress_of",
    "publish_state",
    "snapshot_of",
    "state_limits",
]

logger = logging.getLogger(__name__)

JOIN_WEIGHT = 1e-9
"""A joiner's weight in its first anchor exchange: it takes over its partner's parameters."""

_PARAM, _MOMENTUM = "param/", "momentum/"


def snapshot_of(
    outer: OuterOptimizer,
    progress: Progress,
    joined: dict[str, int] | None = None,
    spool_dir: str | None = None,
) -> ServedState:
    """The state a joiner needs, ready to publish: anchor, outer momentum (once it exists) and progress
    counters, encoded in bf16 into a spool file in ``spool_dir`` (:func:`swarm.state.spool_state`;
    default: :func:`swarm.state.default_spool_dir`). Call it where the outer state does not change (the
    training thread); hand the result to ``StateServer.publish``, which closes it when done.

    The tensors are read where they are (GPU or host) one at a time, never copied whole: the host
    holds one tensor's bf16 encoding at a time, then about 100 bytes per 1 MiB frame; the disk 2
    bytes per value (4 per parameter of the model). A joiner receives each value rounded to bf16.
    The counters are the state's: those of the state this peer took over at join (``joined``, the
    donors' meta) plus its own since. A freshly joined peer so serves the swarm's progress, not its
    own round 0 (a bootstrap keeping the state would otherwise go back to round 0 on copying it), and
    until it has trained it serves exactly the state it took over (the same digest). Raises ValueError
    (a non-finite value) or OSError (the disk).
    """
    tensors = {_PARAM + name: t for name, t in outer.anchor.items()}  # references, not copies
    tensors.update({_MOMENTUM + name: t for name, t in outer.momentum_buffers.items()})
    base = joined or {}
    meta: dict[str, Any] = {
        "round": base.get("round", 0) + progress.round,
        "step": base.get("step", 0) + progress.step,
        "samples_total": base.get("samples_total", 0) + progress.samples_total,
    }
    return spool_state(tensors, meta, spool_dir=spool_dir)


def publish_state(
    server: StateServer,
    outer: OuterOptimizer,
    progress: Progress,
    joined: dict[str, int] | None,
    checkpoint_dir: str | None,
) -> str | None:
    """Spool our state (:func:`snapshot_of`) and serve it; its digest, or None when nothing new was
    published: then the previous state stays served and announced.

    Nothing is spooled while the server still keeps the state it replaced last
    (``StateServer.can_publish``): a record of ours may still name that one, or a joiner still reads
    it. So a joiner that asks for a digest read in a record that has not expired is served, the
    donor holds at most two copies on disk, and it publishes at most once per record lifetime (plus
    how long a stream reads a replaced state), not every round. A state that cannot be spooled is
    not published either (the warning says why). The spool goes next to the checkpoints (a disk the
    user chose), else to :func:`swarm.state.default_spool_dir` (not a tmpfs ``/tmp``)."""
    if not server.can_publish():
        logger.debug("keeping the published state: the one it replaced is still announced or read")
        return None
    if not all_finite(outer.anchor.values()):
        logger.warning("not publishing our state: its anchor is not finite (a rollback follows)")
        return None
    spool = None if checkpoint_dir is None else os.path.expanduser(checkpoint_dir)
    try:
        if spool is not None:
            os.makedirs(spool, exist_ok=True)
        state = snapshot_of(outer, progress, joined, spool_dir=spool)
    except (OSError, ValueError) as exc:  # a full disk, or a momentum gone non-finite
        logger.warning("not publishing our state this round (joiners get the previous one): %s", exc)
        return None
    server.publish(state)
    return state.digest


def state_limits(model: torch.nn.Module) -> DecodeLimits:
    """Decode limits for a state of ``model``: a donor cannot make us allocate more than the model
    (parameters plus outer momentum) would take."""
    sizes = [p.numel() for p in model.parameters()]
    return DecodeLimits(
        max_elements=max(sizes, default=1),
        max_tensors=2 * len(sizes) + 1,
        max_total_elements=2 * sum(sizes),
    )


@torch.no_grad()
def adopt(model: torch.nn.Module, outer: OuterOptimizer, snapshot: StateSnapshot) -> None:
    """Load a downloaded snapshot: parameters into the model and anchor, momentum into the outer optimizer.

    It takes the snapshot's tensors over (``snapshot.tensors`` is empty afterwards, or untouched if the
    state does not match the model: ValueError): each parameter's tensor is freed once copied into the
    model, before the new anchor is made, and a momentum tensor already where the outer state lives is
    kept as is. With the outer state in host memory a joiner's host so holds at most 12 bytes per
    parameter of it at once (the download and the old anchor; then the momentum and the old and new
    anchors), never a second copy of the momentum.
    """
    params = dict(model.named_parameters())
    tensors = snapshot.tensors
    received = {name[len(_PARAM) :] for name in tensors if name.startswith(_PARAM)}
    if received != set(params):
        missing, extra = sorted(set(params) - received), sorted(received - set(params))
        raise ValueError(f"donor state does not match this model: missing {missing[:3]}, extra {extra[:3]}")
    for name, param in params.items():
        param.copy_(tensors.pop(_PARAM + name))
    outer.reset_anchor()
    momentum = {key[len(_MOMENTUM) :]: tensors.pop(key) for key in list(tensors) if key.startswith(_MOMENTUM)}
    tensors.clear()
    outer.momentum_buffers = {
        name: t.to(outer.anchor[name].device, torch.float32) for name, t in momentum.items() if name in params
    }


def download_swarm_state(
    node: SwarmNode,
    members: Callable[[], Sequence[Member]],
    model: torch.nn.Module,
    live: LiveModel,
    run_id: str,
    attempts: int = 3,
) -> JoinResult | None:
    """Download the state of a trusted donor (an initial peer, e.g. a ``--serve-state`` bootstrap) or
    the median of at least three distinct donors' (:func:`swarm.state.download_state`) into ``model``
    and ``live``'s outer optimizer; retry with fresh ``members()`` when a donor moved on meanwhile.
    None when neither is there: the caller takes a partner's anchor instead (:func:`adopt_a_partner`)."""
    trusted = initial_peer_ids(node.network.initial_peers)
    for attempt in range(1, attempts + 1):
        donors = choose_donors(list(members()), node.peer_id, trusted=trusted)
        if not donors:
            return None
        try:
            limits = state_limits(model)
            snapshot = download_state(node.dht, donors, run_id=run_id, trusted=trusted, limits=limits)
            progress = progress_of(snapshot.meta)
            with live.lock:
                adopt(model, live.outer, snapshot)
        except (StateTransferError, ValueError) as exc:
            logger.warning("state download attempt %d/%d failed: %s", attempt, attempts, exc)
            continue
        live.reset()
        sources = snapshot.sources
        logger.info("took over the state of %d donor(s), digest %s", len(sources), snapshot.digest[:12])
        return JoinResult(sources, progress, snapshot.digest)
    return None


def adopt_a_partner(
    averager: GossipAverager,
    offers: AnchorOffers,
    live: LiveModel,
    partners: Callable[[], Sequence[Member]],
    attempts: int = 3,
) -> bool:
    """Take a live partner's anchor (and model) through an anchor exchange of ``averager`` at a
    negligible weight. A partner that refuses or fails is tried again (another, or the same once it
    is free): a joiner that starts from the seed in a trained swarm is far from every partner it
    meets. ``partners()``: the trainers it may adopt from (:func:`other_trainers`). True if it adopted
    a state, or there was nobody to adopt from (then the seed is the swarm's state)."""
    for attempt in range(1, attempts + 1):
        members = partners()
        if not members:
            logger.info("no other trainers and no kept state: starting from the config seed")
            return True
        offers.weight = JOIN_WEIGHT
        try:
            result = averager.sync(trainer_partners(members))
        finally:
            offers.weight = ANCHOR_WEIGHT
        if live.apply_pending():
            logger.info("adopted the parameters of %s", result.partner)
            return True
        logger.warning("adopting a live peer's state, attempt %d/%d: %s", attempt, attempts, result.reason)
        if result.outcome is SyncOutcome.CANCELLED:  # a shutdown: no more attempts
            break
    logger.warning("could not fetch state from a live peer yet; trying again each round meanwhile")
    return False


def other_trainers(members: Sequence[Member], me: str) -> list[Member]:
    """Live trainers other than ``me`` to adopt from: dialable (not in client mode), joined, staying."""
    return [
        m
        for m in members
        if m.record.role == "trainer"
        and m.peer_id != me
        and not m.record.client_mode
        and m.record.state not in ("joining", "leaving")
    ]
