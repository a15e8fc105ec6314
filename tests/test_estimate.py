"""Every shipped run config passes `swarm config check`, and the estimator's numbers are right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from peers.cli import app
from swarm.compression import HEADER_SIZE, get_codec
from swarm.config import load_config
from swarm.training import build_model, count_parameters
from swarm.training.estimate import activation_bytes, adamw_state_bytes, estimate_peer, model_shape

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
runner = CliRunner()


def test_there_are_public_configs() -> None:
    assert {"local-tiny.yaml", "gpt-125m.yaml", "llama-1b.yaml"} <= {path.name for path in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.name)
def test_every_config_passes_check_with_estimates(path: Path) -> None:
    result = runner.invoke(app, ["config", "check", str(path)])
    assert result.exit_code == 0, result.output
    assert "OK: " in result.output
    assert "memory per peer on cuda" in result.output
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
