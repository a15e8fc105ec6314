"""Training text as tokens: where it comes from, how peers share it, and how it is cut into batches.

Sources (``data.source``):

* ``stdlib``: the ``.py`` files of this Python's standard library (about 11 MB, no download);
* ``files``: local text files, directories (read recursively) or glob patterns (``data.paths``);
* ``hf``: a Hugging Face ``datasets`` dataset, streamed (needs the optional ``datasets`` package).

Text is tokenized as raw bytes (token = byte value, 256 tokens, losses in bits per byte), or with the
``transformers`` tokenizer ``data.tokenizer`` names (losses in bits per token; the evaluation also
reports bits per byte, :mod:`swarm.training.evaluation`).

Held-out split: text is cut into pieces (a whole file, or 64 KiB of a longer one; a whole document
for streams) and a piece is held out when a hash of its *content* falls below ``eval_fraction``. The
split is therefore the same on every machine, whatever the file names, and never depends on the seed.

Peer shards: the training bytes are cut into windows of ``block_size + 1`` tokens, and the windows
into ``S`` interleaved shards (window ``w`` is in shard ``w mod S``, so every shard spans the whole
corpus). A peer walks the shards in order, starting from one chosen by a hash of its peer key and the
run seed, and shuffles the windows inside each shard with the same key. Two peers that start on
different shards therefore read disjoint windows until one has caught up with the other's starting
shard, and every peer still sees the whole corpus once per epoch.
"""

from __future__ import annotations

import codecs
import functools
import glob
import hashlib
import logging
import math
import os
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from swarm._tokenizer import Tokenizer, load_tokenizer
from swarm.config import DataSection, RunConfig

logger = logging.getLogger(__name__)

SPLIT_PIECE_BYTES = 64 * 1024
MAX_SHARDS = 1024
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


def _hash64(*parts: object) -> int:
    text = "\x00".join(str(part) for part in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def is_held_out(piece: bytes, eval_fraction: float) -> bool:
    """Whether a piece of text belongs to the evaluation split (decided by its content alone)."""
    digest = hashlib.blake2b(piece, digest_size=8, person=b"swarm-eval").digest()
    return int.from_bytes(digest, "little") < eval_fraction * 2**64


def encode(texts: Sequence[bytes | str], tokenizer: Tokenizer | None) -> torch.Tensor:
    """Texts as one token tensor: their UTF-8 bytes (uint8), or the tokenizer's ids of each (int32)."""
    if tokenizer is None:
        joined = bytearray(b"".join(t if isinstance(t, bytes) else t.encode("utf-8") for t in texts))
        return torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.zeros(0, dtype=torch.uint8)
    decoded = [t if isinstance(t, str) else t.decode("utf-8", errors="replace") for t in texts]
    ids = [np.asarray(row, dtype=np.int32) for row in tokenizer.encode(decoded)]
    return torch.from_numpy(np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32))


