"""Whether this peer can train in a swarm: same swarm-wide config, a protocol version it speaks.

A peer that differs would never find a partner (partners must announce the same config hash and
protocol version), so it is better refused at join time with the keys to fix than left training
alone.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

from swarm._protocol import PROTOCOL_VERSION
from swarm.config import ConfigError, RunConfig, diff_configs
from swarm.membership._members import Member
from swarm.membership._run_config import parse_config_text


def compatibility_problems(
    local: RunConfig, published_yaml: str | None, members: Sequence[Member]
) -> list[str]:
    """Human-readable lines saying why ``local`` cannot train in this swarm; empty if it can.

    ``published_yaml`` is the swarm's published config (None: nothing published, then the trainers'
    announced hashes are compared instead); ``members`` are the live members of the run.
    """
    return _config_problems(local, published_yaml, members) + _protocol_problems(members)


def _config_problems(local: RunConfig, published_yaml: str | None, members: Sequence[Member]) -> list[str]:
    if published_yaml is None:
        return _hash_problems(local, members)
    try:
        published = parse_config_text(published_yaml)
    except ConfigError as exc:
        return [f"the swarm's published config is invalid: {line}" for line in exc.errors]
    keys = diff_configs(local, published)
    if not keys:
        return []
    ours, theirs = local.swarm_view(), published.swarm_view()
    lines = [
        f"your run config (hash {local.config_hash()}) differs from the swarm's published config "
        f"(hash {published.config_hash()}) in {len(keys)} key(s):"
    ]
    lines += [f"  {key}: yours {_value_at(ours, key)}, the swarm's {_value_at(theirs, key)}" for key in keys]
    lines.append("fetch the swarm's config with: swarm config pull --initial-peers <address> -o run.yaml")
    return lines


def _hash_problems(local: RunConfig, members: Sequence[Member]) -> list[str]:
    hashes = Counter(m.record.config_hash for m in members if m.record.role == "trainer")
    if not hashes or local.config_hash() in hashes:
        return []
    seen = ", ".join(f"{h} ({n} trainer{'s' if n > 1 else ''})" for h, n in hashes.most_common())
    return [
        f"no live trainer uses your config hash {local.config_hash()} (they announce: {seen}) and no "
        "config is published to compare keys; use the organizer's run config file"
    ]


def _protocol_problems(members: Sequence[Member]) -> list[str]:
    versions = Counter(m.record.protocol_version for m in members)
    if not versions or PROTOCOL_VERSION in versions:
        return []
    theirs = ", ".join(str(v) for v, _ in versions.most_common())
    return [
        f"this peer speaks protocol version {PROTOCOL_VERSION}, the swarm's peers speak {theirs}: "
        "install the swarm version the organizer names"
    ]


def _value_at(view: dict[str, Any], dotted: str) -> str:
    node: Any = view
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "(not set)"
        node = node[part]
    return json.dumps(node, sort_keys=True)
