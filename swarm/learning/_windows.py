"""What every token source shares: the held-out test, text to tokens, and the order of a peer's windows.

The order is described in :mod:`swarm.learning.data` ("Peer shards"); :func:`window_starts` computes it
from the number of training tokens alone, so an in-memory corpus and a memory-mapped token file of the
same tokens hand a peer exactly the same windows, and resuming after ``skip`` windows is arithmetic.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch

from swarm._tokenizer import Tokenizer

MAX_SHARDS = 1024
BYTE_VOCAB = 256
"""Tokens of byte-level text: one per byte value."""


def hash64(*parts: object) -> int:
    """A 64-bit hash of ``parts`` (their ``str``), the same on every machine and Python."""
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
    """What :class:`~swarm.learning.TrainBatches` and ``make_eval_set`` need from a source of tokens."""

    @property
    def unit(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def eval(self) -> torch.Tensor: ...

    def iter_windows(
        self, block_size: int, peer_key: str, seed: int, skip: int = 0
    ) -> Iterator[torch.Tensor]: ...


def window_starts(
    total: int, span: int, peer_key: str, seed: int, skip: int = 0, *, name: str = "data"
) -> Iterator[np.ndarray]:
    """Endless int64 arrays of window start offsets into ``total`` training tokens, one array per shard.

    Windows are ``span`` tokens long. ``skip`` windows are passed over first without producing them
    (a resumed peer starts where it stopped, whatever the corpus size).
    """
    peer = hash64("peer", seed, peer_key)
    epoch = 0
    while True:
        # All peers share the epoch's phase, so their windows line up and shards are disjoint.
        phase = hash64("phase", seed, epoch) % span
        count = (total - phase) // span
        if count < 1:
            raise ValueError(f"{name}: {total} training tokens, fewer than one window of {span}")
        shards = min(MAX_SHARDS, count)
        for i in range(shards):
            shard = (peer + i) % shards
            size = len(range(shard, count, shards))
            if skip >= size:
                skip -= size
                continue
            windows = np.arange(shard, count, shards)
            np.random.default_rng([peer, epoch, shard]).shuffle(windows)
            starts = phase + windows[skip:] * span
            skip = 0
            yield starts
        epoch += 1