class TokenSource(Protocol):
    """What :class:`TrainBatches` and :func:`make_eval_set` need from a source of tokens."""

    @property
    def unit(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def eval(self) -> torch.Tensor: ...

    def iter_windows(
        self, block_size: int, peer_key: str, seed: int, skip: int = 0
    ) -> Iterator[torch.Tensor]: ...


@dataclass(frozen=True, eq=False)
class Corpus:
    """A whole corpus in memory: one tensor of training tokens and one of held-out tokens."""

    name: str
    train: torch.Tensor
    eval: torch.Tensor
    documents: int
    tokenizer: Tokenizer | None = None

    @property
    def unit(self) -> str:
        return "byte" if self.tokenizer is None else "token"

    def iter_windows(
        self, block_size: int, peer_key: str, seed: int, skip: int = 0
    ) -> Iterator[torch.Tensor]:
        """Endless chunks of training windows ``(k, block_size + 1)`` in this peer's order.

        ``skip`` windows are passed over first without reading them (to resume after a restart).
        """
        span = block_size + 1
        peer = _hash64("peer", seed, peer_key)
        epoch = 0
        while True:
            # All peers share the epoch's phase, so their windows line up and shards are disjoint.
            phase = _hash64("phase", seed, epoch) % span
            count = (len(self.train) - phase) // span
            if count < 1:
                raise ValueError(f"{self.name}: {len(self.train)} training bytes, fewer than one window")
            shards = min(MAX_SHARDS, count)
            for i in range(shards):
                shard = (peer + i) % shards
                size = len(range(shard, count, shards))
                if skip >= size:
                    skip -= size
                    continue
                windows = np.arange(shard, count, shards)
                np.random.default_rng([peer, epoch, shard]).shuffle(windows)
                starts = torch.from_numpy(phase + windows[skip:] * span)
                skip = 0
                yield self.train[starts[:, None] + torch.arange(span)]
            epoch += 1


class HFStreamSource:
    """A streamed Hugging Face dataset of text documents, as tokens (bytes, or ``tokenizer``'s ids).

    Each peer streams the documents in its own order (``shuffle`` with a seed from its peer key, over
    a buffer of ``shuffle_buffer`` documents), skips held-out documents, and cuts the rest, joined
    by newlines, into windows. The evaluation split is the held-out documents up to ``eval_bytes`` of
    text (cut there when tokens are bytes).
    """

    def __init__(
        self,
        dataset: Any,
        eval_fraction: float,
        *,
        name: str = "hf",
        text_field: str = "text",
        eval_bytes: int = 1 << 20,
        shuffle_buffer: int = 10_000,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.name = name
        self.tokenizer = tokenizer
        self.unit = "byte" if tokenizer is None else "token"
        self._dataset = dataset
        self._eval_fraction = eval_fraction
        self._text_field = text_field
        self._eval_bytes = eval_bytes
        self._shuffle_buffer = shuffle_buffer

    @classmethod
    def from_name(cls, dataset_name: str, eval_fraction: float, **options: Any) -> HFStreamSource:
        """Open ``dataset_name``'s train split for streaming (downloads as it is read)."""
        try:
            import datasets
        except ImportError as error:
            raise ImportError(
                "data.source 'hf' needs the 'datasets' package: pip install datasets"
            ) from error
        stream = datasets.load_dataset(dataset_name, split="train", streaming=True)
        return cls(stream, eval_fraction, name=dataset_name, **options)

    def _documents(self, stream: Iterable[dict[str, Any]], held_out: bool) -> Iterator[bytes]:
        for record in stream:
            text = record[self._text_field].encode("utf-8") + b"\n"
            if is_held_out(text, self._eval_fraction) == held_out:
                yield text

    @functools.cached_property
    def eval(self) -> torch.Tensor:
        held_out: list[bytes] = []
        size = 0
        for text in self._documents(self._dataset, held_out=True):
            held_out.append(text)
            size += len(text)
            if size >= self._eval_bytes:
                break
        if not held_out:
            raise ValueError(f"{self.name}: no held-out documents; raise data.eval_fraction")
        if self.tokenizer is None:
            held_out = [b"".join(held_out)[: self._eval_bytes]]
        return encode(held_out, self.tokenizer)

    def iter_windows(
        self, block_size: int, peer_key: str, seed: int, skip: int = 0
    ) -> Iterator[torch.Tensor]:
        """Endless training windows ``(1, block_size + 1)`` in this peer's order."""
        span = block_size + 1
        stream = self._dataset.shuffle(
            seed=_hash64("peer", seed, peer_key) % 2**32, buffer_size=self._shuffle_buffer
        )
        epoch = 0
        while True:
            stream.set_epoch(epoch)
            pending = encode([], self.tokenizer)
            produced = False
            for text in self._documents(stream, held_out=False):
                pending = torch.cat([pending, encode([text], self.tokenizer)])
                while len(pending) >= span:
                    window, pending = pending[:span], pending[span:]
                    produced = True
                    if skip:
                        skip -= 1
                        continue
                    yield window.clone()[None]
            if not produced:
                raise ValueError(f"{self.name}: no training window of {span} tokens in the whole stream")
            epoch += 1


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without site-packages and test suites.

    The skipped directories are pruned from the walk rather than filtered out of a full listing: the
    test suites and site-packages hold most of the tree, and every trainer lists it at start-up.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in _STDLIB_SKIPPED_DIRS]
        found += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(path for path in found if path.is_file())


def expand_paths(paths: Sequence[str]) -> list[Path]:
    """Files named by ``data.paths``: files, directories (recursively, hidden ones skipped) or globs."""
    found: list[Path] = []
    for entry in paths:
        matches = sorted(glob.glob(entry, recursive=True)) if glob.has_magic(entry) else [entry]
        for match in map(Path, matches):
            if match.is_dir():
                found.extend(
                    sorted(
                        p
                        for p in match.rglob("*")
                        if p.is_file() and not any(s.startswith(".") for s in p.relative_to(match).parts)
                    )
                )
            elif match.is_file():
                found.append(match)
        if not matches or not any(Path(m).exists() for m in matches):
            raise FileNotFoundError(f"data.paths: nothing matches {entry!r}")
    if not found:
        raise FileNotFoundError(f"data.paths: no files in {list(paths)}")
    return found


def _split_pieces(files: Sequence[Path], eval_fraction: float, as_text: bool) -> tuple[list, list]:
    """Each file's pieces, sorted into training and held-out ones by content (module docstring).

    ``as_text``: pieces are decoded, with one incremental decoder per file so that a character cut by a
    piece boundary is kept whole (in the later piece); the split itself is the same as for bytes.
    """
    train: list[bytes | str] = []
    held_out: list[bytes | str] = []
    for path in files:
        data = path.read_bytes()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for start in range(0, len(data), SPLIT_PIECE_BYTES):
            piece = data[start : start + SPLIT_PIECE_BYTES]
            last = start + SPLIT_PIECE_BYTES >= len(data)
            side = held_out if is_held_out(piece, eval_fraction) else train
            side.append(decoder.decode(piece, final=last) if as_text else piece)
    return train, held_out


def corpus_from_files(
    files: Sequence[Path], eval_fraction: float, name: str = "files", tokenizer: Tokenizer | None = None
) -> Corpus:
    """Read ``files`` once into training and held-out tokens (see the module docstring)."""
    train, held_out = _split_pieces(files, eval_fraction, as_text=tokenizer is not None)
    if not train or not held_out:
        # Too little text for a split by pieces (e.g. one short file): hold out its tail instead.
        joined: Any = ("" if tokenizer else b"").join(train + held_out)  # str pieces, or bytes
        cut = len(joined) - max(1, math.ceil(len(joined) * eval_fraction))
        train, held_out = [joined[:cut]], [joined[cut:]]
        what = "characters" if tokenizer else "bytes"
        logger.warning(
            "%s: too few pieces to split by content; holding out the last %d %s", name, len(held_out[0]), what
        )
    if not any(train):
        raise ValueError(f"{name}: no text to train on")
    corpus = Corpus(name, encode(train, tokenizer), encode(held_out, tokenizer), len(files), tokenizer)
    unit = corpus.unit
    logger.info(
        "%s: %d files, %d training %ss, %d held-out %ss",
        name,
        len(files),
        len(corpus.train),
        unit,
        len(corpus.eval),
        unit,
    )
    return corpus


@functools.lru_cache(maxsize=4)
def _cached_corpus(
    source: str, paths: tuple[str, ...], eval_fraction: float, tokenizer: Tokenizer | None
) -> Corpus:
    files = stdlib_files() if source == "stdlib" else expand_paths(paths)
    return corpus_from_files(files, eval_fraction, name=source, tokenizer=tokenizer)


def open_source(data: DataSection) -> Corpus | HFStreamSource:
    """The token source ``data`` describes; an in-memory corpus is read once per process."""
    tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer is not None else None
    if data.source == "hf":
        assert data.hf_dataset is not None  # the config validator guarantees it
        return HFStreamSource.from_name(data.hf_dataset, data.eval_fraction, tokenizer=tokenizer)
    return _cached_corpus(data.source, tuple(data.paths), data.eval_fraction, tokenizer)


@dataclass
class TrainBatches:
    """Endless ``(x, y)`` int64 batches of shape ``(batch_size, block_size)`` in this peer's order.

    ``y`` is ``x`` shifted by one token. ``start_sample`` resumes the order after that many samples;
    ``samples_drawn`` counts samples handed out (including the skipped ones, less any given back).
    """

    source: TokenSource
    block_size: int
    batch_size: int
    peer_key: str
    seed: int
    start_sample: int = 0
    samples_drawn: int = field(init=False)
    _windows: Iterator[torch.Tensor] = field(init=False, repr=False)
    _pending: list[torch.Tensor] = field(init=False, repr=False, default_factory=list)
    _last: torch.Tensor | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.samples_drawn = self.start_sample
        self._windows = self.source.iter_windows(self.block_size, self.peer_key, self.seed, self.start_sample)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = sum(len(chunk) for chunk in self._pending)
        while rows < self.batch_size:
            chunk = next(self._windows)
            self._pending.append(chunk)
            rows += len(chunk)
        stacked = torch.cat(self._pending)
        batch, rest = stacked[: self.batch_size], stacked[self.batch_size :]
        self._pending = [rest] if len(rest) else []
        self.samples_drawn += self.batch_size
        self._last = batch
        batch = batch.long()
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def give_back(self) -> None:
        """Put the last batch back in front, uncounted: the step that drew it was abandoned (a stop).

        So ``samples_drawn`` counts only batches trained on, and a peer resumed from it trains that
        batch next, as if the stop had come just before it was drawn."""
        if self._last is not None:
            self._pending.insert(0, self._last)
            self._last = None
            self.samples_drawn -= self.batch_size

    @classmethod
    def of_peer(
        cls, source: TokenSource, config: RunConfig, peer_key: str, start_sample: int
    ) -> TrainBatches:
        """A trainer's batches under ``config`` (block and batch size, the run's seed), resumed after
        ``start_sample`` samples."""
        model, train = config.model, config.train
        return cls(source, model.block_size, train.batch_size, peer_key, config.run.seed, start_sample)
