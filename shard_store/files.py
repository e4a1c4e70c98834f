"""File helpers for stores: streaming sha256 and atomic writes (tmp file + rename)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks so big weight files never sit in memory whole."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call write(tmp_path) then rename tmp over path, so a crash never leaves a half file at path.
    The file ends up world-readable (0644): stores are shared read-only data."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write bytes to path atomically."""
    atomic_write(path, lambda tmp: tmp.write_bytes(data))
