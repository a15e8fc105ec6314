"""``data.tokenizer``: a ``transformers`` tokenizer, loaded once per process, and its content fingerprint.

The config loads it to take ``model.vocab_size`` from it and to put its fingerprint into the config hash
(peers whose tokenizers differ must not average); the data pipeline encodes text with it. Neither torch
nor transformers is imported until a tokenizer is asked for.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

INSTALL_HINT = "data.tokenizer needs the 'transformers' package: pip install swarm[hf]"
FINGERPRINT_HEX_DIGITS = 16
# The parts of a fast tokenizer's definition that decide how text becomes ids and back; its truncation,
# padding and post-processor (special tokens around a sequence) are not used here.
_IDENTITY_PARTS = ("model", "normalizer", "pre_tokenizer", "added_tokens", "decoder")


class TokenizerError(ValueError):
    """``data.tokenizer`` names nothing loadable (or transformers is missing); the message says which."""


@dataclass(frozen=True, eq=False)
class Tokenizer:
    """A loaded tokenizer: ``vocab_size`` ids, identified by ``fingerprint`` whatever its name or path."""

    spec: str
    hf: Any
    vocab_size: int
    fingerprint: str

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens around it."""
        if not texts:
            return []
        return self.hf(list(texts), add_special_tokens=False, verbose=False)["input_ids"]

    def decoded_bytes(self, ids: Sequence[int]) -> int:
        """UTF-8 bytes of the text that ``ids`` decode to."""
        text = self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return len(text.encode("utf-8"))


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names: an existing local directory (never downloads), else a Hub name.

    Loaded once per process and resolved path. Raises :class:`TokenizerError` naming ``spec`` and why.
    """
    local = Path(spec).expanduser()
    if not local.exists() and spec.startswith(("/", ".", "~")):
        raise TokenizerError(f"no tokenizer directory {spec!r}")
    return _load(str(local.resolve()) if local.exists() else spec, local.exists())


@functools.lru_cache(maxsize=8)
def _load(name: str, local: bool) -> Tokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise TokenizerError(INSTALL_HINT) from error
    if local and not Path(name).is_dir():
        raise TokenizerError(f"{name} is not a directory (save a tokenizer there with save_pretrained)")
    try:
        hf = AutoTokenizer.from_pretrained(name, local_files_only=local, trust_remote_code=False)
    except Exception as error:  # transformers raises OSError, ValueError, KeyError... for a bad tokenizer
        where = "in the local directory" if local else "as a Hugging Face Hub name (no such local directory)"
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise TokenizerError(f"cannot load a tokenizer {where} {name!r}: {first}") from error
    largest = max(hf.get_vocab().values(), default=-1)
    return Tokenizer(name, hf, max(len(hf), largest + 1), fingerprint(hf))


def fingerprint(hf: Any) -> str:
    """``sha256:`` + 16 hex digits of what maps text to ids and back (vocabulary, merges, normalisation)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        identity: Any = {part: definition.get(part) for part in _IDENTITY_PARTS}
    else:  # a slow (Python) tokenizer: its class and vocabulary
        identity = {"class": type(hf).__name__, "vocab": sorted(hf.get_vocab().items())}
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX_DIGITS]
