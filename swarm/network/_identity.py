"""Persistent peer identity: an RSA key file that fixes the libp2p peer id.

The same key also signs this peer's DHT records (hivemind's ``RSASignatureValidator``), which binds a
membership record to the peer id that published it: a record whose signing key does not hash to the
peer id it claims is discarded by :func:`swarm.membership.list_members`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import multihash
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from swarm._errors import SwarmError

IDENTITY_FILE_MODE = 0o600


class IdentityError(SwarmError, ValueError):
    """The identity file cannot be read, written or parsed."""


def ensure_identity(path: str | os.PathLike) -> Path:
    """Create an identity file at ``path`` (mode 0600, parent dirs 0700) unless one already exists."""
    path = Path(path).expanduser()
    if path.exists():
        load_identity(path)  # fail early on a corrupt or foreign file
        return path
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, IDENTITY_FILE_MODE)
    except FileExistsError:
        return path  # another process created it first; it is as good as ours
    except OSError as exc:
        raise IdentityError(f"cannot create identity file {str(path)!r}: {exc.strerror}") from None
    key = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=RSAPrivateKey().to_bytes())
    with os.fdopen(fd, "wb") as file:
        file.write(key.SerializeToString())
        file.flush()
        os.fsync(file.fileno())
    os.chmod(path, IDENTITY_FILE_MODE)  # umask may have narrowed or widened the creation mode
    return path


def ephemeral_identity() -> Path:
    """A fresh identity in a private temporary file, for peers started without ``--identity-path``."""
    directory = Path(tempfile.mkdtemp(prefix="swarm-identity-"))
    return ensure_identity(directory / "identity.key")


def load_identity(path: str | os.PathLike) -> RSAPrivateKey:
    """Read the RSA private key stored in a libp2p identity file."""
    try:
        data = Path(path).read_bytes()
        proto = crypto_pb2.PrivateKey.FromString(data)
        if proto.key_type != crypto_pb2.KeyType.RSA:
            raise ValueError("only RSA identities are supported")
        if not isinstance(serialization.load_der_private_key(proto.data, password=None), rsa.RSAPrivateKey):
            raise ValueError("not an RSA key")
    except OSError as exc:
        raise IdentityError(f"cannot read identity file {str(path)!r}: {exc.strerror}") from None
    except Exception as exc:
        raise IdentityError(f"identity file {str(path)!r} is not a valid libp2p RSA key: {exc}") from None
    # RSAPrivateKey has no public constructor from existing key material; its pickle protocol is one.
    private_key = RSAPrivateKey.__new__(RSAPrivateKey)
    private_key.__setstate__({"_private_key": proto.data})
    return private_key


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The base58 libp2p peer id that belongs to an RSA public key."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def peer_id_of_identity(path: str | os.PathLike) -> str:
    """The peer id that an identity file gives."""
    return peer_id_of(load_identity(path).get_public_key())
