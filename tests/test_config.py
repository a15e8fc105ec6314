"""Tests for swarm/config/ and peers/config_cmd.py."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import typer
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from peers._common import load_config_or_exit
from peers.config_cmd import config_app
from swarm.config import (
    ENV_ALLOWLIST,
    MOVED_KEYS,
    PER_PEER_KEYS,
    ConfigError,
    RunConfig,
    diff_configs,
    load_config,
    per_peer_keys,
)

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def errors_of(*args, **kwargs) -> list[str]:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(*args, **kwargs)
    assert str(info.value) == "\n".join(info.value.errors)
    assert isinstance(info.value, ValueError)
    return info.value.errors


def only_error_about(errors: list[str], key: str) -> str:
    matching = [line for line in errors if line.startswith(f"{key}:")]
    assert len(matching) == 1, errors
    return matching[0]


# ---------------------------------------------------------------- defaults and precedence


def test_defaults_match_the_documented_values():
    config = load_config(env={})
    assert config.run.run_id == "swarm-local"
    assert config.network.host_maddrs == ["/ip4/127.0.0.1/tcp/0"]
    assert config.network.record_ttl_s == 10.0
    assert config.model.n_embd == 64
    assert config.train.lr == 3e-4
    assert config.averaging.sync_every_seconds is None
    assert config.compression.codec == "int8"
    assert config.compression.chunk_bytes == 1 << 20
    assert config.monitor.prometheus_port is None


def test_precedence_set_over_env_over_file_over_default(tmp_path):
    path = write(
        tmp_path,
        """
        train:
          lr: 0.1
          weight_decay: 0.2
          warmup_steps: 7
        """,
    )
    env = {"SWARM_TRAIN__LR": "0.01", "SWARM_TRAIN__WEIGHT_DECAY": "0.05"}
    config = load_config(path, overrides=["train.lr=0.001"], env=env)
    assert config.train.lr == 0.001  # --set beats env and file
    assert config.train.weight_decay == 0.05  # env beats file
    assert config.train.warmup_steps == 7  # file beats default
    assert config.train.batch_size == 16  # default


def test_later_set_wins_and_env_none_reads_os_environ(monkeypatch):
    monkeypatch.setenv("SWARM_TRAIN__BATCH_SIZE", "3")
    config = load_config(overrides=["train.lr=1", "train.lr=2"])
    assert config.train.lr == 2.0
    assert config.train.batch_size == 3
    assert load_config(env={}).train.batch_size == 16


def test_override_values_are_yaml_scalars_and_flow_sequences():
    peer = "/ip4/1.2.3.4/tcp/1/p2p/QmPeer"
    config = load_config(
        overrides=[
            f"network.initial_peers=[{peer}, /ip6/::1/tcp/2/p2p/QmOther]",
            "train.lr=1e-3",
            "train.max_steps=100",
            "network.client_mode=true",
            "run.target_samples=null",
            "model.hf_config={n_positions: 128}",
        ],
        env={},
    )
    assert config.network.initial_peers == [peer, "/ip6/::1/tcp/2/p2p/QmOther"]
    assert config.train.lr == pytest.approx(1e-3)
    assert config.train.max_steps == 100
    assert config.network.client_mode is True
    assert config.run.target_samples is None
    assert config.model.hf_config == {"n_positions": 128}


def test_string_fields_keep_text_and_list_fields_accept_one_value():
    config = load_config(
        overrides=["run.run_id=0x10", "network.host_maddrs=/ip4/0.0.0.0/tcp/31337"],
        env={"SWARM_TRAIN__DEVICE": "1"},
    )
    assert config.run.run_id == "0x10"  # not the integer 16
    assert config.train.device == "1"
    assert config.network.host_maddrs == ["/ip4/0.0.0.0/tcp/31337"]


def test_set_replaces_a_whole_subtree_and_its_origin(tmp_path):
    path = write(tmp_path, "model:\n  hf_config:\n    n_positions: 1\n    bad: 2\n")
    config = load_config(path, overrides=["model.hf_config={a: 1}"], env={})
    assert config.model.hf_config == {"a": 1}
    errors = errors_of(path, overrides=["model=5"])
    assert only_error_about(errors, "model").endswith("[--set model]")


def test_set_reaches_deeper_keys_and_empty_value_is_null():
    config = load_config(
        overrides=["model.hf_config.n_positions=128", "train.max_steps=5", "train.max_steps="], env={}
    )
    assert config.model.hf_config == {"n_positions": 128}
    assert config.train.max_steps is None


def test_an_empty_section_means_defaults(tmp_path):
    assert load_config(write(tmp_path, "monitor:\n  # refresh_s: 1\n", "b.yaml"), env={}) == RunConfig()


@pytest.mark.parametrize("text", ["", "# nothing here\n", "{}\n", "---\n"])
def test_a_file_without_any_section_is_an_error_naming_it(tmp_path, text):
    """An empty file is the wrong file or one not saved yet; it used to check as OK (issue 38)."""
    path = write(tmp_path, text)
    (error,) = errors_of(path)
    assert error.startswith(f"{path}: the file holds no config")
    result = CliRunner().invoke(config_app, ["check", str(path), "--no-estimate"])
    assert result.exit_code == 2 and "OK" not in result.output


# ---------------------------------------------------------------- errors name key and source


def test_yaml_errors_name_key_and_file_line(tmp_path):
    path = write(
        tmp_path,
        """
        run:
          run_id: "not valid!"
        train:
          lr: -1
          batch_size: many
        compression:
          block_size: 48
        """,
    )
    errors = errors_of(path)
    assert len(errors) == 4
    assert only_error_about(errors, "run.run_id").endswith(f"[{path}:2]")
    lr = only_error_about(errors, "train.lr")
    assert "greater than 0" in lr and lr.endswith(f"[{path}:4]")
    assert only_error_about(errors, "train.batch_size").endswith(f"[{path}:5]")
    block = only_error_about(errors, "compression.block_size")
    assert "power of two" in block and block.endswith(f"[{path}:7]")


def test_unknown_keys_at_every_level_name_their_line(tmp_path):
    path = write(
        tmp_path,
        """
        run:
          run_id: ok
        trian:
          lr: 1
        train:
          batch_size: 4
          learning_rate: 0.1
        """,
    )
    errors = errors_of(path)
    assert len(errors) == 2
    section = only_error_about(errors, "trian")
    assert "unknown section" in section and "'train'" in section and section.endswith(f"[{path}:3]")
    key = only_error_about(errors, "train.learning_rate")
    assert "unknown key (did you mean 'lr'?)" in key and key.endswith(f"[{path}:7]")


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("train.learning_rate", "'lr'"),  # the long name of an abbreviated key
        ("train.LR", "'lr'"),  # another case
        ("train.batchsize", "'batch_size'"),  # a close spelling
        ("monitor.port", "'prometheus_port'"),  # a part of the name
        ("model.lr", "'train.lr'"),  # a key of another section
        ("averaging.micro_batch_size", "'train.micro_batch_size'"),
        ("lr", "'train.lr'"),  # a key without its section
    ],
)
def test_a_mistyped_key_gets_a_did_you_mean(typed, meant):
    error = only_error_about(errors_of(overrides=[f"{typed}=1"]), typed)
    assert f"(did you mean {meant}?)" in error


def test_list_item_error_names_the_item_line(tmp_path):
    path = write(tmp_path, "network:\n  initial_peers:\n    - /ip4/1.2.3.4/tcp/1\n    - [nested]\n")
    line = only_error_about(errors_of(path), "network.initial_peers[1]")
    assert line.endswith(f"[{path}:4]")


def test_env_errors_name_the_variable():
    errors = errors_of(env={"SWARM_TRAIN__LR": "-0.5", "SWARM_TRAIN__NOPE": "1", "SWARM_BOGUS__X": "1"})
    assert len(errors) == 3
    assert only_error_about(errors, "train.lr").endswith("[environment variable SWARM_TRAIN__LR]")
    assert only_error_about(errors, "train.nope").endswith("[environment variable SWARM_TRAIN__NOPE]")
    bogus = only_error_about(errors, "bogus")
    assert "unknown section" in bogus and bogus.endswith("[environment variable SWARM_BOGUS__X]")


def test_env_vars_outside_the_key_scheme_are_errors_unless_allowed():
    errors = errors_of(env={"SWARM_LR": "1", "SWARM_TRAIN__": "1", "OTHER_TRAIN__LR": "x"})
    assert len(errors) == 2
    assert all(line.startswith("environment variable SWARM_") for line in errors)
    assert "SWARM_<SECTION>__<KEY>" in errors[0]
    allowed = {name: "anything" for name in ENV_ALLOWLIST}
    assert {"SWARM_TORCH_SPEC", "SWARM_HOME", "SWARM_LOG_LEVEL"} <= ENV_ALLOWLIST
    assert load_config(env=allowed) == RunConfig()


def test_set_errors_name_the_flag():
    errors = errors_of(overrides=["train.lr=0", "averaging.outer_momentum=1", "train.typo=3"])
    assert len(errors) == 3
    assert only_error_about(errors, "train.lr").endswith("[--set train.lr]")
    assert only_error_about(errors, "averaging.outer_momentum").endswith("[--set averaging.outer_momentum]")
    assert "did you mean" not in only_error_about(errors, "train.typo")


def test_malformed_set_flags_are_errors():
    errors = errors_of(overrides=["train.lr", "=3", "train..lr=1", "network.initial_peers=[a, b"])
    assert len(errors) == 4
    assert "expected SECTION.KEY=VALUE" in errors[0] and "'train.lr'" in errors[0]
    assert "invalid key" in errors[1] and "invalid key" in errors[2]
    assert errors[3].startswith("--set network.initial_peers:") and "not valid YAML" in errors[3]


def test_a_single_string_is_not_a_sequence_of_overrides():
    with pytest.raises(TypeError):
        load_config(overrides="train.lr=1", env={})


def test_cross_field_errors_name_both_sources(tmp_path):
    path = write(tmp_path, "network:\n  record_ttl_s: 5\n")
    errors = errors_of(path, overrides=["network.record_interval_s=4", "model.n_head=3"])
    assert len(errors) == 2
    ttl = only_error_about(errors, "network.record_ttl_s")
    assert f"[{path}:2; network.record_interval_s from --set network.record_interval_s]" in ttl
    embd = only_error_about(errors, "model.n_embd")
    assert "divisible by n_head" in embd and "[default value; model.n_head from --set model.n_head]" in embd


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("averaging.ban_max_s=1", "averaging.ban_max_s"),
        ("data.source=files", "data.paths"),
        ("data.source=hf", "data.hf_dataset"),
        ("network.record_interval_s=301", "network.record_interval_s"),
        ("model.n_embd=4", "model.n_embd"),
        ("compression.block_size=8192", "compression.block_size"),
        ("compression.chunk_bytes=1024", "compression.chunk_bytes"),
        ("compression.codec=int2", "compression.codec"),
        ("monitor.prometheus_port=70000", "monitor.prometheus_port"),
        ("emulation.slowdown=0.5", "emulation.slowdown"),
        ("emulation.slowdown=inf", "emulation.slowdown"),
        ("emulation.slowdown=1e9", "emulation.slowdown"),
        ("data.eval_fraction=0.5", "data.eval_fraction"),
        ("averaging.sync_every_seconds=0", "averaging.sync_every_seconds"),
        ("train.lr=.nan", "train.lr"),
        ("run.run_id=-starts-with-dash", "run.run_id"),
    ],
)
def test_out_of_range_values_are_rejected(override, key):
    assert only_error_about(errors_of(overrides=[override]), key)


def test_file_level_errors_are_clear(tmp_path):
    missing = tmp_path / "missing.yaml"
    assert errors_of(missing) == [f"{missing}: config file not found"]
    broken = write(tmp_path, "train:\n  lr: [1, 2\n", "broken.yaml")
    (line,) = errors_of(broken)
    assert line.startswith(f"{broken}:") and "invalid YAML" in line
    listing = write(tmp_path, "- a\n- b\n", "list.yaml")
    (line,) = errors_of(listing)
    assert "top level must be a mapping" in line and "list" in line
    assert "is a directory" in errors_of(tmp_path)[0]


def test_non_string_yaml_keys_are_reported_once_with_their_line(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.5\n  1: x\n  yes: 2\nmodel:\n  hf_config: {2: 3, a: 1}\n")
    errors = errors_of(path)
    assert errors == [
        f"{path}:3: train: key '1' is not a string; quote it",
        f"{path}:4: train: key 'yes' is not a string; quote it",
        f"{path}:6: model.hf_config: key '2' is not a string; quote it",
    ]


def test_yaml_merge_keys_work_and_anchors_are_refused(tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.5\naveraging:\n  <<: {outer_lr: 0.25}\n  nesterov: false\n")
    config = load_config(path, env={})
    assert (config.train.lr, config.averaging.outer_lr, config.averaging.nesterov) == (0.5, 0.25, False)
    (line,) = errors_of(write(tmp_path, "train: &t\n  lr: 0.5\n"))
    assert "anchors (&t) are not allowed" in line  # tests/test_hostile_config.py: alias bombs


def test_duplicate_yaml_keys_are_errors(tmp_path):
    path = write(tmp_path, "train:\n  lr: 1\n  lr: 2\n")
    (line,) = errors_of(path)
    assert line == f"{path}:3: train.lr: duplicate key (first set at line 2)"


def test_errors_from_all_sources_are_reported_together(tmp_path):
    path = write(tmp_path, "train:\n  lr: -1\n")
    errors = errors_of(path, overrides=["oops"], env={"SWARM_MODEL__N_LAYER": "0"})
    assert len(errors) == 3
    assert any(line.startswith("--set 'oops'") for line in errors)
    assert only_error_about(errors, "train.lr").endswith(f"[{path}:2]")
    assert only_error_about(errors, "model.n_layer").endswith("[environment variable SWARM_MODEL__N_LAYER]")


# ---------------------------------------------------------------- round trip, hash, diff


def test_to_yaml_round_trips(tmp_path):
    config = load_config(
        overrides=[
            "run.target_samples=1000",
            "network.initial_peers=[/ip4/1.2.3.4/tcp/1/p2p/Qm]",
            "model.hf_config={n_positions: 128, tie: true}",
            "train.lr=1e-7",
            "averaging.sync_every_seconds=2.5",
        ],
        env={},
    )
    path = tmp_path / "resolved.yaml"
    path.write_text(config.to_yaml())
    assert load_config(path, env={}) == config
    assert yaml.safe_load(config.to_yaml())["train"]["lr"] == pytest.approx(1e-7)


_VALID_OVERRIDES = st.fixed_dictionaries(
    {},
    optional={
        "run.seed": st.integers(0, 2**40).map(str),
        "run.run_id": st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9_.-]{0,20}\Z"),
        "train.lr": st.floats(1e-9, 10.0).map(repr),
        "train.batch_size": st.integers(1, 4096).map(str),
        "train.device": st.sampled_from(["cpu", "cuda:1", "auto"]),
        "averaging.outer_momentum": st.floats(0.0, 0.999).map(repr),
        "averaging.nesterov": st.sampled_from(["true", "false", "yes", "no"]),
        "compression.codec": st.sampled_from(["fp32", "fp16", "bf16", "int8", "int4"]),
        "compression.block_size": st.sampled_from([16, 32, 64, 1024, 4096]).map(str),
        "monitor.prometheus_port": st.integers(1, 65535).map(str),
        "network.initial_peers": st.lists(
            st.from_regex(r"\A/ip4/10\.0\.0\.[0-9]{1,2}/tcp/[0-9]{1,5}\Z"), max_size=3
        ).map(lambda peers: "[" + ", ".join(peers) + "]"),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(overrides=_VALID_OVERRIDES)
def test_random_valid_overrides_round_trip_and_hash_stably(tmp_path, overrides):
    config = load_config(overrides=[f"{key}={value}" for key, value in overrides.items()], env={})
    path = tmp_path / "resolved.yaml"
    path.write_text(config.to_yaml())
    again = load_config(path, env={})
    assert again == config
    assert again.config_hash() == config.config_hash()
    assert diff_configs(again, config) == []


def test_hash_is_stable_and_short():
    first = load_config(env={}).config_hash()
    assert first == load_config(env={}).config_hash() == RunConfig().config_hash()
    assert len(first) == 16 and int(first, 16) >= 0


PER_PEER_OVERRIDES = [
    "network.initial_peers=[/ip4/9.9.9.9/tcp/1/p2p/Qm]",
    "network.client_mode=true",
    "monitor.refresh_s=9",
    "train.device=cpu",
    "train.micro_batch_size=2",
    "emulation.slowdown=3",
    "train.checkpoint_dir=/tmp/ckpt",
    "train.checkpoint_every_s=5",
    "data.paths=[/data/a.txt]",
    "averaging.exchange_timeout_s=99",
    "averaging.ban_max_s=1000",
]


@pytest.mark.parametrize("override", PER_PEER_OVERRIDES)
def test_per_peer_keys_do_not_change_the_hash(override):
    key = override.partition("=")[0]
    assert key in PER_PEER_KEYS or key.split(".")[0] in PER_PEER_KEYS
    base = load_config(env={})
    changed = load_config(overrides=[override], env={})
    assert changed != base
    assert changed.config_hash() == base.config_hash()
    assert diff_configs(base, changed) == []


@pytest.mark.parametrize(
    "override",
    [
        "run.run_id=other",
        "run.seed=1",
        "model.n_layer=3",
        "data.eval_fraction=0.02",
        "train.lr=0.001",
        "train.batch_size=8",
        "averaging.sync_every_steps=5",
        "compression.codec=int4",
        "model.hf_config={a: 1}",
    ],
)
def test_swarm_wide_keys_change_the_hash_and_show_in_diff(override):
    key = override.partition("=")[0]
    base = load_config(env={})
    changed = load_config(overrides=[override], env={})
    assert changed.config_hash() != base.config_hash()
    diff = diff_configs(base, changed)
    assert diff and all(entry == key or entry.startswith(f"{key}.") for entry in diff)


def test_swarm_view_excludes_per_peer_parts():
    view = load_config(env={}).swarm_view()
    assert set(view) == {"run", "model", "data", "train", "averaging", "compression", "pipeline"}
    assert "device" not in view["train"] and "lr" in view["train"]
    assert "paths" not in view["data"] and "source" in view["data"]


def test_per_peer_keys_are_the_keys_marked_on_their_fields():
    """The JSON schema carries the marker; PER_PEER_KEYS is exactly the marked keys, found by walking it."""
    schema = RunConfig.model_json_schema()
    marked = {name for name, prop in schema["properties"].items() if prop.get("per_peer")}
    for section, prop in schema["properties"].items():
        ref = prop.get("$ref") or prop["allOf"][0]["$ref"] if "properties" not in prop else None
        fields = schema["$defs"][ref.rsplit("/", 1)[-1]]["properties"] if ref else {}
        marked |= {f"{section}.{key}" for key, field in fields.items() if field.get("per_peer")}
    assert marked == PER_PEER_KEYS == per_peer_keys(RunConfig)
    assert {"network", "monitor", "emulation", "train.device", "data.paths"} <= PER_PEER_KEYS


def test_the_hash_covers_every_swarm_wide_key_at_its_resolved_value():
    """No key is left out of the hash but the per-peer ones, defaults included."""
    view = load_config(env={}).swarm_view()
    for section, field in RunConfig.model_fields.items():
        if section in PER_PEER_KEYS:
            assert section not in view
            continue
        for key in field.annotation.model_fields:
            assert (key in view[section]) == (f"{section}.{key}" not in PER_PEER_KEYS), f"{section}.{key}"


def test_the_hash_never_asks_the_pipeline_estimator(monkeypatch):
    import swarm.pipeline

    def estimator(config):
        raise AssertionError("config_hash called the pipeline's memory estimator")

    monkeypatch.setattr(swarm.pipeline, "resolve_num_stages", estimator, raising=False)
    auto = ["model.n_layer=4", "pipeline.num_stages=auto"]
    small = load_config(None, [*auto, "pipeline.memory_budget_gb=1"], env={})
    large = load_config(None, [*auto, "pipeline.memory_budget_gb=2"], env={})
    # the budget decides the cut, so it is shared: two budgets are two swarms
    assert small.config_hash() != large.config_hash()
    assert diff_configs(small, large) == ["pipeline.memory_budget_gb"]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED_KEYS.items()))
def test_a_moved_key_names_its_new_place(old, new):
    section, key = new.split(".")
    value = "2" if key == "slowdown" else "0.1"
    (line,) = errors_of(overrides=[f"{old}={value}"])
    assert line.startswith(f"{old}: ") and f"moved to {new}" in line
    (line,) = errors_of(env={f"SWARM_{old.replace('.', '__').upper()}": value})
    assert f"moved to {new}" in line and "environment variable" in line
    config = load_config(overrides=[f"{new}={value}"], env={})
    assert getattr(getattr(config, section), key) == float(value)
    assert config.config_hash() == load_config(env={}).config_hash()  # emulation is per peer


def test_diff_lists_every_differing_key_sorted():
    a = load_config(overrides=["model.hf_config={x: 1, y: 2}"], env={})
    b = load_config(overrides=["train.lr=1", "run.seed=4", "model.hf_config={x: 1.0, y: 2}"], env={})
    assert diff_configs(a, b) == ["model.hf_config.x", "run.seed", "train.lr"]


# ---------------------------------------------------------------- shipped config


def test_local_tiny_config_validates():
    config = load_config(REPO / "configs" / "local-tiny.yaml", env={})
    assert config.run.run_id == "local-tiny"
    assert (config.model.n_layer, config.model.n_embd, config.model.block_size) == (2, 64, 64)
    assert config.data.source == "stdlib"
    assert config.compression.codec == "int8"
    assert config.averaging.sync_every_steps == 10
    assert (config.network.record_interval_s, config.network.record_ttl_s) == (2.0, 8.0)


# ---------------------------------------------------------------- CLI


@pytest.fixture
def cli():
    app = typer.Typer()
    app.add_typer(config_app, name="config")
    runner = CliRunner()

    def invoke(*args: str, env: dict[str, str] | None = None):
        clean = {name: None for name in os.environ if name.startswith("SWARM_")}
        return runner.invoke(app, list(args), env={**clean, **(env or {})})

    return invoke


def test_cli_show_prints_resolved_yaml_and_hash(cli, tmp_path):
    path = write(tmp_path, "train:\n  lr: 0.01\n")
    result = cli("config", "show", str(path), "--set", "train.batch_size=3", "--set", "run.seed=2")
    assert result.exit_code == 0, result.stderr
    body, _, last = result.stdout.rstrip("\n").rpartition("\n")
    expected = load_config(path, overrides=["train.batch_size=3", "run.seed=2"], env={})
    assert yaml.safe_load(body)["train"] == expected.model_dump()["train"]
    assert last == f"config hash: {expected.config_hash()}"


def test_cli_check_ok(cli):
    path = REPO / "configs" / "local-tiny.yaml"
    result = cli("config", "check", str(path))
    assert result.exit_code == 0
    assert (
        result.stdout.splitlines()[0] == f"OK: {path} (config hash {load_config(path, env={}).config_hash()})"
    )


def test_cli_check_reports_every_error_on_stderr_with_status_2(cli, tmp_path):
    path = write(tmp_path, "train:\n  lr: -1\n  bogus: 1\n")
    result = cli("config", "check", str(path), "--set", "run.seed=-1", env={"SWARM_MODEL__N_HEAD": "0"})
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 4 and all(line.startswith("error: ") for line in lines)
    assert any(f"[{path}:3]" in line and "train.bogus" in line for line in lines)
    assert any("[--set run.seed]" in line for line in lines)
    assert any("[environment variable SWARM_MODEL__N_HEAD]" in line for line in lines)


def test_cli_show_missing_file_exits_2(cli, tmp_path):
    result = cli("config", "show", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2
    assert "config file not found" in result.stderr


def test_load_config_or_exit(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("SWARM_TRAIN__LR", raising=False)
    assert load_config_or_exit(None, ["train.lr=0.5"]).train.lr == 0.5
    with pytest.raises(typer.Exit) as info:
        load_config_or_exit(tmp_path / "nope.yaml", [])
    assert info.value.exit_code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_every_key_is_documented() -> None:
    """docs/configuration.md has a table row for every key of every section."""
    from pathlib import Path

    from swarm.config import RunConfig

    text = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    for section, model in RunConfig.model_fields.items():
        for key in model.annotation.model_fields:
            assert f"| `{key}` |" in text.split(f"### `{section}`", 1)[1], (
                f"{section}.{key} is not documented"
            )


def test_anchors_may_travel_in_int8_but_not_in_int4():
    assert load_config(None, ["averaging.param_codec=int8"], env={}).averaging.param_codec == "int8"
    error = only_error_about(errors_of(None, ["averaging.param_codec=int4"]), "averaging.param_codec")
    assert "int8" in error and "int4" in error  # names what was given and what is allowed
