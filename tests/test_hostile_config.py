"""Bad input of issue 28: a wrong ``model.hf_config`` is named in one line (exit 2), not a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from peers.cli import app

LLAMA = "configs/llama-1b.yaml"


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("model.hf_config={}", "model.hf_config.model_type"),
        ("model.hf_config.model_type=nosuch", "model.hf_config.model_type"),
        ("model.hf_config.model_type=[1,2]", "model.hf_config.model_type"),
        ("model.hf_config.hidden_size=-5", "model.hf_config.hidden_size"),
        ("model.hf_config.num_attention_heads=0", "model.hf_config.num_attention_heads"),
        ("model.hf_config.hidden_size=abc", "'hidden_size'"),
        ("model.hf_config.num_attention_heads=7", "attention heads"),
    ],
)
def test_config_check_names_a_bad_hf_config_in_one_line(setting: str, key: str) -> None:
    result = CliRunner().invoke(app, ["config", "check", LLAMA, "--set", setting])
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and key in lines[0], result.output
    assert "Traceback" not in result.output


def test_a_good_hf_config_still_passes() -> None:
    result = CliRunner().invoke(app, ["config", "check", LLAMA, "--no-estimate"])
    assert result.exit_code == 0, result.output
