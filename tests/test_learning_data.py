"""Data: sources, per-peer shards, the held-out split and bits-per-byte evaluation."""

from __future__ import annotations

import logging
import math
import sysconfig
from pathlib import Path

import pytest
import torch
from torch import nn

from swarm.config import DataSection, TrainSection
from swarm.learning import (
    GPT,
    Corpus,
    EvalSet,
    InnerTrainer,
    TrainBatches,
    evaluate,
    make_eval_set,
    open_source,
    stdlib_files,
    unigram_bits,
)
from swarm.learning.data import HFStreamSource, corpus_from_files, expand_paths, is_held_out

BLOCK = 16


def random_corpus(size: int = 60_000, seed: int = 0) -> Corpus:
    """Random bytes: two different windows are (almost surely) never equal, so overlap is visible."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(256, (size,), generator=generator, dtype=torch.uint8)
    return Corpus(name="random", train=data, eval=data[:1000].clone(), documents=1)


def rows(batches: TrainBatches, count: int) -> list[bytes]:
    return [bytes(row.tolist()) for _ in range(count) for row in next(batches)[0].to(torch.uint8)]


def test_stdlib_files_skip_site_packages_and_tests() -> None:
    files = stdlib_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert not any({"site-packages", "test", "tests"} & set(f.parts) for f in files)
    # exactly the .py files a full listing finds outside those directories
    root = Path(sysconfig.get_paths()["stdlib"])
    skipped = {"site-packages", "dist-packages", "test", "tests", "__pycache__"}
    listed = [p for p in root.rglob("*.py") if p.is_file() and not skipped & set(p.relative_to(root).parts)]
    assert files == sorted(listed)


def test_batches_are_shifted_int64_pairs() -> None:
    x, y = next(TrainBatches(random_corpus(), BLOCK, 8, peer_key="a", seed=0))
    assert x.shape == y.shape == (8, BLOCK)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_same_peer_key_gives_the_same_order_and_others_differ() -> None:
    corpus = random_corpus()
    first = rows(TrainBatches(corpus, BLOCK, 8, peer_key="peer-a", seed=0), 10)
    again = rows(TrainBatches(corpus, BLOCK, 8, peer_key="peer-a", seed=0), 10)
    other_seed = rows(TrainBatches(corpus, BLOCK, 8, peer_key="peer-a", seed=1), 10)
    assert first == again
    assert first != other_seed


def test_two_peers_read_disjoint_windows() -> None:
    corpus = random_corpus()
    a = rows(TrainBatches(corpus, BLOCK, 8, peer_key="peer-a", seed=0), 20)
    b = rows(TrainBatches(corpus, BLOCK, 8, peer_key="peer-b", seed=0), 20)
    assert len(set(a)) == len(a)
    assert not set(a) & set(b)


def test_an_epoch_covers_every_window_once() -> None:
    corpus = random_corpus(size=17 * 200)  # 200 windows, 199 when the epoch's phase is not 0
    seen = rows(TrainBatches(corpus, BLOCK, 199, peer_key="p", seed=0), 1)
    whole = bytes(corpus.train.tolist())
    assert len(set(seen)) == 199
    assert all(row in whole for row in seen)


def test_resume_continues_the_same_order() -> None:
    corpus = random_corpus()
    full = rows(TrainBatches(corpus, BLOCK, 8, peer_key="p", seed=0), 30)
    resumed = TrainBatches(corpus, BLOCK, 8, peer_key="p", seed=0, start_sample=8 * 12)
    assert rows(resumed, 18) == full[8 * 12 :]
    assert resumed.samples_drawn == 8 * 30


def test_a_batch_given_back_comes_next_and_is_not_counted() -> None:
    corpus = random_corpus()
    full = rows(TrainBatches(corpus, BLOCK, 8, peer_key="p", seed=0), 6)
    batches = TrainBatches(corpus, BLOCK, 8, peer_key="p", seed=0)
    assert rows(batches, 3) == full[: 8 * 3]
    batches.give_back()  # the step that drew the third batch was abandoned
    assert batches.samples_drawn == 8 * 2
    resumed = TrainBatches(corpus, BLOCK, 8, peer_key="p", seed=0, start_sample=batches.samples_drawn)
    assert rows(resumed, 4) == full[8 * 2 :]  # a peer resumed from the count trains it next
    batches.give_back()
    batches.give_back()  # only the last batch can be given back, once
    assert batches.samples_drawn == 8 * 2
    assert rows(batches, 4) == full[8 * 2 :]  # so does this one
    assert batches.samples_drawn == 8 * 6


def write_documents(directory: Path, count: int) -> list[bytes]:
    directory.mkdir()
    texts = []
    for i in range(count):
        text = f"document number {i} says hello {i * i}\n".encode() * 20
        (directory / f"doc{i:03d}.txt").write_bytes(text)
        texts.append(text)
    return texts


def test_held_out_split_is_disjoint_from_training_text(tmp_path: Path) -> None:
    texts = write_documents(tmp_path / "docs", 200)
    corpus = corpus_from_files(expand_paths([str(tmp_path / "docs")]), eval_fraction=0.1)
    train, held_out = bytes(corpus.train.tolist()), bytes(corpus.eval.tolist())
    in_eval = [t for t in texts if t in held_out]
    assert 5 <= len(in_eval) <= 40
    assert all((t in held_out) != (t in train) for t in texts)
    assert all(is_held_out(t, 0.1) for t in in_eval)
    assert len(train) + len(held_out) == sum(map(len, texts))


def test_stdlib_eval_windows_never_appear_in_a_peer_stream() -> None:
    source = open_source(DataSection())
    assert open_source(DataSection()) is source  # read once per process
    assert 0.002 < len(source.eval) / len(source.train) < 0.05
    held_out = bytes(source.eval[:200_000].tolist())
    train_head = set(rows(TrainBatches(source, 64, 16, peer_key="x", seed=0), 3))
    eval_rows = {bytes(r.tolist()) for x, _ in make_eval_set(source, 63, 16).batches(2) for r in x}
    assert not train_head & eval_rows
    assert all(r in held_out for r in eval_rows)


def test_files_source_accepts_globs_and_reports_missing_paths(tmp_path: Path) -> None:
    write_documents(tmp_path / "docs", 3)
    assert len(expand_paths([str(tmp_path / "docs" / "*.txt")])) == 3
    with pytest.raises(FileNotFoundError, match="nothing matches"):
        expand_paths([str(tmp_path / "missing.txt")])
    with pytest.raises(FileNotFoundError, match="nothing matches"):
        expand_paths([str(tmp_path / "*.none")])


def test_one_short_file_still_gets_a_held_out_tail(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(b"abcdefghij" * 100)
    with caplog.at_level(logging.WARNING):
        corpus = open_source(DataSection(source="files", paths=[str(path)], eval_fraction=0.1))
    assert len(corpus.eval) == 100 and len(corpus.train) == 900
    assert "holding out" in caplog.text


class Uniform(nn.Module):
    """Predicts every byte with probability 1/256."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*idx.shape, 256)


