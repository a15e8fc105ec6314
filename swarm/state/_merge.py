"""Merging the states of several donors into one: a robust mean of the tensors, and their progress.

Why a mean: in a gossip swarm every peer's state differs slightly from the swarm mean (drift is
bounded, not zero) and the deviations of different peers are largely independent, so the mean of
several peers is closer to the swarm mean than any one of them. Why clipped: each donor proves only
that it sent the state it announced, not that the state is honest; with three or more donors
CenteredClip bounds what a minority of them can move the result (with two it is the plain mean).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from swarm.gossip import centered_clip_named
from swarm.state._transfer_protocol import StateSnapshot, build_snapshot

logger = logging.getLogger(__name__)


def mean_snapshot(snapshots: list[StateSnapshot]) -> StateSnapshot:
    """Robust mean (CenteredClip, per tensor) of the donors' states that share the most common schema;
    their meta is merged with :func:`merge_meta`."""
    schemas = [tuple((n, tuple(t.shape)) for n, t in s.tensors.items()) for s in snapshots]
    common = Counter(schemas).most_common(1)[0][0]
    used = [s for s, schema in zip(snapshots, schemas, strict=True) if schema == common]
    if len(used) < len(snapshots):
        logger.warning("ignoring %d donor state(s) with another tensor schema", len(snapshots) - len(used))
    if len(used) == 1:
        return used[0]
    tensors = centered_clip_named([s.tensors for s in used])
    return build_snapshot(tensors, merge_meta([s.meta for s in used]), used[0].chunk_bytes)


def merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers (round, step, samples_total, ...): the maximum; anything else: the first donor's."""
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for meta in metas for k in meta):
        values = [meta[key] for meta in metas if key in meta]
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        merged[key] = max(values) if numeric else values[0]
    return merged
