"""Joining and watching with only the address: `swarm join` / `swarm monitor` without --config use the
run config the swarm publishes, and refuse to guess when none is published."""

from __future__ import annotations

import json
import signal
from contextlib import contextmanager

import pytest
from typer.testing import CliRunner

import peers._compat_check
import peers.config_cmd
import peers.join
import peers.monitor
from peers.bootstrap import JOIN_LINE_PREFIX
from peers.cli import app
from swarm.config import RunConfig, load_config
from swarm.membership._run_config import shareable_config
from tests._processes import heavy_scenario, swarm_cli
from tests.workers.tiny import BACKGROUND, ONE_THREAD, cli_sets, tiny

runner = CliRunner()
PEER = "/ip4/127.0.0.1/tcp/4000/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
LOCAL_TINY = load_config("configs/local-tiny.yaml", env={})


@pytest.fixture
def swarm(monkeypatch):
    """A fake swarm seen by the probe: ``swarm.views`` are what successive looks return (the last one
    repeats); ``swarm.looks`` counts them. The peer programs themselves are replaced by recorders."""

    class Swarm:
        views: list[peers._compat_check.SwarmView] = []
        looks = 0
        ran: dict = {}

    @contextmanager
    def probe(network, config):
        yield None

    def look(node, network, run_id):
        Swarm.looks += 1
        return Swarm.views[min(Swarm.looks, len(Swarm.views)) - 1]

    monkeypatch.setattr(peers._compat_check, "open_probe", probe)
    monkeypatch.setattr(peers._compat_check, "look_at_swarm", look)
    monkeypatch.setattr(peers.join, "run_join", lambda cfg, network, **kw: Swarm.ran.update(join=cfg, **kw))
    monkeypatch.setattr(peers.monitor, "run_monitor", lambda cfg, *a, **kw: Swarm.ran.update(monitor=cfg))
    monkeypatch.setattr(peers.config_cmd, "LOOK_AGAIN_S", 0.01)
    return Swarm


def _published(config=LOCAL_TINY) -> peers._compat_check.SwarmView:
    """What a probe sees of a bootstrap that publishes ``config`` (as the bootstrap publishes it)."""
    text = shareable_config(config).to_yaml()
    return peers._compat_check.SwarmView(config.run.run_id, text, config.config_hash(), [])


NOTHING = peers._compat_check.SwarmView("", None, None, [])
UNSIGNED = peers._compat_check.SwarmView("local-tiny", None, None, [])
"""A run is announced, but no config record survived the checks (bad signature or hash)."""


def test_join_without_config_trains_with_the_published_one_under_local_overrides(swarm) -> None:
    swarm.views = [_published()]
    result = runner.invoke(app, ["join", "--initial-peers", PEER, "--set", "train.device=cpu"])
    assert result.exit_code == 0, result.output
    config = swarm.ran["join"]
    assert config.config_hash() == LOCAL_TINY.config_hash()  # train.device is per peer: not in the hash
    assert config.run.run_id == "local-tiny" and config.train.device == "cpu"
    assert swarm.looks == 1 and swarm.ran["check_swarm"] is False  # checked on the fetch's probe
    assert f"config hash {LOCAL_TINY.config_hash()}" in result.output
    assert "key(s) differ from the defaults:" in result.output
    assert '  run.run_id: "local-tiny" (default "swarm-local")' in result.output
    assert "  train.lr: 0.001 (default 0.0003)" in result.output


def test_an_override_of_a_swarm_wide_key_is_refused_at_join_and_shown_by_the_monitor(swarm) -> None:
    swarm.views = [_published()]
    joined = runner.invoke(app, ["join", "--initial-peers", PEER, "--set", "train.lr=0.01"])
    assert joined.exit_code == 2, joined.output
    assert "train.lr: yours 0.01, the swarm's 0.001" in joined.output and "join" not in swarm.ran
    watched = runner.invoke(app, ["monitor", "--initial-peers", PEER, "--once", "--set", "train.lr=0.01"])
    assert watched.exit_code == 0, watched.output
    changed = swarm.ran["monitor"].config_hash()
    assert changed != LOCAL_TINY.config_hash()
    assert f"with your overrides its config hash is {changed}" in watched.output
    assert swarm.looks == 2  # one probe each: the joiner's check used what its fetch saw