def test_uniform_model_scores_eight_bits_per_byte() -> None:
    eval_set = EvalSet(random_corpus().eval, block_size=BLOCK, batch_size=4)
    assert evaluate(Uniform(), eval_set, batches=3) == pytest.approx(math.log2(256), abs=1e-5)


def test_learning_and_held_out_loss_of_one_batch_are_the_same_number() -> None:
    """Both losses are bits per byte: scored on the very batch it trains on (lr 0, no dropout), the
    held-out evaluation gives the training step's loss; a step reporting nats would be ln 2 times it."""
    from swarm.config import ModelSection

    model = GPT(ModelSection(block_size=BLOCK, n_embd=32, n_head=2, n_layer=1))
    x, y = next(TrainBatches(random_corpus(), BLOCK, 8, peer_key="a", seed=0))
    trainer = InnerTrainer(model, TrainSection(batch_size=8, weight_decay=0.0), torch.device("cpu"))
    stats = trainer.step(iter([(x, y)]), lr=0.0)
    windows = torch.cat([x, y[:, -1:]], dim=1)  # each row: its inputs and the last target
    same_batch = EvalSet(windows.flatten(), block_size=BLOCK, batch_size=8)
    assert torch.equal(next(same_batch.batches(1))[1], y)  # the evaluation scores exactly that batch
    held_out = evaluate(model, same_batch, batches=1)
    assert held_out == pytest.approx(stats.loss, rel=1e-4)
    assert 7.5 < stats.loss < 8.5  # an untrained model: about log2(256) bits per byte
    assert same_batch.loss_unit == "bits/byte" and same_batch.bits_per_byte(held_out, 1) == held_out


def test_eval_batches_are_fixed_and_spread_over_the_text() -> None:
    eval_set = EvalSet(torch.arange(1000).to(torch.uint8), block_size=BLOCK, batch_size=4)
    first = [x for x, _ in eval_set.batches(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, [x for x, _ in eval_set.batches(3)], strict=True))
    with pytest.raises(ValueError, match="fewer than one window"):
        next(EvalSet(torch.zeros(5, dtype=torch.uint8), block_size=BLOCK).batches(1))


def test_unigram_baseline() -> None:
    uniform = torch.arange(256 * 50).to(torch.uint8)
    assert unigram_bits(uniform, uniform) == pytest.approx(8.0, abs=1e-6)
    source = open_source(DataSection())
    assert 3.5 < unigram_bits(source.train, source.eval) < 6.0


def test_hf_streaming_source_on_a_local_file(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    lines = [f"line {i}: the quick brown fox {i * 7} jumps" for i in range(400)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n")
    stream = datasets.load_dataset("text", data_files=str(path), split="train", streaming=True)
    source = HFStreamSource(stream, eval_fraction=0.1, shuffle_buffer=50)
    held_out = bytes(source.eval.tolist())
    eval_lines = [line for line in lines if (line + "\n").encode() in held_out]
    assert eval_lines
    a = TrainBatches(source, BLOCK, 8, peer_key="a", seed=0)
    x, y = next(a)
    assert x.shape == (8, BLOCK) and torch.equal(x[:, 1:], y[:, :-1])
    text = b"".join(bytes(r.tolist()) for _ in range(30) for r in next(a)[0].to(torch.uint8))
    assert not any(line.encode() in text for line in eval_lines)
    b_first = next(TrainBatches(source, BLOCK, 8, peer_key="b", seed=0))[0]
    assert not torch.equal(next(TrainBatches(source, BLOCK, 8, peer_key="a", seed=0))[0], b_first)
    assert make_eval_set(source, BLOCK, 4).unit == "byte"
