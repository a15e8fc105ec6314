"""`swarm export` and `swarm generate`: the model out of a checkpoint, back in exactly, and sampled."""

from __future__ import annotations

import json
import os
import shlex
import stat
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from peers.cli import app
from swarm.config import RunConfig, load_config
from swarm.export import MODEL_FILE, SWARM_FILE, generate, load_exported
from swarm.learning import InnerTrainer, TrainBatches, build_model, evaluate, make_eval_set, open_source
from swarm.state import save_checkpoint
from swarm.trainer import Progress
from swarm.trainer._checkpoints import Checkpoints
from tests._processes import join_address, swarm_cli, terminate_and_wait
from tests.workers.tiny import ONE_THREAD, TINY, cli_sets, tiny

LOCAL_TINY = str(Path(__file__).resolve().parent.parent / "configs" / "local-tiny.yaml")
HF = [
    "model.kind=hf",
    "model.hf_config={model_type: gpt2, n_layer: 1, n_head: 2, n_embd: 32, n_positions: 32}",
]
runner = CliRunner()


def config_of(overrides: list[str]) -> RunConfig:
    return load_config(LOCAL_TINY, overrides=overrides, env={})


def write_checkpoint(directory: Path, config: RunConfig, model: torch.nn.Module, steps: int) -> Path:
    """A checkpoint in the trainer's layout (swarm/trainer/_peer.py: _checkpoint_state), as written
    before checkpoints carried their run config."""
    trainer = InnerTrainer(model, config.train, torch.device("cpu"), block_size=config.model.block_size)
    batches = TrainBatches(open_source(config.data), config.model.block_size, 8, peer_key="p", seed=0)
    progress = Progress()
    for _ in range(steps):
        stats = trainer.step(batches)
        progress.record_step(8, stats.loss, 0.01, 0.01)
    progress.round = 1
    state = {
        "model": model.state_dict(),
        "inner_optimizer": trainer.optimizer.state_dict(),
        "backend": {},
        "progress": progress.checkpoint_state(),
        "config_hash": config.config_hash(),
    }
    return save_checkpoint(directory, state, progress.step)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, torch.nn.Module, Path]:
    """A tiny GPT trained 3 steps, and the checkpoint directory holding it."""
    config = config_of(TINY)
    model = build_model(config.model, config.run.seed)
    directory = tmp_path_factory.mktemp("ckpt")
    write_checkpoint(directory, config, model, steps=3)
    return config, model.eval(), directory


def export_args(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["export", "--checkpoint", str(checkpoint), "--out", str(out), "--config", LOCAL_TINY, *extra]


def test_export_loads_back_with_the_same_tensors_and_eval_loss(trained, tmp_path) -> None:
    config, model, directory = trained
    out = tmp_path / "exported"
    result = runner.invoke(app, export_args(directory, out, *cli_sets(TINY)))
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "step 3" in result.output
    written = sorted(p.name for p in out.iterdir())
    expected = ["config.json", "generation_config.json", MODEL_FILE, SWARM_FILE, "tokenizer.json"]
    assert written == [*expected, "tokenizer_config.json"]
    assert not list(tmp_path.glob(".*"))  # no temporary directory left behind
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    meta = json.loads((out / SWARM_FILE).read_text())
    assert meta["format"] == "swarm-export/2"
    assert meta["model"] == config.model.model_dump(mode="json")
    assert (meta["run_id"], meta["config_hash"]) == ("local-tiny", config.config_hash())
    assert meta["progress"] == {"round": 1, "step": 3, "samples": 24}

    loaded = load_exported(out)
    assert loaded.model.lm_head.weight is loaded.model.wte.weight  # still tied after loading
    original = model.state_dict()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    eval_set = make_eval_set(open_source(config.data), config.model.block_size)
    batches = config.train.eval_batches
    assert evaluate(loaded.model, eval_set, batches) == evaluate(model, eval_set, batches)


def test_export_of_one_file_and_refusal_of_a_non_empty_directory(trained, tmp_path) -> None:
    _, model, directory = trained
    (checkpoint,) = directory.glob("ckpt-*.pt")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    refused = runner.invoke(app, export_args(checkpoint, out, *cli_sets(TINY)))
    assert refused.exit_code == 2 and "not empty" in refused.output
    assert (out / "keep.txt").exists()
    replaced = runner.invoke(app, export_args(checkpoint, out, *cli_sets(TINY), "--overwrite"))
    assert replaced.exit_code == 0, replaced.output
    assert not (out / "keep.txt").exists()
    assert torch.equal(load_exported(out).model.wte.weight, model.wte.weight)


def test_a_checkpoint_of_another_config_is_refused(trained, tmp_path) -> None:
    _, _, directory = trained
    out = tmp_path / "exported"
    result = runner.invoke(app, export_args(directory, out, *cli_sets([*TINY, "train.lr=0.5"])))
    assert result.exit_code == 2
    assert "config hash" in result.output and "belongs to" in result.output
    assert not out.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "--out", "x"], "exactly one of --checkpoint"),
        (["export", "--out", "x", "--checkpoint", "/nonexistent"], "no such checkpoint"),
        (["generate", "--prompt", "a"], "exactly one of --checkpoint"),
        (["generate", "--model", "/nonexistent", "--prompt", "a"], "not an exported model"),
    ],
)
def test_bad_inputs_are_named(args: list[str], message: str) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_generate_is_seeded_and_prints_prompt_then_the_bytes(trained, tmp_path) -> None:
    _, model, directory = trained
    out = tmp_path / "exported"
    assert runner.invoke(app, export_args(directory, out, *cli_sets(TINY))).exit_code == 0
    base = ["generate", "--prompt", "def ", "--max-new-bytes", "40", "--seed", "3"]
    from_checkpoint = runner.invoke(
        app, [*base, "--checkpoint", str(directory), "-c", LOCAL_TINY, *cli_sets(TINY)]
    )
    from_export = runner.invoke(app, [*base, "--model", str(out)])
    assert from_checkpoint.exit_code == 0, from_checkpoint.output
    new = generate(model, b"def ", 40, seed=3)
    assert len(new) == 40
    assert from_checkpoint.output == (b"def " + new).decode("utf-8", errors="replace") + "\n"
    assert from_export.output == from_checkpoint.output


