"""Hostile YAML and published run configs (issue 28, findings 4 and 6): what a stranger publishes
cannot hang a joiner, pick its config, or set the keys that are each peer's own."""

from __future__ import annotations

import pytest

from swarm.config import ConfigError, load_config
from swarm.membership import parse_config_text


def _alias_bomb(levels: int = 9) -> str:
    """Each level lists the previous one 10 times: ~600 bytes that expand into 10**levels strings."""
    lines = ["model:", "  kind: hf", "  hf_config:", "    a0: &a0 [" + ",".join(['"xxxxxxxx"'] * 10) + "]"]
    lines += [f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_an_alias_bomb_is_refused_with_a_clear_error(tmp_path):
    text = _alias_bomb()
    assert len(text.encode()) < 1000
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, env={})
    expected = f"{path}:4:9: invalid YAML: YAML anchors (&a0) are not allowed in a config"
    assert caught.value.errors == [expected]


def test_a_published_alias_bomb_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not allowed in a config"):
        parse_config_text(_alias_bomb())


def test_aliases_are_refused_even_without_anchors_in_overrides():
    with pytest.raises(ConfigError, match=r"aliases \(\*x\) are not allowed"):
        load_config(overrides=["model.hf_config=*x"], env={})


def test_the_yaml_node_budget_is_kept(tmp_path):
    path = tmp_path / "wide.yaml"
    path.write_text("model:\n  kind: hf\n  hf_config:\n    wide: [" + ",".join(["1"] * 30_000) + "]\n")
    with pytest.raises(ConfigError, match="more than 20000 YAML nodes"):
        load_config(path, env={})
