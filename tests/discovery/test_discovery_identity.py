"""Identity file: created private (0600), reused across loads, corrupt files refused with a clear error."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dsd.discovery.identity import IdentityError, load_or_create_identity, peer_id_of


def test_identity_persists_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "identity.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = load_or_create_identity(path)
    assert peer_id_of(first) == peer_id_of(second)
    assert peer_id_of(first).startswith("12D3KooW")  # ed25519 peer ids
    assert peer_id_of(load_or_create_identity(tmp_path / "other.key")) != peer_id_of(first)
    assert [p.name for p in path.parent.iterdir()] == ["identity.key"]  # no temp files left


def test_corrupt_or_exposed_identity_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "id.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"not a key at all")
    os.close(fd)
    with pytest.raises(IdentityError, match="does not hold a libp2p private key"):
        load_or_create_identity(path)
    path.write_bytes(b"")
    with pytest.raises(IdentityError, match="empty"):
        load_or_create_identity(path)
    good = tmp_path / "good.key"
    load_or_create_identity(good)
    good.chmod(0o644)
    with pytest.raises(IdentityError, match="chmod 600"):
        load_or_create_identity(good)