def test_generate_seeds_differ_on_an_untrained_model_and_lengths_are_exact() -> None:
    config = config_of(TINY)
    model = build_model(config.model, seed=0)
    samples = {generate(model, b"x", 64, seed=seed) for seed in range(3)}
    assert len(samples) == 3 and all(len(s) == 64 for s in samples)
    assert generate(model, b"x", 64, seed=1) == generate(model, b"x", 64, seed=1)
    long_prompt = bytes(range(97, 123)) * 4  # 104 bytes > block_size 32: cropped to the last 32
    assert generate(model, long_prompt, 5, seed=0) == generate(model, long_prompt[-32:], 5, seed=0)
    assert len(generate(model, b"x", 7, temperature=0)) == 7
    for kwargs in ({"max_new_bytes": 0}, {"prompt": b""}, {"top_k": 0}, {"temperature": -1.0}):
        with pytest.raises(ValueError):
            generate(model, **{"prompt": b"x", "max_new_bytes": 3, **kwargs})  # type: ignore[arg-type]


def test_generate_cli_checks_its_arguments(trained) -> None:
    _, _, directory = trained
    base = ["generate", "--checkpoint", str(directory), "-c", LOCAL_TINY, *cli_sets(TINY)]
    for extra, message in (
        (["--prompt", "a", "--max-new-bytes", "0"], "must be positive"),
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "a", "--temperature", "-1"], "--temperature"),
    ):
        result = runner.invoke(app, [*base, *extra])
        assert result.exit_code == 2 and message in result.output, result.output
    cropped = runner.invoke(app, [*base, "--prompt", "y" * 100, "--max-new-bytes", "3"])
    assert cropped.exit_code == 0 and "sees its last 32" in cropped.output
    no_config = runner.invoke(app, ["generate", "--checkpoint", str(directory), "--prompt", "a"])
    assert no_config.exit_code == 2 and "carries no run config" in no_config.output, no_config.output


def test_generate_refuses_an_hf_model(tmp_path) -> None:
    config = config_of([*TINY, *HF])
    saved = trainer_checkpoint(tmp_path / "ckpt", config, build_model(config.model, config.run.seed))
    hf = runner.invoke(app, ["generate", "--checkpoint", str(saved), "--prompt", "a"])
    assert hf.exit_code == 2 and "model.kind gpt only" in hf.output, hf.output


def test_hf_model_exports_for_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = config_of([*TINY, *HF])
    model = build_model(config.model, config.run.seed)
    write_checkpoint(tmp_path / "ckpt", config, model, steps=1)
    out = tmp_path / "hf"
    args = export_args(tmp_path / "ckpt", out, *cli_sets([*TINY, *HF]))
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert (out / "config.json").is_file() and (out / SWARM_FILE).is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    idx = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=idx).logits, model.eval()(idx))
        assert torch.equal(load_exported(out).model(idx), model(idx))


