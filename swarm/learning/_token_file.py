"""``data.source: tokens``: a directory of pre-tokenized text that every peer memory-maps.

Layout (written by :func:`swarm.learning.prepare_tokens`, the ``swarm data prepare`` command)::

    DIR/train.bin    the training tokens, little-endian uint16 (uint32 when the vocabulary needs it)
    DIR/eval.bin     the held-out tokens, in the same dtype
    DIR/index.json   {"format", "dtype", "vocab_size", "tokenizer", "eval_fraction", "source",
                      "chunk_bytes", "train": {"count", "digests"}, "eval": {"count", "digests"},
                      "checksum"}

Each ``chunk_bytes`` of a token file has a BLAKE2b digest in the index, and ``checksum`` is a digest of
the dtype, counts and all chunk digests: the identity of the data. The held-out file is small; it is
read and verified whole when the directory is opened. A training chunk is verified the first time a
window touches it, so opening a file of billions of tokens reads nothing, and a corrupt or truncated
file is refused, naming the file and the bytes, before a peer trains on it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarm._tokenizer import Tokenizer
from swarm.learning._windows import window_starts

logger = logging.getLogger(__name__)

FORMAT = "swarm-tokens/1"
INDEX_FILE = "index.json"
TRAIN_FILE = "train.bin"
EVAL_FILE = "eval.bin"
CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4096
MAX_CHUNK_BYTES = 1 << 30
MAX_INDEX_BYTES = 64 << 20
MAX_EVAL_TOKENS = 1 << 22
"""Held-out tokens kept (16 MiB as int32 in memory): evaluation reads a few hundred windows of them."""
BYTES_TOKENIZER = "bytes"
GATHER_WINDOWS = 256
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_DIGEST_HEX = 32
_LOG_EVERY_TOKENS = 1 << 26


class TokenFileError(ValueError):
    """A token directory cannot be used: missing, truncated, corrupt, or made for another config."""


def dtype_for(vocab_size: int) -> str:
    """The smallest dtype of :data:`DTYPES` that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def tokenizer_identity(tokenizer: Tokenizer | None) -> str:
    """What the index records of the tokenizer: its content fingerprint, or ``bytes``."""
    return BYTES_TOKENIZER if tokenizer is None else tokenizer.fingerprint


