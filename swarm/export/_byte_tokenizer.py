"""A ``transformers`` tokenizer for byte-level models: token id = byte value, 256 tokens, no specials.

Made of parts every ``tokenizers`` release has: the byte-level pre-tokenizer maps each byte to one
printable character (GPT-2's table), a BPE model without merges maps each character to its byte's id,
and the byte-level decoder maps ids back to bytes and decodes them as UTF-8. So
``AutoTokenizer.from_pretrained(DIR)`` encodes text to its UTF-8 bytes, exactly what the run trained on.
"""

from __future__ import annotations

from typing import Any

BYTE_VOCAB = 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table: the printable Latin-1 bytes stand for themselves, the others for 256 upward."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(BYTE_VOCAB):
        if byte not in table:
            table[byte] = chr(BYTE_VOCAB + extra)
            extra += 1
    return table


def byte_tokenizer(max_length: int) -> Any:
    """The byte tokenizer as a ``PreTrainedTokenizerFast`` (``model_max_length``: the context length).

    Raises ImportError without transformers.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=max_length)
