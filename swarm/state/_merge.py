"""Merging the states of several untrusted donors into one: a coordinate-wise median, bounded progress.

Each donor proves only that it sent the state it announced, not that the state is honest, and a
digest costs nothing to make: so a merged state must not follow any minority of its donors. The
coordinate-wise median does not: with fewer than half of the donors hostile, every coordinate of the
result lies between the smallest and the largest *honest* value of that coordinate, however far the
others are. Donors announcing one digest hold one state, so they count once. Progress counters are
merged the same way (the median, never the maximum) and must be non-negative integers below
:data:`MAX_PROGRESS`. See docs/state-sync.md.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections import Counter
from typing import Any

import torch

from swarm.state._snapshot import StateSnapshot, build_snapshot
from swarm.state._transfer_protocol import StateTransferError

logger = logging.getLogger(__name__)

PROGRESS_KEYS = ("round", "step", "samples_total")
MAX_PROGRESS = 2**50
"""Sane maximum of each progress counter (about 1e15 samples or steps: far beyond any run). A larger
value is a lie; it would otherwise end a run with ``run.target_samples`` at once."""
_MEDIAN_CHUNK = 1 << 22
"""Elements per slice of the median: bounds the temporary memory to ``donors x 4 MiB x 3``."""


def progress_of(meta: dict[str, Any]) -> dict[str, int]:
    """The progress counters of a downloaded state's meta, checked: the donor chose them.

    Raises StateTransferError naming the key unless each is an integer in ``[0, MAX_PROGRESS]``.
    """
    progress = {}
    for key in PROGRESS_KEYS:
        value = meta.get(key, 0)
        if type(value) is not int or not 0 <= value <= MAX_PROGRESS:
            raise StateTransferError(
                f"donor state meta {key!r} is not an integer in [0, {MAX_PROGRESS}]: {value!r:.40}"
            )
        progress[key] = value
    return progress


def median_snapshot(snapshots: list[StateSnapshot], min_donors: int) -> StateSnapshot:
    """The coordinate-wise median of distinct donor states that share the most common tensor schema,
    with meta merged by :func:`merge_meta`, each value rounded to bf16 (the mean of the two middle
    values of an even count may need more bits): the result holds exactly what its digest names.

    Equal digests count once. Raises StateTransferError when fewer than ``min_donors`` distinct
    states of that schema remain: a median of fewer would follow one or two donors.
    """
    distinct = list({s.digest: s for s in snapshots}.values())
    schemas = [tuple((n, tuple(t.shape)) for n, t in s.tensors.items()) for s in distinct]
    common = Counter(schemas).most_common(1)[0][0] if schemas else ()
    used = [s for s, schema in zip(distinct, schemas, strict=True) if schema == common]
    if len(used) < len(distinct):
        logger.warning("ignoring %d donor state(s) with another tensor schema", len(distinct) - len(used))
    if len(used) < min_donors:
        raise StateTransferError(
            f"only {len(used)} distinct donor state(s) of one schema, need {min_donors} for a robust merge"
        )
    tensors = {name: coordinate_median([s.tensors[name] for s in used]) for name in used[0].tensors}
    for tensor in tensors.values():
        tensor.copy_(tensor.to(torch.bfloat16))
    return build_snapshot(tensors, merge_meta([s.meta for s in used]), used[0].chunk_bytes)


def coordinate_median(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per element, the median of ``tensors`` (same shape): for an even count, the mean of the two
    middle values. Computed in slices of the flattened tensors so no full ``donors x n`` copy exists."""
    count = len(tensors)
    flat = [t.reshape(-1) for t in tensors]
    out = torch.empty_like(flat[0])
    low, high = (count + 1) // 2, count // 2 + 1  # 1-based ranks of the middle value(s)
    for start in range(0, out.numel(), _MEDIAN_CHUNK):
        stacked = torch.stack([t[start : start + _MEDIAN_CHUNK] for t in flat])
        middle = torch.kthvalue(stacked, low, dim=0).values
        if high != low:
            middle = (middle + torch.kthvalue(stacked, high, dim=0).values) / 2
        out[start : start + _MEDIAN_CHUNK] = middle
    return out.reshape(tensors[0].shape)


def merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Progress counters: the (low) median over the donors, each checked by :func:`progress_of`.
    Any other key: the value a strict majority of the donors agree on, else left out."""
    progress = [progress_of(meta) for meta in metas]
    merged: dict[str, Any] = {key: statistics.median_low(p[key] for p in progress) for key in PROGRESS_KEYS}
    others = dict.fromkeys(k for meta in metas for k in meta if k not in PROGRESS_KEYS)
    for key in others:
        votes = Counter(json.dumps(meta[key], sort_keys=True) for meta in metas if key in meta)
        value, count = votes.most_common(1)[0]
        if 2 * count > len(metas):
            merged[key] = json.loads(value)
    return merged
