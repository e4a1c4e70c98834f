"""A peer's long-lived identity: an ed25519 key kept in a private file so the peer id survives restarts.

The file holds the libp2p protobuf encoding of the private key (the format go-libp2p
and kubo use for identity keys). It is created with mode 0600 and never logged.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

# A serialized ed25519 private key is ~68 bytes, secp256k1 ~37, RSA a few KiB.
MAX_IDENTITY_BYTES = 16 * 1024


class IdentityError(ValueError):
    """The identity file exists but cannot be used (corrupt, wrong type, unsafe permissions)."""


def _read_key(path: Path) -> KeyPair:
    data = path.read_bytes()
    if not data:
        raise IdentityError(f"identity file {path} is empty; delete it to create a new identity")
    if len(data) > MAX_IDENTITY_BYTES:
        raise IdentityError(f"identity file {path} is {len(data)} bytes, too large to be a key")
    try:
        private = deserialize_private_key(data)
        public = private.get_public_key()
    except Exception as exc:  # protobuf / key-type errors of several kinds
        raise IdentityError(
            f"identity file {path} does not hold a libp2p private key ({type(exc).__name__})"
        ) from None
    return KeyPair(private, public)


def load_or_create_identity(path: Path) -> KeyPair:
    """Load the key pair stored at `path`, or create an ed25519 one there (mode 0600) if absent."""
    path = Path(path)
    if path.exists():
        if not path.is_file():
            raise IdentityError(f"identity path {path} is not a regular file")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise IdentityError(
                f"identity file {path} is readable by others (mode {mode:o}); chmod 600 it"
            )
        return _read_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key_pair = create_new_key_pair()
    data = key_pair.private_key.serialize()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)  # atomic and never overwrites a key another process just wrote
        except FileExistsError:
            return _read_key(path)
    finally:
        tmp.unlink(missing_ok=True)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> str:
    """The base58 peer id string that `key_pair` gives a host."""
    return ID.from_pubkey(key_pair.public_key).to_base58()
