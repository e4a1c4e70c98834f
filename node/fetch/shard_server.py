"""Serving a store's files on `/dsd/shard/1`: its manifest, and byte ranges of files named by sha256.

A file is found through the manifest only (sha256 -> the manifest's store path, checked to stay
inside the store), so nothing from the wire ever becomes a path. A file is served once it was
hashed and matched its manifest entry (on the first request for it, and again whenever it
changes on disk); a partial store serves the files it holds. Each remote peer gets a few
streams at a time and a token bucket of requests; every read is one bounded chunk.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import trio

from dsd.discovery.framing import FramedStream, send_quietly
from dsd.discovery.records import PeerRecord
from dsd.protocol import (
    Error,
    FileChunk,
    FileEnd,
    GetFile,
    GetManifest,
    ManifestData,
    ProtocolError,
)
from dsd.protocol.ids import SHARD_PROTOCOL
from dsd.protocol.limits import DEFAULT_LIMITS
from dsd.protocol.shard import BUSY, NOT_FOUND
from dsd.shard_store import Store
from dsd.shard_store.files import sha256_file
from dsd.shard_store.manifest import MANIFEST_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeLimits:
    """What one serving peer grants: streams at once (all and per remote peer), requests per second per peer."""

    max_streams: int = 16
    max_streams_per_peer: int = 4
    requests_per_s: float = 20.0
    burst: int = 40
    idle_timeout_s: float = 60.0  # wait for the next request on a stream
    send_timeout_s: float = 60.0  # one frame to the fetcher
    max_peers_tracked: int = 4096  # rate-limit buckets kept (least recently used go first)

    def __post_init__(self) -> None:
        if min(self.max_streams, self.max_streams_per_peer, self.burst, self.max_peers_tracked) < 1:
            raise ValueError("ServeLimits counts must be >= 1")
        if not self.requests_per_s > 0:
            raise ValueError("ServeLimits.requests_per_s must be > 0")


def announce_manifest(
    record_fn: Callable[[], PeerRecord | Iterable[PeerRecord]], sha256: str
) -> Callable[[], list[PeerRecord]]:
    """Wrap an announcer's record function so every record carries the store's manifest sha256 (so a fetcher
    knows which peers hold the manifest it trusts)."""

    def records() -> list[PeerRecord]:
        got = record_fn()
        recs = [got] if isinstance(got, PeerRecord) else list(got)
        return [replace(r, manifest_sha256=sha256) for r in recs]

    return records


class TokenBucket:
    """Requests allowed at `rate` per second with bursts of `burst`; pure arithmetic over the times given."""

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.at = now

    def take(self, now: float) -> float:
        """0.0 when a request may go now (and is counted), else the seconds until one may."""
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class ShardServer:
    """The `/dsd/shard/1` handler of one store: `node.set_handler(SHARD_PROTOCOL, ShardServer(store))`."""

    def __init__(self, store: Store, *, limits: ServeLimits | None = None, verified: Iterable[str] = ()) -> None:
        self.store = store
        self.root = store.path.resolve()
        self.limits = limits or ServeLimits()
        self.model_id = store.manifest.model_id
        manifest_bytes = (store.path / MANIFEST_NAME).read_bytes()
        if len(manifest_bytes) > DEFAULT_LIMITS.max_manifest_bytes:
            log.warning("manifest of %s is %d bytes, more than a ManifestData carries: not serving it",
                        self.model_id, len(manifest_bytes))
            manifest_bytes = b""
        self.manifest_bytes = manifest_bytes
        self.by_sha: dict[str, list[str]] = {}  # identical files share a hash: any copy held will do
        for relpath, entry in sorted(store.manifest.files.items()):
            self.by_sha.setdefault(entry["sha256"], []).append(relpath)
        self._verified: dict[str, tuple[int, int]] = {}  # relpath -> (size, mtime_ns) when it last matched
        for relpath in verified:
            stat = self._stat(relpath)
            if stat is not None:
                self._verified[relpath] = stat
        self._hashing: dict[str, trio.Lock] = {}
        self._disk = trio.CapacityLimiter(4)
        self._streams: dict[str, int] = {}
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()
        self.bytes_sent: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    # --- which files may be served -----------------------------------------------

    def _path(self, relpath: str) -> Path | None:
        """The store path of a manifest entry, if it resolves inside the store (never through a link out of it)."""
        path = (self.store.path / relpath).resolve()
        return path if path.is_relative_to(self.root) else None

    def _stat(self, relpath: str) -> tuple[int, int] | None:
        path = self._path(relpath)
        try:
            st = path.stat() if path is not None else None
        except OSError:
            return None
        if st is None or not path.is_file() or st.st_size != self.store.manifest.files[relpath]["size"]:
            return None
        return st.st_size, st.st_mtime_ns

    async def _servable(self, relpath: str) -> Path | None:
        """The file's path once it is known to match its manifest entry (hashing it first if needed)."""
        lock = self._hashing.setdefault(relpath, trio.Lock())
        async with lock:
            stat = self._stat(relpath)
            if stat is None:
                return None
            if self._verified.get(relpath) != stat:
                path = self._path(relpath)
                assert path is not None
                async with self._disk:
                    digest = await trio.to_thread.run_sync(sha256_file, path)
                if digest != self.store.manifest.files[relpath]["sha256"]:
                    log.error("%s in store %s does not match its manifest: not serving it", relpath, self.store.path)
                    return None
                self._verified[relpath] = stat
            return self._path(relpath)

    def read_chunk(self, fd: int, offset: int, n: int) -> bytes:
        """Read one chunk of an open file (runs in a worker thread)."""
        return os.pread(fd, n, offset)

    # --- rate limits -------------------------------------------------------------------

    def _bucket(self, remote: str) -> TokenBucket:
        bucket = self._buckets.get(remote)
        if bucket is None:
            bucket = TokenBucket(self.limits.requests_per_s, self.limits.burst, time.monotonic())
            self._buckets[remote] = bucket
            while len(self._buckets) > self.limits.max_peers_tracked:
                self._buckets.popitem(last=False)
        self._buckets.move_to_end(remote)
        return bucket

    async def _refuse(self, stream: FramedStream, remote: str, error: Error) -> None:
        self.refused[remote] = self.refused.get(remote, 0) + 1
        await send_quietly(stream, error)

    # --- the protocol ------------------------------------------------------------------

    async def __call__(self, stream: FramedStream, remote: str) -> None:
        lim = self.limits
        if sum(self._streams.values()) >= lim.max_streams or self._streams.get(remote, 0) >= lim.max_streams_per_peer:
            await self._refuse(stream, remote, Error(BUSY, f"too many shard streams (at most {lim.max_streams_per_peer} "
                                                           f"per peer, {lim.max_streams} in all); retry later"))
            return
        self._streams[remote] = self._streams.get(remote, 0) + 1
        try:
            await self._serve(stream, remote)
        finally:
            self._streams[remote] -= 1
            if not self._streams[remote]:
                del self._streams[remote]

    async def _serve(self, stream: FramedStream, remote: str) -> None:
        while True:
            try:
                with trio.fail_after(self.limits.idle_timeout_s):
                    msg = await stream.receive()
            except (EOFError, trio.TooSlowError):
                return
            except ProtocolError as exc:
                log.info("shard stream from %s: %s", remote, exc)
                await self._refuse(stream, remote, Error(exc.code, f"bad request: {exc}"))
                return
            wait = self._bucket(remote).take(time.monotonic())
            if wait:
                await self._refuse(stream, remote, Error(BUSY, f"rate limited ({self.limits.requests_per_s:g} "
                                                               f"requests/s per peer): retry in {wait:.2f} s"))
                continue
            if isinstance(msg, GetManifest):
                await self._send_manifest(stream, remote, msg)
            elif isinstance(msg, GetFile):
                await self._send_file(stream, remote, msg)
            else:
                await self._refuse(stream, remote, Error(
                    "bad_request", f"expected GetManifest or GetFile on {SHARD_PROTOCOL}, got {type(msg).__name__}"))
                return

    async def _send_manifest(self, stream: FramedStream, remote: str, msg: GetManifest) -> None:
        if msg.model != self.model_id or not self.manifest_bytes:
            await self._refuse(stream, remote, Error(NOT_FOUND, f"this peer holds no manifest of model {msg.model!r}"))
            return
        with trio.fail_after(self.limits.send_timeout_s):
            await stream.send(ManifestData(msg.model, self.manifest_bytes))

    async def _send_file(self, stream: FramedStream, remote: str, msg: GetFile) -> None:
        relpath, path = None, None
        for relpath in self.by_sha.get(msg.sha256, []):
            path = await self._servable(relpath)
            if path is not None:
                break
        if relpath is None or path is None:
            await self._refuse(stream, remote, Error(NOT_FOUND, f"this peer holds no file with sha256 {msg.sha256}"))
            return
        size = int(self.store.manifest.files[relpath]["size"])
        end = msg.offset + msg.length
        if end > size:
            await self._refuse(stream, remote, Error(
                "bad_request", f"range [{msg.offset}, {end}) of file {msg.sha256[:16]}… is outside its {size} bytes"))
            return
        fd = await trio.to_thread.run_sync(os.open, path, os.O_RDONLY)
        try:
            at = msg.offset
            while at < end:
                async with self._disk:
                    data = await trio.to_thread.run_sync(self.read_chunk, fd, at, min(msg.chunk, end - at))
                if not data:
                    self._verified.pop(relpath, None)
                    await self._refuse(stream, remote, Error("internal", f"file {msg.sha256[:16]}… changed on disk"))
                    return
                with trio.fail_after(self.limits.send_timeout_s):
                    await stream.send(FileChunk(msg.sha256, at, data))
                at += len(data)
                self.bytes_sent[remote] = self.bytes_sent.get(remote, 0) + len(data)
        finally:
            os.close(fd)
        with trio.fail_after(self.limits.send_timeout_s):
            await stream.send(FileEnd(msg.sha256, end))
