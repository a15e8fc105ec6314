"""Every shipped run config passes `swarm config check`, and the estimator's numbers are right."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from peers.cli import app
from swarm.compression import HEADER_SIZE, get_codec
from swarm.config import load_config
from swarm.learning import build_model, count_parameters
from swarm.learning.estimate import (
    BASES_KEPT,
    TEMPORARY_COPIES,
    activation_bytes,
    adamw_state_bytes,
    estimate_peer,
    model_shape,
)
from tests._processes import heavy_scenario, swarm_cli

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
runner = CliRunner()


def test_there_are_public_configs() -> None:
    assert {"local-tiny.yaml", "gpt-125m.yaml", "llama-1b.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_config_passes_check_with_estimates(path: Path) -> None:
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "OK: " in result.output
    assert "memory per peer on " in result.output and "outer state in host memory" in result.output
    assert "wire per sync per peer" in result.output


def test_public_configs_have_the_advertised_sizes() -> None:
    assert 115e6 < estimate_peer(load_config("configs/gpt-125m.yaml", env={})).parameters < 135e6
    assert 0.9e9 < estimate_peer(load_config("configs/llama-1b.yaml", env={})).parameters < 1.2e9


def test_meta_count_equals_a_real_model_and_wire_bytes_equal_encoded_bytes() -> None:
    config = load_config("configs/local-tiny.yaml", env={})
    model = build_model(config.model, config.run.seed)
    estimate = estimate_peer(config, "cpu")
    assert estimate.parameters == count_parameters(model)
    codec = get_codec(config.compression.codec, config.compression.block_size, backend="torch")
    encoded = sum(HEADER_SIZE + codec.encode(p.detach()).nbytes for p in model.parameters())
    assert estimate.wire_delta == encoded
    assert estimate.inner_optimizer == 8 * estimate.parameters  # float32 AdamW on the CPU


def test_an_exchange_sends_the_change_after_the_round_and_holds_a_bfloat16_offer() -> None:
    # an exchange sends each model's change from the pair's base after the round (int4:
    # half the whole model's int8), and the base (the whole model) while it trains, every other round
    config = load_config("configs/local-tiny.yaml", env={})
    model = estimate_peer(config)
    assert 0.45 * model.wire_delta < model.wire_change < 0.55 * model.wire_delta
    assert model.wire_per_sync == model.wire_change + model.wire_delta / 2
    # ... and holds its offer as a bfloat16 progress, shared by overlapping exchanges, not float32 copies
    largest = max(p.numel() for p in build_model(config.model, 0).parameters())
    assert model.exchange_buffers - TEMPORARY_COPIES * 4 * largest == 2 * model.parameters
    assert model.exchange_frames == 2 * model.wire_delta


def test_the_shared_bases_are_counted_in_host_memory_for_gossip_only() -> None:
    from swarm.gossip._bases import MAX_BASES
    from swarm.learning.estimate import format_bytes
    from swarm.learning.estimate_report import describe_estimate

    assert BASES_KEPT == MAX_BASES  # the estimate's copy of the averager's bound
    models = estimate_peer(load_config("configs/local-tiny.yaml", env={}), "cpu")
    assert models.bases == MAX_BASES * models.wire_delta > 0  # whole models in compression.codec
    without = dataclasses.replace(models, bases=0)
    for host_state in (False, True):
        assert models.host_memory(host_state=host_state) - without.host_memory(host_state=host_state) == (
            models.bases
        )
    assert f"shared bases {format_bytes(models.bases)}" in " ".join(describe_estimate(models))
    for other in ("averaging.backend=allreduce", "averaging.backend=none"):
        config = load_config("configs/local-tiny.yaml", overrides=[other], env={})
        assert estimate_peer(config, "cpu").bases == 0, other


def test_8bit_adam_state_is_a_quarter_for_large_tensors() -> None:
    model = torch.nn.Linear(1024, 1024, bias=True)  # the bias is below bitsandbytes' 4096 threshold
    state = adamw_state_bytes(model, cuda=True)
    assert state == 2 * (1024 * 1024 + 4 * 4096) + 8 * 1024


def test_checkpointing_reduces_activations() -> None:
    config = load_config("configs/gpt-125m.yaml", env={})
    with torch.device("meta"):
        model = build_model(config.model, 0)
    full, checkpointed = activation_bytes(model_shape(config, model))
    assert checkpointed < full / 3
    estimate = estimate_peer(config)
    assert estimate.memory(True) < estimate.memory(False)


SHAPE = {"large": ("10", "640", "10"), "small": ("2", "32", "2")}
"""(layers, width, heads): a 49M-parameter GPT, and a tiny one whose trainers stand for everything
that does not grow with the model (the interpreter, torch, hivemind: the estimate's program term)."""


def _overrides(name: str) -> list[str]:
    layers, width, heads = SHAPE[name]
    return [
        f"model.n_layer={layers}",
        f"model.n_embd={width}",
        f"model.n_head={heads}",
        "model.block_size=32",
        "train.batch_size=1",  # micro-batch 1, as the estimate assumes
        "averaging.outer_lr=0.7",  # with momentum: the outer state is anchor and momentum
        "averaging.outer_momentum=0.9",
    ]


def _local_run(spawn, tmp_path: Path, name: str) -> Callable[[], dict]:
    """Start two gossip trainers of the ``name`` model that exchange in both roles, evaluate and publish
    their state every round and write a checkpoint on the way out; returns a function that waits for
    their summaries, each with its process's peak resident set."""
    summary, logs = tmp_path / f"{name}.json", tmp_path / name
    # 6 rounds: the first may pass before the records say the partner joined (a joining peer is not
    # dialled); the tiny model's steps are padded (an emulated device: no memory) to last about as
    # long as the large one's
    pace = ["emulation.step_time_s=0.5"] if name == "small" else []
    overrides = [
        *_overrides(name),
        *pace,
        "train.max_steps=18",
        "train.eval_batches=1",
        f"train.checkpoint_dir={logs / 'checkpoints'}",  # one on the way out
        "averaging.sync_every_steps=3",
        # a loaded machine takes seconds to snapshot the large model for a partner: patience, so that
        # a handshake does not time out (and the partner get banned for it)
        "averaging.chunk_timeout_s=60",
        "averaging.exchange_timeout_s=120",
        "network.record_interval_s=1",
        "network.record_ttl_s=4",
    ]
    args = ["local", "--peers", "2", "--config", "configs/local-tiny.yaml", "--summary", str(summary)]
    local = spawn(swarm_cli(*args, *(f"--set={o}" for o in overrides), "--log-dir", str(logs)))

    def summaries() -> dict:
        assert local.wait(timeout=800) == 0, local.output()
        return json.loads(summary.read_text())

    return summaries


@heavy_scenario
@pytest.mark.multipeer
@pytest.mark.timeout(900)
def test_the_estimate_matches_the_measured_peak_memory(spawn, tmp_path: Path) -> None:
    """CPU, a 49M-parameter GPT: the peak resident set of its trainers, over that of a tiny model's
    trainers (the interpreter, torch and hivemind), is what the estimate says the model adds, within
    10%: weights, gradients, AdamW, activations, anchor and momentum, the residual, the sync path's
    snapshot, the partners' frames and the shared base, a state published every round and a checkpoint
    on the way out.

    On the CPU the device is the host: both layouts put the same bytes in the same memory, so the
    one measurement checks the total of each (the device's part plus the host's)."""
    runs = _local_run(spawn, tmp_path, "small"), _local_run(spawn, tmp_path, "large")
    small, large = (summaries() for summaries in runs)  # side by side: a peak is per process
    for run in (small, large):  # the buffers were used
        why = [(peer["rounds_by_role"], peer["exchanges_failed_by_cause"]) for peer in run["per_peer"]]
        assert all(peer["exchanges_ok"] > 0 for peer in run["per_peer"]), why
    measured = min(p["peak_rss_bytes"] for p in large["per_peer"]) - max(
        p["peak_rss_bytes"] for p in small["per_peer"]
    )

    def estimated(name: str) -> tuple[int, int, int]:
        config = load_config("configs/local-tiny.yaml", overrides=_overrides(name), env={})
        # what this run holds: no joiner's download (both start fresh, and a joiner's peak is the larger
        # host term only where it exceeds the steady one), and one shared base each (one partner); the
        # estimate's own terms for those are the public swarm's bounds
        e = estimate_peer(config, "cpu")
        e = dataclasses.replace(e, joining=0, joining_on_host=0, bases=e.bases // BASES_KEPT)
        total = e.device_memory(False) + e.host_memory()
        split = e.device_memory(False, host_state=True) + e.host_memory(host_state=True)
        return e.parameters, total, split

    params, total, split = (a - b for a, b in zip(estimated("large"), estimated("small"), strict=True))
    growth, estimate = measured / 2**20, total / 2**20
    print(f"{params:,} parameters: peak RSS growth {growth:.1f} MiB, estimated {estimate:.1f} MiB")
    assert params >= 45_000_000
    # the program term: a tiny model's trainer is the program and next to nothing else
    program = estimate_peer(
        load_config("configs/local-tiny.yaml", overrides=_overrides("small"), env={}), "cpu"
    )
    for peer in small["per_peer"]:
        assert 0.75 * program.program < peer["peak_rss_bytes"] < 1.25 * program.program
    # measured: 1.00 of the estimate; 10% is tighter than the 15% asked of it, so that a whole-model
    # float32 term (4 bytes a parameter, 12% here) missed or counted twice fails
    for expected in (total, split):
        assert 0.9 * expected < measured < 1.1 * expected


# ------------------------------------------------------------- `config check --device-memory --host-memory`


def test_memory_sizes_parse_in_binary_units_and_garbage_is_named() -> None:
    from swarm.learning.fit import parse_memory_size

    assert parse_memory_size("12GiB") == parse_memory_size("12 GB") == parse_memory_size("12g") == 12 << 30
    assert parse_memory_size("800MiB") == 800 << 20 and parse_memory_size("1048576") == 1 << 20
    assert parse_memory_size("1.5 GiB") == 3 << 29
    for bad in ("", "12 apples", "GiB", "-3GiB", "0", "12iB", "1e999GiB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_memory_size(bad)


def _llama(*overrides: str):
    return load_config("configs/llama-1b.yaml", overrides=list(overrides), env={})


def test_a_peer_fits_in_the_layout_the_trainer_would_take_and_else_is_told_what_to_change() -> None:
    """Limits set around the estimate's own numbers: just above a layout's need it fits, just below it
    does not, and the advice names the setting that would make it fit."""
    from swarm.learning.fit import DEVICE_HEADROOM, fit_peer

    config = _llama()  # activation checkpointing on, outer_state_device auto
    estimate = estimate_peer(config, "cuda")
    on_device = estimate.device_footprint(True)  # the tensors, the allocator's slack and the context
    split = estimate.device_footprint(True, host_state=True)
    host_need = estimate.host_memory(host_state=True)

    roomy = fit_peer(config, estimate, int(on_device / DEVICE_HEADROOM) + 1, None)
    assert roomy.fits and not roomy.layout.host_state  # auto keeps the outer state on a large device
    mid = fit_peer(config, estimate, int(on_device / DEVICE_HEADROOM) - 1, host_need)
    assert mid.fits and mid.layout.host_state and mid.layout.device_bytes == split  # auto moves it
    short_host = fit_peer(config, estimate, int(on_device / DEVICE_HEADROOM) - 1, host_need - 1)
    assert not short_host.fits and any("host memory" in line for line in short_host.advice)
    tiny_device = fit_peer(config, estimate, split - 1, None)
    assert not tiny_device.fits and any("pipeline stages" in line for line in tiny_device.advice)

    unchecked = _llama("train.activation_checkpointing=false")
    plain = estimate_peer(unchecked, "cuda")
    between = split + 1  # enough with checkpointing, too little without it
    assert plain.device_footprint(False, host_state=True) > between
    advice = fit_peer(unchecked, plain, between, None).advice
    assert advice and "train.activation_checkpointing: true" in advice[0]
    pinned = _llama("averaging.outer_state_device=device")
    pinned_fit = fit_peer(pinned, estimate_peer(pinned, "cuda"), on_device - 1, None)
    assert not pinned_fit.fits and any("outer_state_device: auto" in line for line in pinned_fit.advice)


def test_config_check_exits_1_when_the_peer_does_not_fit_and_0_when_it_does() -> None:
    small = runner.invoke(app, ["config", "check", "configs/llama-1b.yaml", "--device-memory", "10GiB"])
    assert small.exit_code == 1, small.output
    assert "does NOT fit" in small.output and "pipeline stages" in small.output
    large = runner.invoke(
        app, ["config", "check", "configs/llama-1b.yaml", "--device-memory", "80GiB", "--host-memory", "1TiB"]
    )
    assert large.exit_code == 0 and "this peer fits" in large.output, large.output
    garbage = runner.invoke(app, ["config", "check", "configs/llama-1b.yaml", "--host-memory", "lots"])
    assert garbage.exit_code == 2 and "not a memory size: 'lots'" in garbage.output