def test_monitor_without_config_watches_the_published_run(swarm) -> None:
    swarm.views = [_published()]
    result = runner.invoke(app, ["monitor", "--initial-peers", PEER, "--once", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert swarm.ran["monitor"].config_hash() == LOCAL_TINY.config_hash()


def test_a_config_published_while_looking_is_used(monkeypatch, swarm) -> None:
    monkeypatch.setattr(peers.config_cmd, "PUBLISHED_CONFIG_WAIT_S", 30.0)
    swarm.views = [NOTHING, NOTHING, _published()]
    result = runner.invoke(app, ["join", "--initial-peers", PEER])
    assert result.exit_code == 0, result.output
    assert swarm.looks == 3 and swarm.ran["join"].run.run_id == "local-tiny"


@pytest.mark.parametrize("command", ["join", "monitor"])
@pytest.mark.parametrize(
    ("view", "named"),
    [
        (NOTHING, "no run config is published through " + PEER),
        (UNSIGNED, "no valid run config is published for run 'local-tiny'"),
    ],
)
def test_nothing_published_is_an_error_that_says_to_pass_config(monkeypatch, swarm, command, view, named):
    """Never the defaults (another run): exit 2 naming the problem and the fix, after a bounded wait."""
    monkeypatch.setattr(peers.config_cmd, "PUBLISHED_CONFIG_WAIT_S", 0.1)
    swarm.views = [view]
    result = runner.invoke(app, [command, "--initial-peers", PEER])
    assert result.exit_code == 2, result.output
    assert named in result.output and "--config FILE" in result.output
    assert swarm.ran == {} and 1 <= swarm.looks < 100


def test_an_explicit_config_wins_and_no_published_one_is_fetched(swarm) -> None:
    swarm.views = [_published(load_config(overrides=["run.run_id=other"], env={}))]
    result = runner.invoke(app, ["join", "--initial-peers", PEER, "--config", "configs/local-tiny.yaml"])
    assert result.exit_code == 0, result.output
    assert swarm.looks == 0 and swarm.ran["join"].config_hash() == LOCAL_TINY.config_hash()
    assert swarm.ran["check_swarm"] is True  # checked against the swarm's as before
    assert "run config:" not in result.output


def test_the_published_keys_are_shown_escaped_and_bounded() -> None:
    """The published config is the publisher's text: no terminal control codes, no endless listing."""
    hostile = {"model_type": "gpt2", "\x1b[2Jkey": "\x1b[31m" + "x" * 500, **{f"k{i}": i for i in range(60)}}
    config = RunConfig.model_validate({"model": {"kind": "hf", "hf_config": hostile}})
    lines = peers.config_cmd.describe_published(config, config)
    assert not any(ch < " " for line in lines for ch in line)
    assert max(len(line) for line in lines) < 200
    assert len(lines) == 2 + peers.config_cmd.MAX_KEYS_LISTED + 1 and lines[-1].startswith("  ... and ")


# the demo run with the tests' tiny model, whose steps a joiner pads to 0.1 s (a per-peer key, published
# with the rest: a joiner inherits it), so that it leaves the two cores to the others
BOOTSTRAP_OVERRIDES = tiny(*BACKGROUND)
BOOTSTRAP_RUN = ["--config", "configs/local-tiny.yaml", *cli_sets(BOOTSTRAP_OVERRIDES)]


@heavy_scenario
@pytest.mark.multipeer
def test_join_and_monitor_with_only_the_address(spawn) -> None:
    """The issue's "done when": a bootstrap of local-tiny; `swarm join --initial-peers X` with no other
    flag trains in that run, and `swarm monitor --initial-peers X --once --format json` lists it."""
    expected = load_config(BOOTSTRAP_RUN[1], overrides=BOOTSTRAP_OVERRIDES, env={}).config_hash()
    boot = spawn(swarm_cli("bootstrap", *BOOTSTRAP_RUN), env=ONE_THREAD)
    maddr = boot.wait_for_line(lambda text: text.startswith(JOIN_LINE_PREFIX), timeout=90)[
        len(JOIN_LINE_PREFIX) :
    ]
    assert f"config hash {expected}" in boot.wait_for_line(lambda text: "config hash" in text, timeout=10)
    assert boot.wait_for_line(lambda text: text.startswith("watch it with:"), 10).endswith(
        f"swarm monitor --initial-peers {maddr}"
    )

    joiner = spawn(swarm_cli("join", "--initial-peers", maddr), env=ONE_THREAD)
    fetched = joiner.wait_for_line(lambda text: text.startswith("run config: the swarm's"), timeout=90)
    assert f"for run 'local-tiny', config hash {expected}" in fetched
    joined = joiner.wait_for_line(lambda text: "joined run 'local-tiny'" in text, timeout=90)
    assert "step_time_s" not in joiner.output()  # per peer: never published, the joiner keeps its own
    joiner_id = joined.split()[1]

    monitor = spawn(swarm_cli("monitor", "--initial-peers", maddr, "--once", "--format", "json"))
    joiner.wait_for_line(lambda text: text.startswith("round "), timeout=90)  # it trains
    assert monitor.wait(timeout=90) == 0, monitor.output()
    output = monitor.output()
    snapshot, _ = json.JSONDecoder().raw_decode(output[output.index("\n{\n") + 1 :])  # log lines may follow
    assert snapshot["run_id"] == "local-tiny" and snapshot["reference_config_hash"] == expected, output
    trainers = [p for p in snapshot["peers"] if p["peer_id"] == joiner_id]
    assert len(trainers) == 1, output
    assert trainers[0]["role"] == "trainer" and trainers[0]["config_hash"] == expected, output
    assert trainers[0]["compatible"], output

    for process in (joiner, boot):  # both at once: a graceful stop of each, checked for leaks by spawn
        process.signal(signal.SIGTERM)
    assert joiner.wait(timeout=30) == 0, joiner.output()
    assert boot.wait(timeout=30) == 0, boot.output()
