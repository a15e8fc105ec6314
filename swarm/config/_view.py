"""The swarm-wide part of a config: what peers must agree on, its hash, and differences.

Peers only average with partners that announce the same config hash, so the hash covers exactly the
keys that change the maths of the shared model (its shape, data, optimizers, codec) and none of the
keys a volunteer tunes for their own machine or link. Those are marked on their fields
(:data:`~swarm.config._section.PER_PEER`); :func:`per_peer_keys` collects them.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

from pydantic import BaseModel

from swarm.config._section import is_per_peer

HASH_HEX_DIGITS = 16
HASH_VERSION = 2
"""Part of what is hashed: bumped whenever the rule that turns a config into its hash changes, so
that peers hashing by different rules never take each other's configs for equal.
2: every swarm-wide key enters as its resolved value (no keys left out to keep older hashes)."""


def per_peer_keys(model: type[BaseModel]) -> frozenset[str]:
    """Dotted keys of ``model`` (a run config class) marked per peer: whole sections, or keys of one."""
    keys: set[str] = set()
    for name, field in model.model_fields.items():
        if is_per_peer(field):
            keys.add(name)
            continue
        section = field.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            keys.update(f"{name}.{key}" for key, inner in section.model_fields.items() if is_per_peer(inner))
    return frozenset(keys)


def swarm_view(dump: dict[str, Any], per_peer: frozenset[str]) -> dict[str, Any]:
    """Drop the ``per_peer`` keys (and whole sections) from a JSON-mode dump of a config."""
    view: dict[str, Any] = {}
    for section, values in dump.items():
        if section in per_peer:
            continue
        view[section] = {key: value for key, value in values.items() if f"{section}.{key}" not in per_peer}
    return view


def config_hash(view: dict[str, Any]) -> str:
    """sha256 of :data:`HASH_VERSION` and the canonical JSON of ``view`` (sorted keys, no spaces),
    first 16 hex digits."""
    canonical = json.dumps(view, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    text = f"swarm-config-v{HASH_VERSION}:{canonical}"
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:HASH_HEX_DIGITS]


class SwarmViewed(Protocol):
    """What :func:`diff_configs` compares: a config with its swarm-wide part (``RunConfig``). Named here
    by what it does, so that this module, which ``RunConfig`` is built on, never imports it."""

    def swarm_view(self) -> dict[str, Any]: ...


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, item in value.items():
            _flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    else:
        out[prefix] = value


def diff_configs(a: SwarmViewed, b: SwarmViewed) -> list[str]:
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
