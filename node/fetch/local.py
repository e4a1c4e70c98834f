"""The local store a fetch writes: the manifest first, then each file atomically once its sha256 matches.

A file being fetched lives in `DIR/.partial/<pid>/` (written at any offset, hashed as it arrives
in order); once every byte is there and the hash matches the manifest it is fsynced and renamed
to its store path, and the directory is fsynced. A crash therefore leaves part files (removed by
the next fetch), never a half file under a store name; two processes may fetch into one store. `fetched.json` lists the files fetched
and verified so far: a fetched store usually holds one span, and `store verify` checks exactly
those files. Methods here block (disk IO, hashing): async callers run them in a thread.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from dsd.shard_store import Manifest, StoreError
from dsd.shard_store.files import atomic_write_bytes, sha256_file
from dsd.shard_store.manifest import MANIFEST_NAME, check_relpath, file_matches

MARKER_NAME = "fetched.json"
PARTIAL_DIR = ".partial"
DEFAULT_FETCH_ROOT = Path.home() / ".cache" / "dsd" / "fetched"
_HASH_CHUNK = 1 << 20


def manifest_sha256(store_dir: str | Path) -> str:
    """The trust root of a store: the sha256 of its manifest.json bytes (what `store inspect` prints)."""
    return sha256_file(Path(store_dir) / MANIFEST_NAME)


def default_fetch_dir(model: str, manifest_sha: str, root: Path | None = None) -> Path:
    """Where a fetch stores `model` by default: ROOT/<model, path-safe>/<first 16 hex of the manifest sha256>."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model).strip(".") or "model"
    return (root or DEFAULT_FETCH_ROOT) / safe / manifest_sha[:16]


def read_marker(store_dir: str | Path) -> dict[str, Any] | None:
    """The fetch record of a store (None for a store that was converted, not fetched)."""
    path = Path(store_dir) / MARKER_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path}: cannot parse the fetch record: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise StoreError(f"{path}: a fetch record must be an object with a files list")
    return data


def files_to_verify(store_dir: str | Path, manifest: Manifest) -> tuple[list[str], dict[str, Any] | None]:
    """(the files a store must hold, its fetch record): every listed file, or those a fetch recorded."""
    marker = read_marker(store_dir)
    if marker is None:
        return sorted(manifest.files), None
    files = [f for f in marker["files"] if isinstance(f, str)]
    unknown = [f for f in files if f not in manifest.files]
    if unknown:
        raise StoreError(f"{store_dir}: the fetch record lists files the manifest does not: {', '.join(unknown[:5])}")
    return sorted(files), marker


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PartFile:
    """A file being fetched: bytes written at any offset; the sha256 advances while they arrive in order."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, size)
        self._hash = hashlib.sha256()
        self._hashed = 0  # bytes [0, _hashed) are in _hash

    def write(self, offset: int, data: bytes) -> None:
        """Write `data` at `offset` (callers serialise writes of one file)."""
        if offset < 0 or offset + len(data) > self.size:
            raise ValueError(f"{self.path.name}: bytes [{offset}, {offset + len(data)}) outside its {self.size} bytes")
        view, at = memoryview(data), offset
        while view:
            n = os.pwrite(self._fd, view, at)
            view, at = view[n:], at + n
        if offset == self._hashed:
            self._hash.update(data)
            self._hashed = at

    def forget_hash(self) -> None:
        """Bytes already hashed were replaced (their sender was discarded): hash from the start again."""
        self._hash = hashlib.sha256()
        self._hashed = 0

    def digest(self) -> str:
        """The file's sha256, reading back only what did not arrive in order."""
        while self._hashed < self.size:
            chunk = os.pread(self._fd, min(_HASH_CHUNK, self.size - self._hashed), self._hashed)
            if not chunk:
                raise StoreError(f"{self.path}: ends at {self._hashed} bytes, expected {self.size}")
            self._hash.update(chunk)
            self._hashed += len(chunk)
        return self._hash.hexdigest()

    def read(self, offset: int, n: int) -> bytes:
        return os.pread(self._fd, n, offset)

    def close(self, *, sync: bool) -> None:
        if self._fd < 0:
            return
        try:
            if sync:
                os.fsync(self._fd)
        finally:
            os.close(self._fd)
            self._fd = -1

    def discard(self) -> None:
        self.close(sync=False)
        self.path.unlink(missing_ok=True)


class LocalStore:
    """The store directory a fetch fills: a manifest (the trust root's bytes), files, and the fetch record."""

    def __init__(self, path: Path, manifest_bytes: bytes, manifest_sha: str) -> None:
        self.path = Path(path).expanduser().absolute()
        self.manifest_bytes = manifest_bytes
        self.manifest_sha = manifest_sha
        self.manifest = Manifest.from_dict(json.loads(manifest_bytes))
        self.partial = self.path / PARTIAL_DIR / str(os.getpid())

    def prepare(self) -> None:
        """Create the directory (or reuse one holding this same manifest), write the manifest, drop old part files."""
        existing = self.path / MANIFEST_NAME
        if existing.exists():
            have = manifest_sha256(self.path)
            if have != self.manifest_sha:
                raise StoreError(
                    f"{self.path} already holds another manifest (sha256 {have[:16]}…, fetching {self.manifest_sha[:16]}…); "
                    "choose another directory"
                )
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(existing, self.manifest_bytes)
            self._write_marker([])
        for old in (self.path / PARTIAL_DIR).glob("*"):  # part files of fetches that died (or of ours, earlier)
            if not (old.name.isdigit() and int(old.name) != os.getpid() and _pid_alive(int(old.name))):
                shutil.rmtree(old, ignore_errors=True)

    def holds(self, relpath: str) -> bool:
        """True when the file is in place at the manifest's size and sha256 (a finished file is never fetched again)."""
        return file_matches(self.path, relpath, self.manifest.files[relpath])

    def part(self, relpath: str) -> PartFile:
        """A fresh part file for `relpath`."""
        entry = self.manifest.files[relpath]
        name = check_relpath(relpath).replace("/", "__")
        return PartFile(self.partial / f"{name}.part", int(entry["size"]))

    def install(self, part: PartFile, relpath: str) -> None:
        """Move a verified part file to its store path durably and record it."""
        final = self.path / check_relpath(relpath)
        final.parent.mkdir(parents=True, exist_ok=True)
        part.close(sync=True)
        os.chmod(part.path, 0o644)
        os.replace(part.path, final)
        _fsync_dir(final.parent)
        self.record([relpath])

    def record(self, relpaths: list[str]) -> None:
        """Add verified files to the fetch record (a converted store filled up by a fetch keeps none:
        `store verify` checks all of its files)."""
        with open(self.path / ".fetch.lock", "w") as lock:  # another process may record into this store too
            fcntl.flock(lock, fcntl.LOCK_EX)
            marker = read_marker(self.path)
            if marker is not None:
                self._write_marker(sorted(set(marker["files"]) | set(relpaths)))

    def _write_marker(self, files: list[str]) -> None:
        atomic_write_bytes(self.path / MARKER_NAME, json.dumps({
            "model_id": self.manifest.model_id,
            "manifest_sha256": self.manifest_sha,
            "files": files,
            "updated": round(time.time(), 3),
        }, indent=2).encode())

    def cleanup(self) -> None:
        """Remove the part-file folder once a fetch is over."""
        if self.partial.exists():
            shutil.rmtree(self.partial, ignore_errors=True)
