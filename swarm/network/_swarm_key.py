"""The secret of a private swarm: loading it (file or ``SWARM_KEY``), checking it, never showing it.

Every peer of a private swarm holds the same key. It is never used directly. Whatever the key is (the
64 hex digits ``swarm config keygen`` writes, any other key file, or a passphrase in ``SWARM_KEY``), it is
first stretched with scrypt (:data:`SCRYPT_N`, :data:`SCRYPT_R`, :data:`SCRYPT_P`, the fixed salt
:data:`SCRYPT_SALT`), so each guess at a passphrase costs an attacker about 32 MiB of memory and a tenth
of a second. Key files are read as before and need no change: the same file gives the same key on every
peer that runs this version. Then :meth:`SwarmKey.derive` gives one independent sub-key per purpose
(DHT RPC signatures, stream handshakes, the fingerprint), so a value computed for one purpose is
useless for another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path

from swarm._errors import SwarmError

ENV_VAR = "SWARM_KEY"
MIN_KEY_BYTES = 16
MIN_DISTINCT_BYTES = 10
MAX_KEY_FILE_BYTES = 4096
KEY_FILE_MODE = 0o600
SCRYPT_SALT = b"swarm-key-v2/scrypt"
"""Fixed and public: it separates this use of scrypt from any other; the key itself must be secret."""
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**15, 8, 1
"""scrypt cost: 128 * N * r bytes = 32 MiB of memory per guess."""
_SCRYPT_MAXMEM = 64 * 2**20


class SwarmKeyError(SwarmError, ValueError):
    """The swarm key is missing, unreadable, too weak, or its file is readable by others."""


class SwarmKey:
    """A swarm key. Its ``repr``/``str`` never show the secret; :attr:`fingerprint` names it safely."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        secret = bytes(secret).strip()
        if len(secret) < MIN_KEY_BYTES:
            raise SwarmKeyError(
                f"the swarm key is {len(secret)} bytes long; it must be at least {MIN_KEY_BYTES} "
                "(make one with `swarm config keygen -o FILE`)"
            )
        if len(set(secret)) < MIN_DISTINCT_BYTES:
            raise SwarmKeyError(
                f"the swarm key uses fewer than {MIN_DISTINCT_BYTES} distinct characters and cannot be "
                "random (make one with `swarm config keygen -o FILE`)"
            )
        self._secret = _stretch(secret)

    def derive(self, purpose: str) -> bytes:
        """A 32-byte sub-key for one purpose (HMAC-SHA256 of the purpose under the key)."""
        return hmac.new(self._secret, b"swarm-key-derive\0" + purpose.encode(), hashlib.sha256).digest()

    @property
    def fingerprint(self) -> str:
        """8 hex digits that identify the key without revealing it (to compare keys between peers)."""
        return hashlib.sha256(self.derive("fingerprint")).hexdigest()[:8]

    def __repr__(self) -> str:
        return f"SwarmKey(<redacted>, fingerprint={self.fingerprint})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(self.fingerprint)


@lru_cache(maxsize=8)
def _stretch(secret: bytes) -> bytes:
    """The 32-byte master key: scrypt of the key as written (cached: a process loads one key, often)."""
    return hashlib.scrypt(
        secret, salt=SCRYPT_SALT, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=_SCRYPT_MAXMEM, dklen=32
    )


def load_swarm_key(path: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> SwarmKey | None:
    """The swarm key from the file at ``path`` or the ``SWARM_KEY`` variable in ``environ``; None if neither.

    Refuses both at once (which one would win is a surprise either way), a file that group or others
    may read (as ssh does for private keys), and a key shorter than 16 bytes.
    """
    from_env = environ.get(ENV_VAR)
    if path is not None and from_env is not None:
        raise SwarmKeyError(f"both network.swarm_key_file and {ENV_VAR} are set; set only one of them")
    if from_env is not None:
        try:
            return SwarmKey(from_env.encode())
        except SwarmKeyError as exc:
            raise SwarmKeyError(f"{ENV_VAR}: {exc}") from None
    if path is None:
        return None
    try:
        return SwarmKey(_read_private_file(Path(path)))
    except SwarmKeyError as exc:
        raise SwarmKeyError(f"swarm key file {path}: {exc}") from None


def _read_private_file(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise SwarmKeyError(f"cannot be read: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SwarmKeyError("is not a regular file")
        if info.st_mode & 0o077:
            raise SwarmKeyError(
                f"is accessible by group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
                f"run `chmod 600 {path}`"
            )
        data = file.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise SwarmKeyError(f"is larger than {MAX_KEY_FILE_BYTES} bytes and does not look like a key")
    return data


def write_new_key(path: str | os.PathLike[str]) -> SwarmKey:
    """Create ``path`` (mode 0600, refusing to overwrite) holding 32 random bytes as hex."""
    text = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, KEY_FILE_MODE)
    with os.fdopen(fd, "w", encoding="ascii") as file:
        file.write(text + "\n")
    return SwarmKey(text.encode())
