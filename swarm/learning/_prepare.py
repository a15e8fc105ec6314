"""``swarm data prepare``: tokenize a config's text once into a token directory that peers memory-map.

The tokens are those the peers would otherwise compute at start-up, in the same order, with the same
held-out split: for ``stdlib`` and ``files``, the training and held-out tokens of the in-memory corpus
(so a peer draws exactly the same batches from either); for ``hf``, the documents of the unshuffled
stream, in stream order, and its held-out documents up to the first ``eval_bytes`` of text, as the
streamed source evaluates on. Files are read one at a time and streams are written as they arrive,
so preparing needs memory for one file or one batch of documents, not for the corpus.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from swarm._atomic import replace_directory, write_json_synced
from swarm._tokenizer import Tokenizer, load_tokenizer
from swarm.config import DataSection
from swarm.learning._hf_stream import HFStreamSource
from swarm.learning._token_file import (
    CHUNK_BYTES,
    EVAL_FILE,
    FORMAT,
    INDEX_FILE,
    MAX_EVAL_TOKENS,
    TRAIN_FILE,
    TokenFile,
    TokenWriter,
    content_checksum,
    dtype_for,
    tokenizer_identity,
)
from swarm.learning._windows import BYTE_VOCAB, encode
from swarm.learning.data import corpus_from_files, expand_paths, split_file, stdlib_files


class _Budget:
    """How many more training tokens to write (``None``: all)."""

    def __init__(self, max_tokens: int | None) -> None:
        self.left = max_tokens

    def take(self, tokens: Any) -> Any:
        if self.left is None:
            return tokens
        kept = tokens[: self.left]
        self.left -= len(kept)
        return kept

    @property
    def spent(self) -> bool:
        return self.left == 0


def prepare_tokens(
    data: DataSection,
    out: str | os.PathLike[str],
    *,
    max_tokens: int | None = None,
    overwrite: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> TokenFile:
    """Tokenize ``data``'s text into the token directory ``out`` and return it opened.

    ``max_tokens`` stops after that many training tokens (a sample of a large stream). ``out`` is
    written beside itself first and renamed into place; a non-empty ``out`` is refused unless
    ``overwrite``. Raises ValueError for a config that names no text (``data.source: tokens``).
    """
    if data.source == "tokens":
        raise ValueError(
            "data.source is 'tokens': give the config of the text to prepare "
            "(e.g. --set data.source=hf, or files with data.paths)"
        )
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} exists and is not a directory")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise ValueError(f"{target} exists and is not empty (overwrite it with --overwrite)")
    files = _text_files(data, target)
    tokenizer = load_tokenizer(data.tokenizer) if data.tokenizer is not None else None
    vocab = tokenizer.vocab_size if tokenizer is not None else BYTE_VOCAB
    dtype = dtype_for(vocab)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.parent / f".{target.name}.{os.getpid()}.tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    try:
        with (
            TokenWriter(temporary / TRAIN_FILE, dtype, vocab, chunk_bytes) as train,
            TokenWriter(temporary / EVAL_FILE, dtype, vocab, chunk_bytes) as held_out,
        ):
            budget = _Budget(max_tokens)
            if files is None:
                _write_stream(data, tokenizer, train, held_out, budget)
            else:
                _write_files(files, data, tokenizer, train, held_out, budget)
            if train.count == 0:
                raise ValueError(f"data.source {data.source!r}: no text to train on")
            entries = {"train": train.close(), "eval": held_out.close()}
        index = {
            "format": FORMAT,
            "dtype": dtype,
            "vocab_size": vocab,
            "tokenizer": tokenizer_identity(tokenizer),
            "eval_fraction": data.eval_fraction,
            "source": data.model_dump(mode="json"),
            "chunk_bytes": chunk_bytes,
            **entries,
            "checksum": content_checksum(dtype, entries["train"], entries["eval"]),
        }
        write_json_synced(temporary / INDEX_FILE, index, indent=1)
        replace_directory(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return TokenFile(target, tokenizer=tokenizer, eval_fraction=data.eval_fraction)


def _text_files(data: DataSection, target: Path) -> list[Path] | None:
    """The text files to read (None: an ``hf`` stream). The output replaces ``target`` whole, so a
    file of ``data.paths`` inside it, which the very run would delete, is refused."""
    if data.source == "hf":
        return None
    if data.source == "stdlib":
        return stdlib_files()
    files, out = expand_paths(data.paths), target.resolve()
    inside = [path for path in files if path.resolve().is_relative_to(out)]
    if inside:
        raise ValueError(
            f"data.paths file {inside[0]} is inside the output {target}, which prepare replaces whole: "
            "write the tokens elsewhere"
        )
    return files


def _write_files(
    files: list[Path],
    data: DataSection,
    tokenizer: Tokenizer | None,
    train: TokenWriter,
    held_out: TokenWriter,
    budget: _Budget,
) -> None:
    """The stdlib or files corpus, one file at a time, as :func:`corpus_from_files` would split it."""
    for path in files:
        train_pieces, held_out_pieces = split_file(path, data.eval_fraction, as_text=tokenizer is not None)
        train.write(budget.take(encode(train_pieces, tokenizer)))
        if held_out.count < MAX_EVAL_TOKENS:
            held_out.write(encode(held_out_pieces, tokenizer)[: MAX_EVAL_TOKENS - held_out.count])
        if budget.spent:
            break
    if train.count == 0 or held_out.count == 0:
        # Too little text for a split by pieces: the corpus holds out its tail instead; write that.
        corpus = corpus_from_files(files, data.eval_fraction, name=data.source, tokenizer=tokenizer)
        train.restart()
        held_out.restart()
        train.write(corpus.train)
        held_out.write(corpus.eval[:MAX_EVAL_TOKENS])


def _write_stream(
    data: DataSection, tokenizer: Tokenizer | None, train: TokenWriter, held_out: TokenWriter, budget: _Budget
) -> None:
    """The hf stream's documents in stream order; its held-out split as the streamed source has it."""
    source = HFStreamSource.from_section(data, tokenizer)
    kept: list[bytes] = []
    kept_bytes = 0

    def training_documents() -> Any:
        nonlocal kept_bytes
        for text, is_held_out in source.split_documents():
            if not is_held_out:
                yield text
            elif kept_bytes < source.eval_bytes:
                kept.append(text)
                kept_bytes += len(text)

    documents = training_documents()
    for tokens in source.token_arrays(documents):
        train.write(budget.take(tokens))
        if budget.spent:
            break
    for _ in documents:  # the training tokens are complete: read on only for held-out documents
        if kept_bytes >= source.eval_bytes:
            break
    if not kept:
        raise ValueError(f"{source.name}: no held-out documents; raise data.eval_fraction")
    held_out.write(np.asarray(source.eval_from(kept))[:MAX_EVAL_TOKENS])
