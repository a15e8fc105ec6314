"""Data for real runs: prepared token directories (data.source tokens) and the hf source's options.

Nothing is downloaded: the text is a few standard-library files, and the hf "datasets" are local
in-memory ones behind a monkeypatched ``datasets.load_dataset``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from peers.cli import app
from swarm.config import ConfigError, DataSection, load_config
from swarm.learning import TokenFile, TokenFileError, TrainBatches, open_source, prepare_tokens, stdlib_files
from swarm.learning.data import HFStreamSource

BLOCK = 16
BATCH = 8
runner = CliRunner()


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Forty standard-library files (about 1 MB): enough pieces for a held-out split by content."""
    directory = tmp_path_factory.mktemp("text")
    for path in [p for p in stdlib_files() if 10_000 < p.stat().st_size < 60_000][:40]:
        shutil.copy(path, directory / path.name)
    return directory


def files_data(text_dir: Path, **extra: object) -> DataSection:
    return DataSection(source="files", paths=[str(text_dir)], eval_fraction=0.05, **extra)


def tokens_data(directory: Path, **extra: object) -> DataSection:
    return DataSection(source="tokens", paths=[str(directory)], eval_fraction=0.05, **extra)


@pytest.fixture(scope="module")
def prepared(text_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "tokens"
    prepare_tokens(files_data(text_dir), out, chunk_bytes=4096)  # many chunks: lazy checks are visible
    return out


def batches_of(source, peer: str, count: int, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    stream = TrainBatches(source, BLOCK, BATCH, peer_key=peer, seed=3, start_sample=start)
    return [next(stream) for _ in range(count)]


def test_prepared_tokens_give_the_batches_of_the_text(text_dir: Path, prepared: Path) -> None:
    text = open_source(files_data(text_dir))
    tokens = open_source(tokens_data(prepared))
    assert isinstance(tokens, TokenFile)
    index = json.loads((prepared / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["tokenizer"] == "bytes"
    assert (prepared / "train.bin").stat().st_size == 2 * len(text.train) == 2 * index["train"]["count"]
    assert torch.equal(tokens.eval.long(), text.eval.long())
    epoch = len(text.train) // (BLOCK + 1) // BATCH
    for peer, count in (("a", epoch + 5), ("b", 50)):  # into the second epoch (another phase)
        for (x1, y1), (x2, y2) in zip(
            batches_of(text, peer, count), batches_of(tokens, peer, count), strict=True
        ):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
            assert x2.dtype == torch.int64
    # two peers start on different shards: their first batches share no window
    first_a = {tuple(row.tolist()) for x, _ in batches_of(tokens, "a", 4) for row in x}
    first_b = {tuple(row.tolist()) for x, _ in batches_of(tokens, "b", 4) for row in x}
    assert not first_a & first_b


class CountingTokens:
    """A memory-mapped token array that counts the tokens read through fancy indexing (window gathers)."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens, self.gathered = tokens, 0

    def __getitem__(self, index):
        if isinstance(index, np.ndarray):
            self.gathered += index.size
        return self.tokens[index]


def test_resume_by_offset_reads_only_what_it_trains_on(prepared: Path) -> None:
    fresh = TokenFile(prepared, tokenizer=None, eval_fraction=0.05)
    expected = batches_of(fresh, "p", 400)
    resumed = TokenFile(prepared, tokenizer=None, eval_fraction=0.05)
    resumed._tokens = CountingTokens(resumed._tokens)  # type: ignore[assignment]
    ((x, y),) = batches_of(resumed, "p", 1, start=397 * BATCH)
    assert torch.equal(x, expected[397][0]) and torch.equal(y, expected[397][1])
    # The 397 skipped batches were never read: what was gathered is at most a shard's windows.
    per_shard = -(-fresh.train_tokens // (BLOCK + 1) // 1024)
    assert 0 < resumed._tokens.gathered <= (BATCH + per_shard) * (BLOCK + 1) < 397 * BATCH * (BLOCK + 1)


def test_a_batch_is_drawn_as_the_trainer_resumes_it(prepared: Path) -> None:
    config = load_config(
        None,
        overrides=["data.source=tokens", f"data.paths=[{prepared}]", "data.eval_fraction=0.05"],
        env={},
    )
    source = open_source(config.data)
    whole = TrainBatches.of_peer(source, config, "peer", start_sample=0)
    drawn = [next(whole) for _ in range(3)]
    resumed = TrainBatches.of_peer(source, config, "peer", start_sample=whole.samples_drawn)
    assert torch.equal(next(resumed)[0], next(whole)[0])
    assert not torch.equal(drawn[-1][0], next(resumed)[0])


def copy_of(prepared: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    return copy


def test_a_truncated_token_file_is_named(prepared: Path, tmp_path: Path) -> None:
    copy = copy_of(prepared, tmp_path)
    with open(copy / "train.bin", "r+b") as handle:
        handle.truncate((copy / "train.bin").stat().st_size - 2)
    with pytest.raises(TokenFileError, match=r"train\.bin: \d+ bytes, the index says .* truncated"):
        TokenFile(copy, tokenizer=None, eval_fraction=0.05)


def test_a_corrupt_chunk_is_refused_before_it_is_trained_on(prepared: Path, tmp_path: Path) -> None:
    copy = copy_of(prepared, tmp_path)
    with open(copy / "train.bin", "r+b") as handle:
        handle.seek(3 * 4096 + 10)
        byte = handle.read(1)
        handle.seek(3 * 4096 + 10)
        handle.write(bytes([byte[0] ^ 1]))
    tokens = TokenFile(copy, tokenizer=None, eval_fraction=0.05)  # opening reads no training chunk
    with pytest.raises(TokenFileError, match=r"bytes 12288\.\.16384 \(chunk 4 of \d+\) do not match"):
        tokens.verify()
    stream = TrainBatches(tokens, BLOCK, BATCH, peer_key="p", seed=3)
    with pytest.raises(TokenFileError, match="corrupt"):
        for _ in range(10_000):  # a few epochs: some window touches the chunk
            next(stream)
    result = runner.invoke(app, ["data", "verify", str(copy), "--set", "data.eval_fraction=0.05"])
    assert result.exit_code == 2 and "chunk 4 of" in result.output


def test_a_corrupt_held_out_file_is_refused_when_opened(prepared: Path, tmp_path: Path) -> None:
    copy = copy_of(prepared, tmp_path)
    data = bytearray((copy / "eval.bin").read_bytes())
    data[0] ^= 0xFF
    (copy / "eval.bin").write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match=r"eval\.bin: bytes 0\.\.4096 \(chunk 1 of"):
        TokenFile(copy, tokenizer=None, eval_fraction=0.05)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda index: "{not json", "not valid JSON"),
        (lambda index: {**index, "format": "other/1"}, "not a token index"),
        (lambda index: {**index, "dtype": "float32"}, "dtype 'float32' is not one of"),
        (lambda index: {**index, "chunk_bytes": 3}, "chunk_bytes 3 is not an integer"),
        (lambda index: {**index, "vocab_size": 1 << 20}, "vocab_size 1048576 does not fit dtype uint16"),
        (lambda index: {**index, "train": {**index["train"], "count": 5}}, "train.digests must list 1"),
        (lambda index: {**index, "train": {**index["train"], "count": -1}}, "train.count -1 is not"),
        (lambda index: {**index, "eval": {"count": 1}}, "eval.digests must list 1"),
        (lambda index: {**index, "checksum": "0" * 32}, "checksum does not match"),
    ],
)
def test_a_bad_index_is_named(prepared: Path, tmp_path: Path, edit, message: str) -> None:
    copy = copy_of(prepared, tmp_path)
    index = json.loads((copy / "index.json").read_text())
    edited = edit(index)
    (copy / "index.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(TokenFileError, match="index.json: " + message.replace("(", r"\(")):
        TokenFile(copy, tokenizer=None, eval_fraction=0.05)


def test_a_directory_of_another_config_is_refused(prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenFileError, match=r"eval_fraction 0.05, the config has 0.01"):
        TokenFile(prepared, tokenizer=None, eval_fraction=0.01)
    with pytest.raises(TokenFileError, match="not a directory"):
        TokenFile(tmp_path / "nothing", tokenizer=None, eval_fraction=0.05)
    with pytest.raises(TokenFileError, match="cannot read the token index"):
        TokenFile(tmp_path, tokenizer=None, eval_fraction=0.05)


def test_an_output_that_holds_the_text_is_refused_and_the_text_kept(tmp_path: Path) -> None:
    """``prepare --out corpus --overwrite`` with ``data.paths: [corpus]`` would replace the directory
    it reads: refused before anything is written, the text untouched."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the text to train on\n" * 50)
    for out in (corpus, tmp_path):
        with pytest.raises(ValueError, match="is inside the output"):
            prepare_tokens(files_data(corpus), out, overwrite=True)
    assert (corpus / "a.txt").read_text() == "the text to train on\n" * 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus"]


def test_prepared_bpe_tokens_match_the_tokenized_text(text_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.test_tokenizer import train_tokenizer

    tokenizer = train_tokenizer(tmp_path / "bpe", 300)
    few = tmp_path / "text"
    few.mkdir()
    for path in sorted(text_dir.iterdir())[:12]:
        shutil.copy(path, few / path.name)
    data = files_data(few, tokenizer=str(tokenizer))
    tokens = prepare_tokens(data, tmp_path / "tokens")
    text = open_source(data)
    assert tokens.unit == "token" and tokens.checksum in (tmp_path / "tokens" / "index.json").read_text()
    assert torch.equal(tokens.eval.long(), text.eval.long())
    for (x1, _), (x2, _) in zip(batches_of(text, "a", 30), batches_of(tokens, "a", 30), strict=True):
        assert torch.equal(x1, x2)
    with pytest.raises(TokenFileError, match=r"prepared with tokenizer 'sha256:.*data.tokenizer is 'bytes'"):
        TokenFile(tmp_path / "tokens", tokenizer=None, eval_fraction=0.05)


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path: Path) -> None:
    from swarm.learning._token_file import EVAL_FILE, TRAIN_FILE, TokenWriter, dtype_for

    assert (dtype_for(256), dtype_for(65536), dtype_for(65537)) == ("uint16", "uint16", "uint32")
    writer = TokenWriter(tmp_path / TRAIN_FILE, "uint32", 100_000)
    writer.write(np.array([0, 65_536, 99_999]))
    with pytest.raises(ValueError, match=r"outside 0\.\.99999"):
        writer.write(np.array([100_000]))
    writer.close()
    assert np.array_equal(np.fromfile(tmp_path / TRAIN_FILE, dtype="<u4"), [0, 65_536, 99_999])
    assert not (tmp_path / EVAL_FILE).exists()


class FakeDatasets:
    """``datasets.load_dataset`` serving in-memory documents (a real IterableDataset), recording calls."""

    def __init__(self, records: list[dict[str, object]]) -> None:
        import datasets

        self.calls: list[tuple] = []
        self._dataset = datasets.Dataset.from_list(records).to_iterable_dataset()

    def load_dataset(self, path: str, name: str | None = None, **options: object):
        self.calls.append((path, name, options))
        return self._dataset


def documents(count: int = 400) -> list[dict[str, object]]:
    return [{"content": f"doc {i}: the quick brown fox {i * 7} jumps", "id": i} for i in range(count)]


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch) -> FakeDatasets:
    datasets = pytest.importorskip("datasets")
    fake = FakeDatasets(documents())
    monkeypatch.setattr(datasets, "load_dataset", fake.load_dataset)
    return fake


HF_SUBSET = {"source": "hf", "hf_dataset": "org/corpus", "hf_config": "sample-10BT", "split": "validation"}


def test_hf_source_streams_the_subset_split_and_field(fake_hub: FakeDatasets) -> None:
    source = open_source(DataSection(**HF_SUBSET, text_field="content", eval_fraction=0.1))
    assert fake_hub.calls == [("org/corpus", "sample-10BT", {"split": "validation", "streaming": True})]
    windows = [torch.cat([x, y[:, -1:]], 1) for x, y in batches_of(source, "a", 20)]
    text = b"".join(bytes(row.tolist()) for rows in windows for row in rows)
    assert b"the quick brown fox" in text
    assert b"doc " in bytes(source.eval.tolist())
    missing = open_source(DataSection(**HF_SUBSET, eval_fraction=0.1))  # text_field "text"
    with pytest.raises(
        ValueError, match=r"no field 'text' \(it has \['content', 'id'\]\); set data.text_field"
    ):
        next(TrainBatches(missing, BLOCK, BATCH, peer_key="a", seed=0))
    wrong = open_source(DataSection(**HF_SUBSET, text_field="id", eval_fraction=0.1))
    with pytest.raises(ValueError, match="field 'id' holds int, not text"):
        next(TrainBatches(wrong, BLOCK, BATCH, peer_key="a", seed=0))


def test_hf_stream_resumes_at_the_next_batch(fake_hub: FakeDatasets) -> None:
    source = open_source(DataSection(**HF_SUBSET, text_field="content", eval_fraction=0.1))
    expected = batches_of(source, "a", 30)  # more than one pass over the 400 documents
    ((x, y),) = batches_of(source, "a", 1, start=27 * BATCH)
    assert torch.equal(x, expected[27][0]) and torch.equal(y, expected[27][1])


def test_prepare_of_an_hf_stream_keeps_its_order_and_held_out_split(fake_hub, tmp_path: Path) -> None:
    data = DataSection(**HF_SUBSET, text_field="content", eval_fraction=0.1)
    tokens = prepare_tokens(data, tmp_path / "tokens", max_tokens=5_000)
    assert tokens.train_tokens == 5_000
    streamed = HFStreamSource(fake_hub._dataset, 0.1, text_field="content")
    assert torch.equal(tokens.eval.long(), streamed.eval.long())
    train = np.fromfile(tmp_path / "tokens" / "train.bin", dtype="<u2").astype(np.uint8).tobytes()
    documents_in_order = b"".join(text for text, held_out in streamed.split_documents() if not held_out)
    assert train == documents_in_order[:5_000]
    assert not any(text in train for text, held_out in streamed.split_documents() if held_out)


def test_data_keys_are_checked_and_hashed(tmp_path: Path) -> None:
    base = load_config(None, overrides=["data.source=hf", "data.hf_dataset=org/corpus"], env={})
    assert {"hf_config", "split", "text_field"} <= set(base.swarm_view()["data"])
    subset = load_config(
        None, overrides=["data.source=hf", "data.hf_dataset=org/corpus", "data.hf_config=sample-10BT"], env={}
    )
    assert subset.config_hash() != base.config_hash()
    for overrides, message in (
        (["data.source=tokens"], "exactly one directory"),
        (["data.source=tokens", "data.paths=[a, b]"], "exactly one directory"),
        (["data.split="], "data.split"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides=overrides, env={})


def test_data_prepare_cli_writes_a_directory_peers_train_on(text_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "tokens"
    sets = [
        "--set",
        "data.source=files",
        "--set",
        f"data.paths=[{text_dir}]",
        "--set",
        "data.eval_fraction=0.05",
    ]
    result = runner.invoke(app, ["data", "prepare", *sets, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "data.source=tokens" in result.output
    again = runner.invoke(app, ["data", "prepare", *sets, "--out", str(out)])
    assert again.exit_code == 2 and "not empty" in again.output
    ok = runner.invoke(app, ["data", "verify", str(out), "--set", "data.eval_fraction=0.05"])
    assert ok.exit_code == 0 and ok.output.startswith(f"OK: {out}"), ok.output
    refused = runner.invoke(
        app, ["data", "prepare", "--set", "data.source=tokens", "--set", f"data.paths=[{out}]", "--out", "x"]
    )
    assert refused.exit_code == 2 and "give the config of the text to prepare" in refused.output