def digest(data: bytes | memoryview) -> str:
    """The digest of one chunk."""
    return hashlib.blake2b(data, digest_size=_DIGEST_HEX // 2).hexdigest()


def content_checksum(dtype: str, train: Mapping[str, Any], held_out: Mapping[str, Any]) -> str:
    """The identity of the token data: a digest of its dtype, counts and chunk digests."""
    parts = [dtype, str(train["count"]), *train["digests"], str(held_out["count"]), *held_out["digests"]]
    return digest("\n".join(parts).encode())


class TokenWriter:
    """Append tokens to a token file, computing its chunk digests as it goes."""

    def __init__(self, path: Path, dtype: str, vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.path = path
        self._dtype = DTYPES[dtype]
        self._vocab_size = vocab_size
        self._chunk_bytes = chunk_bytes
        self._file = open(path, "wb")  # noqa: SIM115 - closed by close() or on leaving a with block
        self.restart()

    def restart(self) -> None:
        """Drop everything written so far."""
        self._file.seek(0)
        self._file.truncate()
        self._hash = hashlib.blake2b(digest_size=_DIGEST_HEX // 2)
        self._in_chunk = 0
        self.count = 0
        self.digests: list[str] = []

    def write(self, tokens: np.ndarray | torch.Tensor) -> None:
        """Append ``tokens`` (ids below the vocabulary size)."""
        array = tokens.numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
        if not array.size:
            return
        if int(array.min()) < 0 or int(array.max()) >= self._vocab_size:
            raise ValueError(f"token ids outside 0..{self._vocab_size - 1}: {array.min()}..{array.max()}")
        data = memoryview(array.astype(self._dtype, copy=False).tobytes())
        self._file.write(data)
        if (self.count + array.size) // _LOG_EVERY_TOKENS > self.count // _LOG_EVERY_TOKENS:
            logger.info("%s: %d tokens written", self.path, self.count + array.size)
        while data:
            take = min(len(data), self._chunk_bytes - self._in_chunk)
            self._hash.update(data[:take])
            self._in_chunk += take
            data = data[take:]
            if self._in_chunk == self._chunk_bytes:
                self._end_chunk()
        self.count += array.size

    def _end_chunk(self) -> None:
        self.digests.append(self._hash.hexdigest())
        self._hash = hashlib.blake2b(digest_size=_DIGEST_HEX // 2)
        self._in_chunk = 0

    def __enter__(self) -> TokenWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._file.close()  # a no-op after close(); after an error, what was written is discarded

    def close(self) -> dict[str, Any]:
        """Flush the file to disk; its index entry ``{"count", "digests"}``."""
        if self._in_chunk:
            self._end_chunk()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"count": self.count, "digests": list(self.digests)}


@dataclass(frozen=True)
class _Part:
    """One token file of the directory as its index describes it."""

    path: Path
    count: int
    digests: tuple[str, ...]


def _fail(directory: Path, problem: str) -> TokenFileError:
    return TokenFileError(
        f"{directory / INDEX_FILE}: {problem}; prepare the directory again (swarm data prepare)"
    )


def read_index(directory: Path) -> dict[str, Any]:
    """``DIR/index.json``, checked field by field (types, sizes, digests); raises :class:`TokenFileError`."""
    path = directory / INDEX_FILE
    if not directory.is_dir():
        raise TokenFileError(
            f"data.paths: {directory} is not a directory (write one with swarm data prepare)"
        )
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_INDEX_BYTES + 1)
    except OSError as error:
        raise TokenFileError(f"{path}: cannot read the token index: {error}") from error
    if len(raw) > MAX_INDEX_BYTES:
        raise _fail(directory, f"longer than {MAX_INDEX_BYTES} bytes")
    try:
        index = json.loads(raw)
    except ValueError as error:
        raise _fail(directory, f"not valid JSON ({error})") from error
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise _fail(directory, f"not a token index (format {FORMAT!r} expected)")
    if index.get("dtype") not in DTYPES:
        raise _fail(directory, f"dtype {index.get('dtype')!r} is not one of {sorted(DTYPES)}")
    for key, low, high in (("vocab_size", 2, 1 << 32), ("chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)):
        value = index.get(key)
        if type(value) is not int or not low <= value <= high:
            raise _fail(directory, f"{key} {value!r} is not an integer in {low}..{high}")
    if index["chunk_bytes"] % DTYPES[index["dtype"]].itemsize:
        raise _fail(directory, "chunk_bytes is not a whole number of tokens")
    if index["vocab_size"] > 1 << (8 * DTYPES[index["dtype"]].itemsize):
        raise _fail(directory, f"vocab_size {index['vocab_size']} does not fit dtype {index['dtype']}")
    for key in ("tokenizer", "checksum"):
        if not isinstance(index.get(key), str):
            raise _fail(directory, f"{key} is missing or not a string")
    for name in ("train", "eval"):
        _check_part(directory, name, index)
    if index["checksum"] != content_checksum(index["dtype"], index["train"], index["eval"]):
        raise _fail(directory, "checksum does not match the chunk digests (the index was changed)")
    return index


def _check_part(directory: Path, name: str, index: dict[str, Any]) -> None:
    part = index.get(name)
    if not isinstance(part, dict):
        raise _fail(directory, f"{name!r} is missing")
    count, digests = part.get("count"), part.get("digests")
    if type(count) is not int or count < 0:
        raise _fail(directory, f"{name}.count {count!r} is not a non-negative integer")
    chunks = -(-count * DTYPES[index["dtype"]].itemsize // index["chunk_bytes"])
    if not isinstance(digests, list) or len(digests) != chunks:
        raise _fail(directory, f"{name}.digests must list {chunks} chunk digests")
    for value in digests:
        if not isinstance(value, str) or len(value) != _DIGEST_HEX:
            raise _fail(directory, f"{name}.digests holds {value!r}, not a {_DIGEST_HEX}-digit digest")


class TokenFile:
    """A prepared token directory (module docstring) as a token source; see :func:`open_token_file`."""

    def __init__(
        self, directory: str | os.PathLike[str], *, tokenizer: Tokenizer | None, eval_fraction: float
    ):
        self.directory = Path(directory)
        self.name = str(self.directory)
        index = read_index(self.directory)
        expected = tokenizer_identity(tokenizer)
        if index["tokenizer"] != expected:
            raise TokenFileError(
                f"{self.directory} was prepared with tokenizer {index['tokenizer']!r}, the config's "
                f"data.tokenizer is {expected!r}: set the same data.tokenizer, or prepare it again"
            )
        if index.get("eval_fraction") != eval_fraction:
            raise TokenFileError(
                f"{self.directory} was prepared with data.eval_fraction {index.get('eval_fraction')!r}, "
                f"the config has {eval_fraction!r}: set the same value, or prepare it again"
            )
        self.tokenizer = tokenizer
        self.unit = "byte" if tokenizer is None else "token"
        self.vocab_size: int = index["vocab_size"]
        self.checksum: str = index["checksum"]
        self._dtype = DTYPES[index["dtype"]]
        self._chunk_bytes: int = index["chunk_bytes"]
        self._train = self._part(TRAIN_FILE, index["train"])
        held_out = self._part(EVAL_FILE, index["eval"])
        if self._train.count == 0:
            raise TokenFileError(f"{self._train.path}: no training tokens")
        if not 0 < held_out.count <= MAX_EVAL_TOKENS:
            raise TokenFileError(
                f"{held_out.path}: {held_out.count} held-out tokens, not 1..{MAX_EVAL_TOKENS}"
            )
        self._tokens = np.memmap(self._train.path, dtype=self._dtype, mode="r", shape=(self._train.count,))
        self._verified = bytearray(len(self._train.digests))
        self.eval = torch.from_numpy(self._read_whole(held_out).astype(np.int32))
        logger.info(
            "%s: %d training %ss, %d held-out (%s, checksum %s)",
            self.name,
            self._train.count,
            self.unit,
            held_out.count,
            index["dtype"],
            self.checksum,
        )

    @property
    def train_tokens(self) -> int:
        """Number of training tokens."""
        return self._train.count

    def _part(self, file: str, entry: dict[str, Any]) -> _Part:
        path = self.directory / file
        expected = entry["count"] * self._dtype.itemsize
        try:
            size = path.stat().st_size
        except OSError as error:
            raise TokenFileError(f"{path}: cannot read the token file: {error}") from error
        if size != expected:
            what = "truncated" if size < expected else "longer than the index says"
            raise TokenFileError(
                f"{path}: {size} bytes, the index says {entry['count']} tokens = {expected} bytes: the file "
                f"is {what}; prepare it again (swarm data prepare) or copy it anew"
            )
        return _Part(path, entry["count"], tuple(entry["digests"]))

    def _check_chunk(self, part: _Part, chunk: int, data: np.ndarray) -> None:
        if digest(data.tobytes()) != part.digests[chunk]:
            low = chunk * self._chunk_bytes
            raise TokenFileError(
                f"{part.path}: bytes {low}..{low + data.nbytes} (chunk {chunk + 1} of {len(part.digests)}) "
                f"do not match their digest in {INDEX_FILE}: the file is corrupt or was changed after "
                "swarm data prepare; prepare it again or copy it anew"
            )
        if data.size and int(data.max()) >= self.vocab_size:
            raise TokenFileError(f"{part.path}: token {int(data.max())} is outside the vocabulary")

    def _read_whole(self, part: _Part) -> np.ndarray:
        tokens = np.fromfile(part.path, dtype=self._dtype, count=part.count)
        per_chunk = self._chunk_bytes // self._dtype.itemsize
        for chunk in range(len(part.digests)):
            self._check_chunk(part, chunk, tokens[chunk * per_chunk : (chunk + 1) * per_chunk])
        return tokens

    def _verify_chunks(self, chunks: Iterator[int] | np.ndarray) -> None:
        per_chunk = self._chunk_bytes // self._dtype.itemsize
        for chunk in chunks:
            if not self._verified[chunk]:
                data = np.ascontiguousarray(self._tokens[chunk * per_chunk : (chunk + 1) * per_chunk])
                self._check_chunk(self._train, int(chunk), data)
                self._verified[chunk] = 1

    def verify(self) -> None:
        """Verify every training chunk now (reads the whole file); raises :class:`TokenFileError`."""
        self._verify_chunks(iter(range(len(self._verified))))

    def iter_windows(
        self, block_size: int, peer_key: str, seed: int, skip: int = 0
    ) -> Iterator[torch.Tensor]:
        """Endless int32 chunks of training windows ``(k, block_size + 1)`` in this peer's order, the
        order of an in-memory corpus of the same tokens; ``skip`` windows are passed over unread."""
        span = block_size + 1
        offsets = np.arange(span)
        size = self._dtype.itemsize
        for starts in window_starts(self._train.count, span, peer_key, seed, skip, name=self.name):
            for low in range(0, len(starts), GATHER_WINDOWS):
                group = starts[low : low + GATHER_WINDOWS]
                first = group * size // self._chunk_bytes
                last = ((group + span) * size - 1) // self._chunk_bytes
                reach = np.arange(int((last - first).max()) + 1)
                self._verify_chunks(np.unique(np.minimum(first[:, None] + reach, last[:, None])))
                yield torch.from_numpy(self._tokens[group[:, None] + offsets].astype(np.int32))


@functools.lru_cache(maxsize=4)
def _open_cached(directory: str, tokenizer: Tokenizer | None, eval_fraction: float) -> TokenFile:
    return TokenFile(directory, tokenizer=tokenizer, eval_fraction=eval_fraction)


def open_token_file(
    directory: str | os.PathLike[str], *, tokenizer: Tokenizer | None, eval_fraction: float
) -> TokenFile:
    """The token directory ``directory`` (opened once per process); raises :class:`TokenFileError`."""
    return _open_cached(str(Path(directory).expanduser().resolve()), tokenizer, eval_fraction)
