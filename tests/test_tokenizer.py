"""data.tokenizer: a transformers tokenizer in the config, the data pipeline and the evaluation.

The tokenizers are trained here with the `tokenizers` library on the standard library's text and saved
as transformers-loadable directories: nothing is downloaded.
"""

from __future__ import annotations

import math
import shutil
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from peers._trainer_output import format_sync_line
from swarm import _tokenizer
from swarm.config import ConfigError, diff_configs, load_config
from swarm.learning import stdlib_files
from swarm.learning.data import corpus_from_files
from swarm.network import NetworkOptions
from swarm.trainer import SyncReport, TrainingPeer
from tests.workers.tiny import TINY

pytest.importorskip("transformers")
EOT = "<|endoftext|>"


def small_files(count: int = 24) -> list[Path]:
    """Standard-library files under one 64 KiB piece each, so each is split as a whole."""
    return [path for path in stdlib_files() if 2_000 < path.stat().st_size < 60_000][:count]


def train_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens trained on standard-library text, saved there."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [path.read_text(errors="replace") for path in small_files(60)[30:]]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, special_tokens=[EOT])
    bpe.train_from_iterator(text, trainer)
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOT).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def bpe512(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tokenizer(tmp_path_factory.mktemp("bpe512"), 512)


def config_with(tokenizer: Path | str, *overrides: str):
    return load_config(None, overrides=[f"data.tokenizer={tokenizer}", *overrides], env={})


def test_vocab_size_comes_from_the_tokenizer_and_the_hash_from_its_content(bpe512, tmp_path) -> None:
    config = config_with(bpe512)
    assert config.model.vocab_size == 512
    assert config_with(bpe512, "model.vocab_size=576").model.vocab_size == 576  # padded: allowed
    with pytest.raises(
        ConfigError, match=r"data.tokenizer has 512 tokens, more than the model's vocab_size 300"
    ):
        config_with(bpe512, "model.vocab_size=300")
    byte_level = load_config(None, env={})
    assert byte_level.swarm_view()["data"]["tokenizer"] is None
    assert config.config_hash() != byte_level.config_hash()
    copy = shutil.copytree(bpe512, tmp_path / "elsewhere" / "same-tokenizer")
    assert config_with(copy).config_hash() == config.config_hash()  # content, not path
    other = train_tokenizer(tmp_path / "bpe400", 400)
    assert diff_configs(config, config_with(other, "model.vocab_size=512")) == ["data.tokenizer"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "missing", "no tokenizer directory"),
        (lambda tmp: tmp, "cannot load a tokenizer in the local directory"),
        (lambda tmp: Path(__file__), "is not a directory"),
    ],
)
def test_a_bad_tokenizer_is_a_config_error_that_names_it(make, message, tmp_path) -> None:
    spec = make(tmp_path)
    with pytest.raises(ConfigError, match=message) as info:
        config_with(spec)
    assert str(info.value).startswith("data.tokenizer: ") and str(spec) in str(info.value)


def test_without_transformers_the_error_says_what_to_install(bpe512, monkeypatch) -> None:
    _tokenizer._load.cache_clear()
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    try:
        with pytest.raises(ConfigError, match=r"data.tokenizer: .*pip install swarm\[hf\]"):
            config_with(bpe512)
    finally:
        _tokenizer._load.cache_clear()


