"""``data.source: hf``: a streamed Hugging Face ``datasets`` dataset of text documents, as tokens."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from swarm._tokenizer import Tokenizer
from swarm.config import DataSection
from swarm.learning._windows import encode, hash64, is_held_out

ENCODE_BATCH = 256
"""Documents tokenized in one call: a fast tokenizer encodes a batch in parallel."""


class HFStreamSource:
    """A streamed Hugging Face dataset of text documents, as tokens (bytes, or ``tokenizer``'s ids).

    Each peer streams the documents in its own order (``shuffle`` with a seed from its peer key, over
    a buffer of ``shuffle_buffer`` documents), skips held-out documents, and cuts the rest, joined
    by newlines, into windows. The evaluation split is the held-out documents up to ``eval_bytes`` of
    text (cut there when tokens are bytes).

    Resuming after ``skip`` windows streams the skipped documents again (the download is repeated)
    and counts their tokens without cutting windows; with a tokenizer they are tokenized again, in
    batches. A run that resumes often should prepare its data once (``swarm data prepare``) and train
    on ``data.source: tokens``, which resumes by offset.
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
        self.eval_bytes = eval_bytes
        self._shuffle_buffer = shuffle_buffer

    @classmethod
    def from_name(
        cls,
        dataset_name: str,
        eval_fraction: float,
        *,
        hf_config: str | None = None,
        split: str = "train",
        **options: Any,
    ) -> HFStreamSource:
        """Open ``dataset_name`` (its subset ``hf_config``, its ``split``) for streaming: downloads as
        it is read."""
        try:
            import datasets
        except ImportError as error:
            raise ImportError(
                "data.source 'hf' needs the 'datasets' package: pip install datasets"
            ) from error
        stream = datasets.load_dataset(dataset_name, name=hf_config, split=split, streaming=True)
        label = dataset_name if hf_config is None else f"{dataset_name}/{hf_config}"
        return cls(stream, eval_fraction, name=f"{label}[{split}]", **options)

    @classmethod
    def from_section(cls, data: DataSection, tokenizer: Tokenizer | None) -> HFStreamSource:
        """The stream a ``data.source: hf`` section names (dataset, subset, split, text field)."""
        assert data.hf_dataset is not None  # the config validator guarantees it
        return cls.from_name(
            data.hf_dataset,
            data.eval_fraction,
            hf_config=data.hf_config,
            split=data.split,
            text_field=data.text_field,
            tokenizer=tokenizer,
        )

    def _text_of(self, record: Any) -> bytes | None:
        """A document's text with its newline, None for a document without text (a null field)."""
        if not isinstance(record, Mapping) or self._text_field not in record:
            fields = sorted(map(str, record))[:10] if isinstance(record, Mapping) else type(record).__name__
            raise ValueError(
                f"{self.name}: a document has no field {self._text_field!r} (it has {fields}); "
                "set data.text_field"
            )
        text = record[self._text_field]
        if text is None:
            return None
        if not isinstance(text, str):
            raise ValueError(
                f"{self.name}: field {self._text_field!r} holds {type(text).__name__}, not text; "
                "set data.text_field to the field with the documents' text"
            )
        return text.encode("utf-8") + b"\n"

    def split_documents(self, stream: Iterable[Any] | None = None) -> Iterator[tuple[bytes, bool]]:
        """``(text, held_out)`` of every document of ``stream`` (default: the unshuffled dataset)."""
        for record in self._dataset if stream is None else stream:
            text = self._text_of(record)
            if text is not None:
                yield text, is_held_out(text, self._eval_fraction)

    def _documents(self, stream: Iterable[Any], held_out: bool) -> Iterator[bytes]:
        return (text for text, side in self.split_documents(stream) if side == held_out)

    def token_arrays(self, texts: Iterable[bytes]) -> Iterator[np.ndarray]:
        """Each document's tokens: a view of its bytes, or its ids (tokenized ``ENCODE_BATCH`` at once)."""
        if self.tokenizer is None:
            yield from (np.frombuffer(text, dtype=np.uint8) for text in texts)
            return
        iterator = iter(texts)
        while batch := list(itertools.islice(iterator, ENCODE_BATCH)):
            decoded = [text.decode("utf-8", errors="replace") for text in batch]
            yield from (np.asarray(ids, dtype=np.int32) for ids in self.tokenizer.encode(decoded))

    @functools.cached_property
    def eval(self) -> torch.Tensor:
        held_out: list[bytes] = []
        size = 0
        for text in self._documents(self._dataset, held_out=True):
            held_out.append(text)
            size += len(text)
            if size >= self.eval_bytes:
                break
        return self.eval_from(held_out)

    def eval_from(self, held_out: list[bytes]) -> torch.Tensor:
        """The evaluation tokens of the held-out documents ``held_out`` (the first ones of the stream)."""
        if not held_out:
            raise ValueError(f"{self.name}: no held-out documents; raise data.eval_fraction")
        if self.tokenizer is None:
            held_out = [b"".join(held_out)[: self.eval_bytes]]
        return encode(held_out, self.tokenizer)

    def iter_windows(
        self, block_size: int, peer_key: str, seed: int, skip: int = 0
    ) -> Iterator[torch.Tensor]:
        """Endless training windows ``(1, block_size + 1)`` in this peer's order."""
        span = block_size + 1
        stream = self._dataset.shuffle(
            seed=hash64("peer", seed, peer_key) % 2**32, buffer_size=self._shuffle_buffer
        )
        epoch = 0
        while True:
            stream.set_epoch(epoch)
            pending = np.zeros(0, dtype=np.uint8 if self.tokenizer is None else np.int32)
            produced = False
            for tokens in self.token_arrays(self._documents(stream, held_out=False)):
                pending = np.concatenate([pending, tokens])
                whole = len(pending) // span
                produced = produced or whole > 0
                passed = min(skip, whole)  # skipped windows are counted, never cut out
                skip -= passed
                for w in range(passed, whole):
                    yield torch.from_numpy(pending[w * span : (w + 1) * span].copy())[None]
                pending = pending[whole * span :]
            if not produced:
                raise ValueError(f"{self.name}: no training window of {span} tokens in the whole stream")
            epoch += 1