def trainer_checkpoint(directory: Path, config: RunConfig, model: torch.nn.Module) -> Path:
    """A checkpoint written the way a trainer writes it (swarm/trainer/_checkpoints.py)."""
    progress = Progress()
    progress.record_step(8, 5.0, 0.01, 0.01)
    checkpoints = Checkpoints(
        config.model_copy(
            update={"train": config.train.model_copy(update={"checkpoint_dir": str(directory)})}
        ),
        progress,
    )
    saved = checkpoints.save(lambda: {"model": model.state_dict(), "backend": {}}, model.parameters)
    assert saved is not None
    return saved


@pytest.fixture(scope="module")
def carried(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunConfig, torch.nn.Module, Path]:
    """A checkpoint of a run of configs/local-tiny.yaml with overrides, as a trainer writes it."""
    config = config_of([*TINY, "model.n_layer=2", "train.lr=0.002"])
    model = build_model(config.model, config.run.seed).eval()
    directory = tmp_path_factory.mktemp("carried")
    trainer_checkpoint(directory, config, model)
    return config, model, directory


def test_the_checkpoint_alone_exports_and_generates(carried, tmp_path) -> None:
    config, model, directory = carried
    out = tmp_path / "exported"
    result = runner.invoke(app, ["export", "--checkpoint", str(directory), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert config.config_hash() in result.output
    loaded = load_exported(out)
    assert loaded.model_config == config.model and loaded.config_hash == config.config_hash()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    sampled = runner.invoke(app, ["generate", "--checkpoint", str(directory), "-p", "def ", "-n", "20"])
    assert sampled.exit_code == 0, sampled.output
    assert sampled.output == (b"def " + generate(model, b"def ", 20)).decode("utf-8", errors="replace") + "\n"
    same = runner.invoke(
        app,
        export_args(directory, tmp_path / "same", *cli_sets([*TINY, "model.n_layer=2", "train.lr=0.002"])),
    )
    assert same.exit_code == 0, same.output  # an explicit config of the same hash is fine


def test_a_config_other_than_the_checkpoints_is_refused_naming_both(carried, tmp_path) -> None:
    config, _, directory = carried
    out = tmp_path / "exported"
    other = runner.invoke(app, export_args(directory, out, *cli_sets(TINY)))
    assert other.exit_code == 2
    given = config_of(TINY).config_hash()
    assert f"config hash {config.config_hash()!r} (recorded in the checkpoint)" in other.output
    assert f"--config {LOCAL_TINY}" in other.output and repr(given) in other.output
    overridden = runner.invoke(
        app, ["export", "--checkpoint", str(directory), "--out", str(out), "--set", "train.lr=0.5"]
    )
    assert overridden.exit_code == 2
    assert "the config stored in the checkpoint with --set train.lr=0.5" in overridden.output
    assert not out.exists()
    harmless = runner.invoke(
        app, ["export", "--checkpoint", str(directory), "--out", str(out), "--set", "train.device=cpu"]
    )
    assert harmless.exit_code == 0, harmless.output  # a per-peer key leaves the hash as it is


def test_exported_files_are_readable_by_others(carried, tmp_path) -> None:
    _, _, directory = carried
    old = os.umask(0o022)
    try:
        result = runner.invoke(app, ["export", "--checkpoint", str(directory), "--out", str(tmp_path / "x")])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "x").iterdir()}
    assert modes[MODEL_FILE] == 0o644 and set(modes.values()) == {0o644}, modes


@pytest.mark.multipeer
def test_a_volunteers_default_checkpoints_export_with_the_printed_command(
    spawn, swarm_home, tmp_path
) -> None:
    """A volunteer joins with the swarm's published config (no --config) and the default checkpoint
    directory: it says where its checkpoints go, and the export command its exit summary prints works
    with no other flag."""
    boot = spawn(swarm_cli("bootstrap", "--public-name", "entry", *cli_sets(tiny("train.max_steps=6"))))
    maddr = join_address(boot)
    joiner = spawn(
        swarm_cli(
            "join", "--initial-peers", maddr, "--public-name", "vol", "--set", "network.startup_timeout_s=120"
        ),
        env=ONE_THREAD,
    )
    assert joiner.wait(timeout=240) == 0, joiner.output()
    output = joiner.output()
    directory = swarm_home / "runs" / "swarm-local" / "vol" / "checkpoints"
    assert f"join: checkpoints go to {directory} (" in output, output
    assert "join: summary: trained 48 samples of the swarm's" in output, output
    (line,) = [x for x in output.splitlines() if x.startswith("join: summary: export the model with: ")]
    command = shlex.split(line.split(": ", 3)[-1])
    assert command[:4] == ["swarm", "export", "--checkpoint", str(directory)]
    out = tmp_path / "model"
    result = runner.invoke(app, [*command[1:-1], str(out)])
    assert result.exit_code == 0, result.output
    assert load_exported(out).progress["step"] == 6
    assert terminate_and_wait(boot) == 0