def test_tokens_hold_the_same_held_out_text_as_bytes(bpe512) -> None:
    """Bits per byte compare across tokenizers because every tokenizer is scored on the same text."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(bpe512), local_files_only=True)
    tokenizer = _tokenizer.load_tokenizer(str(bpe512))
    files = small_files()
    by_bytes = corpus_from_files(files, eval_fraction=0.25)
    by_tokens = corpus_from_files(files, eval_fraction=0.25, tokenizer=tokenizer)
    assert (by_tokens.unit, by_tokens.train.dtype, by_tokens.tokenizer) == ("token", torch.int32, tokenizer)
    assert int(by_tokens.train.min()) >= 0 and int(by_tokens.train.max()) < 512
    for tokens, raw in ((by_tokens.eval, by_bytes.eval), (by_tokens.train, by_bytes.train)):
        assert hf.decode(tokens.tolist()) == bytes(raw.tolist()).decode("utf-8", errors="replace")
    assert len(by_tokens.eval) < 0.7 * len(by_bytes.eval)  # a token holds more than one byte


def test_a_tokenized_run_learns_and_reports_bits_per_token_and_per_byte(bpe512) -> None:
    from transformers import AutoTokenizer

    paths = "[" + ", ".join(str(p) for p in small_files()) + "]"
    overrides = [*TINY, "data.source=files", f"data.paths={paths}", "data.eval_fraction=0.25"]
    overrides += ["averaging.backend=none", "averaging.sync_every_steps=10", "train.eval_batches=2"]
    overrides += [
        "averaging.outer_lr=1",
        "averaging.outer_momentum=0",
        "averaging.nesterov=false",
    ]  # plain AdamW
    config = config_with(bpe512, *overrides)
    reports: list[SyncReport] = []
    peer = TrainingPeer(config, NetworkOptions(), on_sync=reports.append)
    try:
        peer.run(threading.Event(), max_steps=80)
        record = peer.node.record()
        model, eval_set = peer.model, peer.eval_set
    finally:
        peer.close()
    assert [r.step for r in reports] == list(range(10, 81, 10))
    first, last = reports[0], reports[-1]
    assert last.loss < first.loss - 0.5 and last.eval_loss < first.eval_loss - 0.3  # it learns
    assert first.loss > 7.0  # bits/token of a barely trained model over 512 tokens, not nats (< ln 512)
    assert {r.loss_unit for r in reports} == {"bits/token"} and record.loss_unit == "bits/token"
    assert (record.eval_loss, record.eval_bits_per_byte) == (last.eval_loss, last.eval_bits_per_byte)
    line = format_sync_line(last)
    assert (
        f"eval {last.eval_loss:.3f} bits/token " in line
        and f"eval {last.eval_bits_per_byte:.3f} bits/byte" in line
    )

    # independently: the bits of every target token over the UTF-8 bytes those tokens decode to
    hf = AutoTokenizer.from_pretrained(str(bpe512), local_files_only=True)
    bits = tokens = text_bytes = 0.0
    with torch.no_grad():
        for x, y in eval_set.batches(2):
            logits = model(x)
            bits += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")) / math.log(2)
            tokens += y.numel()
            text_bytes += sum(len(hf.decode(row.tolist()).encode("utf-8")) for row in y)
    assert last.eval_loss == pytest.approx(bits / tokens, rel=1e-4)
    assert last.eval_bits_per_byte == pytest.approx(bits / text_bytes, rel=1e-4)
    assert last.eval_bits_per_byte == pytest.approx(last.eval_loss * tokens / text_bytes, rel=1e-4)
    assert text_bytes > 1.5 * tokens  # so bits per byte is well apart from bits per token


def test_a_streamed_dataset_is_tokenized_too(bpe512, tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    lines = [f"x{i} = f({i * 7})  # the quick brown fox jumps over the lazy dog" for i in range(300)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    stream = datasets.load_dataset("text", data_files=str(path), split="train", streaming=True)
    tokenizer = _tokenizer.load_tokenizer(str(bpe512))
    from swarm.learning import HFStreamSource, TrainBatches, make_eval_set

    source = HFStreamSource(stream, eval_fraction=0.1, shuffle_buffer=50, tokenizer=tokenizer)
    eval_set = make_eval_set(source, 16, 4)
    assert (eval_set.unit, eval_set.loss_unit, eval_set.tokenizer) == ("token", "bits/token", tokenizer)
    held_out = tokenizer.hf.decode(source.eval.tolist()).splitlines()
    assert held_out and set(held_out) < set(lines)  # whole held-out documents, decoded back
    x, y = next(TrainBatches(source, 16, 8, peer_key="a", seed=0))
    assert x.shape == (8, 16) and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < 512
    assert eval_set.target_bytes(1) > 16 * 4  # the evaluated tokens decode to more bytes than tokens
