"""How a model is scored: held-out windows, the loss in bits, and bits per byte across tokenizers.

Every loss this project reports is in **bits per token**: the training loss of an inner step, the
held-out loss, what records, lines, summaries and plots show. For byte-level data a token is a byte,
so that is bits per byte. A tokenized run (``data.tokenizer``) also reports its held-out loss in bits
per byte: the total bits over the evaluated tokens divided by the UTF-8 bytes those tokens decode to,
which compares runs with different tokenizers (a token covers several bytes).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from swarm._tokenizer import Tokenizer
from swarm.learning._precision import Precision, resolve_precision
from swarm.learning.data import TokenSource

logger = logging.getLogger(__name__)

LN2 = math.log(2)


class Interrupted(Exception):
    """A stop event was set: the step or evaluation in progress was abandoned, nothing of it applied.

    Raised between micro-batches (:meth:`~swarm.learning.InnerTrainer.step`) and between held-out
    batches (:func:`evaluate`), so that a shutdown waits for at most one of them."""


def nats_to_bits(nats: float) -> float:
    """A cross-entropy in nats (what ``lm_loss`` computes) in bits."""
    return nats / LN2


@dataclass(frozen=True, eq=False)
class EvalSet:
    """Held-out tokens and how to cut them into evaluation windows.

    ``tokenizer`` is None when tokens are bytes; else it decodes windows to count their bytes.
    """

    tokens: torch.Tensor
    block_size: int
    batch_size: int = 32
    unit: str = "byte"
    tokenizer: Tokenizer | None = None
    _target_bytes: dict[int, int] = field(default_factory=dict, init=False, repr=False)

    @property
    def loss_unit(self) -> str:
        """The unit of every loss of this run: ``bits/byte`` or ``bits/token``."""
        return f"bits/{self.unit}"

    def batches(self, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``count`` batches of windows spread evenly over the held-out text, the same on every peer."""
        span = self.block_size + 1
        last = len(self.tokens) - span
        if last < 0:
            raise ValueError(f"held-out text has {len(self.tokens)} tokens, fewer than one window of {span}")
        starts = torch.linspace(0, last, count * self.batch_size).round().long()
        for chunk in starts.split(self.batch_size):
            rows = self.tokens[chunk[:, None] + torch.arange(span)].long()
            yield rows[:, :-1], rows[:, 1:]

    def target_bytes(self, count: int) -> int:
        """UTF-8 bytes that the targets of :meth:`batches` ``(count)`` decode to (computed once per count)."""
        if count not in self._target_bytes:
            if self.tokenizer is None:
                total = count * self.batch_size * self.block_size
            else:
                decoded = self.tokenizer.decoded_bytes
                total = sum(decoded(row.tolist()) for _, y in self.batches(count) for row in y)
            self._target_bytes[count] = total
        return self._target_bytes[count]

    def bits_per_byte(self, bits_per_token: float, count: int) -> float:
        """The held-out loss :func:`evaluate` ``(model, self, count)`` gave, in bits per byte of text."""
        tokens = count * self.batch_size * self.block_size
        return bits_per_token * tokens / max(self.target_bytes(count), 1)


def make_eval_set(source: TokenSource, block_size: int, batch_size: int = 32) -> EvalSet:
    """The evaluation windows of ``source``'s held-out split."""
    return EvalSet(source.eval, block_size, batch_size, source.unit, source.tokenizer)


VOCAB_CHUNK = 8192
"""Vocabulary entries whose float32 logits :func:`chunked_cross_entropy` holds at once, per token."""


def chunked_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, chunk: int = VOCAB_CHUNK
) -> torch.Tensor:
    """Summed next-token cross-entropy in nats, computed over the vocabulary ``chunk`` entries at a time.

    Equal to ``F.cross_entropy(logits.float(), targets, reduction="sum")``, but the float32 copy of
    the logits it makes is ``chunk`` wide instead of the whole vocabulary: with a 32k vocabulary
    the full copy of a 32-window batch of 2048 tokens alone is 8 GiB.
    """
    flat = logits.reshape(-1, logits.size(-1))
    parts = [torch.logsumexp(flat[:, i : i + chunk].float(), dim=-1) for i in range(0, flat.size(-1), chunk)]
    log_normalizer = torch.logsumexp(torch.stack(parts, dim=-1), dim=-1)
    target_logits = flat.gather(1, targets.reshape(-1, 1)).squeeze(1).float()
    return (log_normalizer - target_logits).sum()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    eval_data: EvalSet,
    batches: int = 8,
    *,
    stop: threading.Event | None = None,
    micro_batch_size: int | None = None,
    precision: Precision | None = None,
    vocab_chunk: int = VOCAB_CHUNK,
) -> float:
    """Mean next-token loss on the held-out split in bits per token (``eval_data.loss_unit``).

    Each batch of windows runs ``micro_batch_size`` windows at a time (the training micro-batch: what
    fits in training fits here, with no activations kept for a backward pass), in ``precision``
    (default: ``auto`` resolved for the model's device, as training resolves it), with the loss over
    the vocabulary in chunks (:func:`chunked_cross_entropy`). A set ``stop`` raises
    :class:`Interrupted` before the next micro-batch."""
    device = next(model.parameters()).device
    if precision is None:
        precision = resolve_precision("auto", device)
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        for x, y in eval_data.batches(batches):
            step = micro_batch_size or len(x)
            for xs, ys in zip(x.split(step), y.split(step), strict=True):
                if stop is not None and stop.is_set():
                    raise Interrupted("evaluation abandoned: stopping")
                with precision.autocast(device, cache=False):  # no backward: the cache only holds memory
                    logits = model(xs.to(device))
                total += float(chunked_cross_entropy(logits, ys.to(device), vocab_chunk))
                tokens += ys.numel()
                del logits
    finally:
        model.train(was_training)
    return nats_to_bits(total / max(tokens, 1))


def evaluate_fitting(
    model: nn.Module,
    eval_data: EvalSet,
    batches: int = 8,
    *,
    micro_batch_size: int,
    **options: Any,
) -> float | None:
    """:func:`evaluate`, halving ``micro_batch_size`` on out-of-memory; None (after a warning) when not
    even one window fits: an evaluation that does not fit is skipped, never fatal. The allocator's
    cache is emptied once each error is handled (its traceback held the activations until then)."""
    from swarm.learning._micro_batch import is_oom, release_cached

    device = next(model.parameters()).device
    micro = max(1, micro_batch_size)
    while True:
        try:
            return evaluate(model, eval_data, batches, micro_batch_size=micro, **options)
        except RuntimeError as error:
            if not is_oom(error):
                raise
            message = (str(error).splitlines() or [""])[0][:200]
        release_cached(device)
        if micro == 1:
            logger.warning("out of memory evaluating one window at a time (%s): evaluation skipped", message)
            return None
        logger.warning("out of memory evaluating at a micro-batch of %d (%s): halving it", micro, message)
        micro //= 2


def unigram_bits(train: torch.Tensor, held_out: torch.Tensor, vocab_size: int = 256) -> float:
    """Bits per token of the best context-free model: training token frequencies scored on held-out text.

    A trained model should end well below this baseline; add-one smoothing keeps it finite.
    """
    counts = torch.bincount(train.long(), minlength=vocab_size).double() + 1
    log_probs = (counts / counts.sum()).log2()
    return float(-log_probs[held_out.long()].mean())
