"""The exported built-in GPT is a transformers GPT-2: from_pretrained and pipeline give swarm's numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from swarm.config import ModelSection, load_config
from swarm.export import MODEL_FILE, ExportedModel, export_model, generate, load_exported
from swarm.learning import GPT, build_model

transformers = pytest.importorskip("transformers")

SECTION = ModelSection(n_layer=2, n_head=4, n_embd=32, block_size=48)


def random_gpt(section: ModelSection = SECTION, seed: int = 0) -> GPT:
    """A GPT whose every tensor is random (biases and LayerNorms too, so a mapping error in any shows)."""
    model = build_model(section, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.2
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    assert isinstance(model, GPT)
    return model.eval()


def exported(model: GPT, section: ModelSection = SECTION, tokenizer=None) -> ExportedModel:
    progress = {"round": 2, "step": 20, "samples": 320}
    return ExportedModel(model, section, "run", "0123456789abcdef", progress, tokenizer)


def test_from_pretrained_gives_the_same_logits_and_generation(tmp_path: Path) -> None:
    model = random_gpt()
    out = export_model(exported(model), tmp_path / "gpt2")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    idx = torch.randint(256, (3, SECTION.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(idx), loaded(input_ids=idx).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours.softmax(-1) - theirs.softmax(-1)).abs().max() < 1e-5

    prompt = "def main():\n    "
    pipe = transformers.pipeline("text-generation", model=str(out))
    (result,) = pipe(prompt, max_new_tokens=24, do_sample=False, return_tensors=True)
    greedy = generate(model, prompt.encode(), 24, temperature=0)
    assert result["generated_token_ids"] == list(prompt.encode() + greedy)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("héllo")["input_ids"] == list("héllo".encode())
    assert tokenizer.decode(list(b"caf\xc3\xa9")) == "café"


def test_load_exported_gives_back_the_swarm_model(tmp_path: Path) -> None:
    model = random_gpt()
    out = export_model(exported(model), tmp_path / "gpt2")
    back = load_exported(out)
    assert isinstance(back.model, GPT) and back.model.lm_head.weight is back.model.wte.weight
    original = model.state_dict()
    for name, tensor in back.model.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    assert back.progress == {"round": 2, "step": 20, "samples": 320} and back.run_id == "run"


def test_the_older_private_layout_still_loads(tmp_path: Path) -> None:
    from safetensors.torch import save_model

    model = random_gpt()
    old = tmp_path / "old"
    old.mkdir()
    save_model(model, str(old / MODEL_FILE), metadata={"format": "pt"})
    meta = {**exported(model).metadata(), "format": "swarm-export/1"}
    (old / "config.json").write_text(json.dumps(meta))
    back = load_exported(old)
    assert generate(back.model, b"x = ", 16, seed=2) == generate(model, b"x = ", 16, seed=2)


def test_a_tokenized_run_exports_its_tokenizer(tmp_path: Path) -> None:
    from tests.test_tokenizer import train_tokenizer

    directory = train_tokenizer(tmp_path / "bpe", 300)
    config = load_config(None, overrides=[f"data.tokenizer={directory}", "model.block_size=32"], env={})
    assert config.model.vocab_size == 300
    model = random_gpt(config.model)
    from swarm.export._files import run_tokenizer

    out = export_model(exported(model, config.model, run_tokenizer(config)), tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer("import os\nprint(os.getcwd())", return_tensors="pt")["input_ids"]
    assert ids.max() >= 256  # BPE merges, not bytes
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - model(ids)).abs().max() < 1e-4


def test_a_bad_weights_file_is_named(tmp_path: Path) -> None:
    out = export_model(exported(random_gpt()), tmp_path / "gpt2")
    (out / MODEL_FILE).write_bytes(b"not safetensors")
    from swarm.export import ExportError

    with pytest.raises(ExportError, match=MODEL_FILE):
        load_exported(out)


def test_the_docs_transformers_example_runs_on_the_demo_model(tmp_path: Path, monkeypatch, capsys) -> None:
    """docs/export.md's example, verbatim, on an export of configs/local-tiny.yaml's model (64
    positions): the text it generates fills the context and stops there."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "export.md").read_text()
    (example,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "pipeline(" in b]
    demo = load_config(Path(__file__).resolve().parents[1] / "configs" / "local-tiny.yaml", env={})
    assert demo.model.block_size == 64
    export_model(exported(random_gpt(demo.model), demo.model), tmp_path / "exported")
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/export.md", "exec"), {})
    printed = capsys.readouterr().out
    assert printed.startswith("def main():\n    ")
    assert len(printed.removesuffix("\n").encode("utf-8", errors="surrogateescape")) >= 32
