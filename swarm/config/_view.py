"""The swarm-wide part of a config: what peers must agree on, its hash, and differences.

Peers only average with partners that announce the same config hash, so the hash covers exactly the
keys that change the maths of the shared model (its shape, data, optimizers, codec) and none of the
keys a volunteer tunes for their own machine or link: those are :data:`PER_PEER_KEYS`.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarm.config._schema import RunConfig

PER_PEER_KEYS: frozenset[str] = frozenset(
    {
        # whole sections: how this peer connects and how it displays the swarm
        "network",
        "monitor",
        # this machine's hardware, disk and test knobs
        "train.device",
        "train.micro_batch_size",
        "train.slowdown",
        "train.step_time_s",
        "train.checkpoint_dir",
        "train.checkpoint_every_s",
        # how often and how much this peer evaluates; does not change what it trains
        "train.eval_every_rounds",
        "train.eval_batches",
        "train.activation_checkpointing",
        # number format and compilation: the exchanged parameters are float32 whatever a peer computes in
        "train.precision",
        "train.compile",
        # local file locations differ between machines; the source kind is still shared
        "data.paths",
        # link-quality and local ban policy: a peer on a slow link may wait longer
        "averaging.exchange_timeout_s",
        "averaging.max_exchange_timeout_s",
        "averaging.chunk_timeout_s",
        "averaging.ban_base_s",
        "averaging.ban_max_s",
        # how far this peer lets its own exchange lag behind its training: a local policy
        "averaging.max_lag_rounds",
        # where this machine keeps the outer state (its own memory layout)
        "averaging.outer_state_device",
        # pipeline: this peer's memory, and how it routes, waits, queues and moves between stages
        "pipeline.memory_budget_gb",
        "pipeline.max_inflight",
        "pipeline.request_timeout_s",
        "pipeline.routing",
        "pipeline.max_queue",
        "pipeline.rebalance_every_s",
        "pipeline.rebalance_min_interval_s",
    }
)
"""Dotted keys (or whole sections) that each peer may set differently; excluded from the hash."""

HASH_HEX_DIGITS = 16


def swarm_view(dump: dict[str, Any]) -> dict[str, Any]:
    """Drop :data:`PER_PEER_KEYS` from a JSON-mode dump of a config."""
    view: dict[str, Any] = {}
    for section, values in dump.items():
        if section in PER_PEER_KEYS:
            continue
        view[section] = {
            key: value for key, value in values.items() if f"{section}.{key}" not in PER_PEER_KEYS
        }
    return view


def config_hash(view: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of ``view`` (sorted keys, no spaces), first 16 hex digits."""
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:HASH_HEX_DIGITS]


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def diff_configs(a: RunConfig, b: RunConfig) -> list[str]:
    """Sorted dotted keys of the swarm-wide part whose values differ between ``a`` and ``b``.

    Nested mappings (``model.hf_config``) are compared key by key; an empty list means equal hashes.
    """
    flat_a: dict[str, Any] = {}
    flat_b: dict[str, Any] = {}
    _flatten(a.swarm_view(), "", flat_a)
    _flatten(b.swarm_view(), "", flat_b)
    return sorted(key for key in flat_a.keys() | flat_b.keys() if _canon(flat_a, key) != _canon(flat_b, key))


def _canon(flat: dict[str, Any], key: str) -> str | None:
    """Compare as the hash does, so that 1 and 1.0 in ``hf_config`` count as different."""
    return json.dumps(flat[key], sort_keys=True) if key in flat else None
