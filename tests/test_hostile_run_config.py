"""Hostile YAML and published run configs (issue 28, findings 4 and 6): what a stranger publishes
cannot hang a joiner, pick its config, or set the keys that are each peer's own."""

from __future__ import annotations

import contextlib

import pytest
import yaml
from hivemind.utils.timed_storage import get_dht_time

from peers._compat_check import look_at_swarm
from swarm import NetworkOptions, NodeInfo, SwarmNode
from swarm._tokenizer import TokenizerError, load_tokenizer
from swarm.config import ConfigError, RunConfig, load_config
from swarm.membership import (
    compatibility_problems,
    list_members,
    parse_config_text,
    publish_run_config,
    run_config_key,
)
from swarm.membership._run_config import (
    RunConfigRecord,
    read_run_config_record,
    run_config_record,
    shareable_yaml,
)
from tests._processes import wait_until


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


# ---------------------------------------------------------------- finding 4: who publishes the run config

RUN = "hostile-run"


def _config(*overrides: str) -> RunConfig:
    return load_config("configs/local-tiny.yaml", overrides=[f"run.run_id={RUN}", *overrides], env={})


def _store_config(node: SwarmNode, config: RunConfig, text: str, published_at: float) -> None:
    """Publish ``text`` as ``config`` the way a bootstrap does, but with any text and timestamp."""
    record = RunConfigRecord(yaml=text, config_hash=config.config_hash(), published_at=published_at)
    expiration = get_dht_time() + 60
    subkey = node.signer.local_public_key
    assert node.dht.store(run_config_key(RUN), record.dict(), expiration, subkey=subkey)
    announcement = {"run_id": RUN, "config_hash": config.config_hash()}
    assert node.dht.store("swarm_runs", announcement, expiration, subkey=subkey)


def _info(config: RunConfig, role: str) -> NodeInfo:
    return NodeInfo(run_id=RUN, config_hash=config.config_hash(), role=role)


def test_only_the_initial_peers_config_is_taken_whatever_strangers_publish_or_vote() -> None:
    honest = _config()
    hostile = _config("train.lr=0.5")
    with SwarmNode(NetworkOptions(), _info(honest, "bootstrap")) as bootstrap:
        maddrs = bootstrap.visible_maddrs()
        publish_run_config(bootstrap.dht, RUN, honest, bootstrap.signer, ttl_s=60)
        # a stranger publishes later, and three trainers of its own announce its hash
        network = NetworkOptions(initial_peers=maddrs)
        with contextlib.ExitStack() as stack:
            attackers = [stack.enter_context(SwarmNode(network, _info(hostile, "trainer"))) for _ in range(3)]
            _store_config(attackers[0], hostile, shareable_yaml(hostile), get_dht_time() + 1e6)
            probe = stack.enter_context(SwarmNode(network, _info(honest, "trainer"), announce=False))
            wait_until(
                lambda: len(list_members(probe.dht, RUN, timeout_s=5)) >= 4, timeout=30, what="the votes"
            )
            view = look_at_swarm(probe, network, None)
            assert view.run_id == RUN and view.published_hash == honest.config_hash()
            assert parse_config_text(view.published_yaml).train.lr == honest.train.lr
            # named directly, the run is still taken from the initial peer only
            assert look_at_swarm(probe, network, RUN).published_hash == honest.config_hash()
            # a swarm whose initial peer publishes nothing gets no config at all, not the stranger's
            other = NetworkOptions(initial_peers=attackers[1].visible_maddrs())
            assert look_at_swarm(probe, other, RUN).published_yaml is None


def test_per_peer_keys_are_never_published() -> None:
    config = _config("averaging.exchange_timeout_s=3000", "averaging.ban_max_s=1e6", "train.device=cpu")
    text = shareable_yaml(config)
    assert "exchange_timeout_s" not in text and "ban_max_s" not in text and "device" not in text
    assert "network" not in yaml.safe_load(text) and "monitor" not in yaml.safe_load(text)
    assert parse_config_text(text).config_hash() == config.config_hash()


def test_an_auto_pipeline_config_is_published_as_written_and_a_joiner_takes_it() -> None:
    """``pipeline.num_stages: auto`` is hashed as ``auto``: a record resolving it to a count had a hash
    that did not match its YAML, and every joiner dropped it (issue 38, finding 11)."""
    config = _config("pipeline.num_stages=auto", "pipeline.memory_budget_gb=8")
    record = run_config_record(config)
    assert yaml.safe_load(record.yaml)["pipeline"]["num_stages"] == "auto"
    taken = read_run_config_record(RUN, "the-bootstrap", record.dict())
    assert taken is not None, "a joiner dropped the published auto config"
    assert taken.config_hash == config.config_hash() == taken.config.config_hash()
    assert taken.config.pipeline.num_stages == "auto"
    joiner = load_config("configs/local-tiny.yaml", overrides=[f"run.run_id={RUN}"], env={})
    joiner.pipeline.num_stages, joiner.pipeline.memory_budget_gb = "auto", 8.0
    assert compatibility_problems(joiner, taken.yaml, []) == []


def test_per_peer_keys_a_trusted_peer_still_publishes_are_dropped_on_the_way_in() -> None:
    config = _config(
        "averaging.exchange_timeout_s=3000", "data.paths=[/etc/passwd]", "averaging.ban_max_s=1e6"
    )
    with SwarmNode(NetworkOptions(), _info(config, "bootstrap")) as bootstrap:
        _store_config(bootstrap, config, config.to_yaml(), get_dht_time())  # as an old bootstrap did
        network = NetworkOptions(initial_peers=bootstrap.visible_maddrs())
        with SwarmNode(network, _info(config, "trainer"), announce=False) as probe:
            view = look_at_swarm(probe, network, None)
    assert view.published_hash == config.config_hash() and view.published_yaml is not None
    taken = parse_config_text(view.published_yaml)
    defaults = RunConfig()
    assert taken.averaging.exchange_timeout_s == defaults.averaging.exchange_timeout_s
    assert taken.data.paths == defaults.data.paths
    assert taken.averaging.ban_max_s == defaults.averaging.ban_max_s
    assert taken.config_hash() == config.config_hash()


def test_tokenizers_load_without_remote_code(monkeypatch) -> None:
    transformers = pytest.importorskip("transformers")
    seen: dict = {}

    def from_pretrained(name, **kwargs):
        seen.update(kwargs)
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    with pytest.raises(TokenizerError):
        load_tokenizer("some-org/some-tokenizer-not-cached")
    assert seen.get("trust_remote_code") is False
