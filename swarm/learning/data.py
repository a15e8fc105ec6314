"""Training text as tokens: where it comes from, how peers share it, and how it is cut into batches.

Sources (``data.source``):

* ``stdlib``: the ``.py`` files of this Python's standard library (about 11 MB, no download);
* ``files``: local text files, directories (read recursively) or glob patterns (``data.paths``);
* ``hf``: a Hugging Face ``datasets`` dataset, streamed (needs the optional ``datasets`` package);
* ``tokens``: a directory of tokens that ``swarm data prepare`` wrote from one of the above, which every
  peer memory-maps (:mod:`swarm.learning._token_file`).

Text is tokenized as raw bytes (token = byte value, 256 tokens, losses in bits per byte), or with the
``transformers`` tokenizer ``data.tokenizer`` names (losses in bits per token; the evaluation also
reports bits per byte, :mod:`swarm.learning.evaluation`).

Held-out split: text is cut into pieces (a whole file, or 64 KiB of a longer one; a whole document
for streams) and a piece is held out when a hash of its *content* falls below ``eval_fraction``. The
split is therefore the same on every machine, whatever the file names, and never depends on the seed.

Peer shards: the training tokens are cut into windows of ``block_size + 1`` tokens, and the windows
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
import logging
import math
import os
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from swarm._tokenizer import Tokenizer, load_tokenizer
from swarm.config import DataSection, RunConfig
from swarm.learning._hf_stream import HFStreamSource
from swarm.learning._token_file import TokenFile, TokenFileError, open_token_file
from swarm.learning._windows import BYTE_VOCAB, MAX_SHARDS, TokenSource, encode, is_held_out, window_starts

__all__ = [
    "BYTE_VOCAB",
    "MAX_SHARDS",
    "SPLIT_PIECE_BYTES",
    "Corpus",
    "HFStreamSource",
    "TokenFile",
    "TokenFileError",
    "TokenSource",
    "TrainBatches",
    "corpus_from_files",
    "encode",
    "expand_paths",
    "is_held_out",
    "open_source",
    "split_file",
    "stdlib_files",
]

logger = logging.getLogger(__name__)

SPLIT_PIECE_BYTES = 64 * 1024
_STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


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
        offsets = torch.arange(span)
        for starts in window_starts(len(self.train), span, peer_key, seed, skip, name=self.name):
            yield self.train[torch.from_numpy(starts)[:, None] + offsets]


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


def split_file(path: Path, eval_fraction: float, as_text: bool) -> tuple[list, list]:
    """A file's pieces, sorted into training and held-out ones by content (module docstring).

    ``as_text``: pieces are decoded, with one incremental decoder for the file so that a character cut
    by a piece boundary is kept whole (in the later piece); the split itself is the same as for bytes.
    """
    train: list[bytes | str] = []
    held_out: list[bytes | str] = []
    data = path.read_bytes()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for start in range(0, len(data), SPLIT_PIECE_BYTES):
        piece = data[start : start + SPLIT_PIECE_BYTES]
        last = start + SPLIT_PIECE_BYTES >= len(data)
        side = held_out if is_held_out(piece, eval_fraction) else train
        side.append(decoder.decode(piece, final=last) if as_text else piece)
    return train, held_out


def _split_pieces(files: Sequence[Path], eval_fraction: float, as_text: bool) -> tuple[list, list]:
    train: list[bytes | str] = []
    held_out: list[bytes | str] = []
    for path in files:
        file_train, file_held_out = split_file(path, eval_fraction, as_text)
        train += file_train
        held_out += file_held_out
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


def open_source(data: DataSection) -> Corpus | HFStreamSource | TokenFile:
    """The token source ``data`` describes; an in-memory corpus or a token file is opened once per process."""
    tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer is not None else None
    if data.source == "hf":
        return HFStreamSource.from_section(data, tokenizer)
    if data.source == "tokens":
        return open_token_file(data.paths[0], tokenizer=tokenizer, eval_fraction=data.eval_fraction)
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
