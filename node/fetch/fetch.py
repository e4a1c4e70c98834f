"""Fetching a span's files from the swarm: trust root, sources, parallel pieces, verify, install.

`Fetcher.open` finds the peers announcing a model (its DHT records), fetches the manifest from
one of them and checks its sha256 against the trust root (`--manifest-sha256`; with
`trust_first`, the hash most peers announce), then prepares the local store. `Fetcher.fetch`
gets the files asked for: each source peer has one worker that takes pieces from a shared
`PieceBoard` and writes them into part files; a dropped peer's piece goes back from the byte
where it stopped; every file is hashed before it is renamed into place; a file that does not
match is discarded and its sender blacklisted (when several peers sent parts of it, the next
copy comes from one peer and the bad copy is compared with it to find who lied).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from dsd.discovery.announce import fetch_records
from dsd.discovery.host import P2PNode
from dsd.protocol import FileChunk
from dsd.protocol.shard import BUSY, NOT_FOUND
from dsd.shard_store import StoreError

from .client import PeerFault, ShardClient, ShardRefused
from .local import LocalStore, PartFile, default_fetch_dir
from .plan import PieceBoard
from .request import FetchError, FetchProgress, FetchRequest, Source, _layer_index

log = logging.getLogger(__name__)

MANIFEST_ROUNDS = 3  # rounds over the sources for the manifest while every failure is a dial or connection error
MANIFEST_RETRY_S = 1.0  # seconds before round k + 1: k times this

class Fetcher:
    """One fetch into one local store, on a running node: `await open()`, then `await fetch(files)` (any times)."""

    def __init__(self, node: P2PNode, request: FetchRequest, *,
                 on_progress: Callable[[FetchProgress], None] | None = None,
                 on_chunk: Callable[[str, str, int, int], None] | None = None) -> None:
        self.node = node
        self.request = request
        self.on_progress = on_progress
        self.on_chunk = on_chunk  # (peer, relpath, offset, length) after each chunk is written
        self.sources: dict[str, Source] = {}
        self.local: LocalStore | None = None
        self.events: list[dict[str, Any]] = []
        self._board: PieceBoard | None = None
        self._parts: dict[str, PartFile] = {}
        self._locks: dict[str, trio.Lock] = {}
        self._suspects: dict[str, tuple[PartFile, list[tuple[str, int, int]]]] = {}
        self._changed = trio.Event()
        self._received = 0
        self._total = 0
        self._report: dict[str, Any] = {"files": {}}

    # --- trust root and sources ----------------------------------------------------------

    def _event(self, kind: str, peer: str, **details: Any) -> None:
        self.events.append({"t": round(time.time(), 3), "event": kind, "peer": peer, **details})
        log.info("fetch %s: %s %s", kind, peer, details)

    async def find_sources(self) -> list[Source]:
        """Peers announcing the model (not us), waiting up to find_timeout_s for the first."""
        req = self.request
        deadline = trio.current_time() + req.find_timeout_s
        while True:
            for rec in await fetch_records(self.node, req.model, 0):
                if rec.peer_id == self.node.peer_id:
                    continue
                src = self.sources.setdefault(rec.peer_id, Source(rec.peer_id, rec.addrs))
                src.addrs = rec.addrs or src.addrs
                if (rec.start, rec.end) not in src.spans:
                    src.spans.append((rec.start, rec.end))
                src.manifest_sha256 = rec.manifest_sha256 or src.manifest_sha256
            if self.sources or trio.current_time() >= deadline:
                break
            await trio.sleep(1.0)
        if not self.sources:
            raise FetchError(f"no peer announces model {req.model!r} (waited {req.find_timeout_s:.0f} s)")
        return list(self.sources.values())

    def trust_root(self) -> str | None:
        """The manifest sha256 to accept: the pinned one, else (trust_first) the one most peers announce."""
        if self.request.manifest_sha256 is not None:
            return self.request.manifest_sha256
        votes = Counter(s.manifest_sha256 for s in self.sources.values() if s.manifest_sha256)
        if not votes:
            return None  # nobody announces a hash: the first manifest served is trusted
        sha, n = votes.most_common(1)[0]
        log.warning("trusting manifest sha256 %s, announced by %d of %d peers (--trust-first-manifest); "
                    "pin it next time with --manifest-sha256 %s", sha, n, len(self.sources), sha)
        return sha

    async def open(self) -> LocalStore:
        """Find sources, fetch and check the manifest, prepare the local store; returns it. A round over the sources
        that failed only to connect (a dial that did not come up, a timeout) is run again, `MANIFEST_ROUNDS` in all,
        1 s and 2 s apart; a source that lied is blacklisted and not asked again."""
        if self.local is not None:
            return self.local
        await self.find_sources()
        want = self.trust_root()
        order = sorted(self.sources.values(), key=lambda s: (s.manifest_sha256 != want, s.peer_id))
        problems: list[str] = []
        for attempt in range(1, MANIFEST_ROUNDS + 1):
            problems, transient = [], True
            for src in order:
                if src.manifest_sha256 is not None and want is not None and src.manifest_sha256 != want:
                    continue  # it serves another version of the model
                if src.state == "blacklisted":
                    continue
                try:
                    data = await self._manifest_from(src)
                except (ShardRefused, ConnectionError, trio.TooSlowError, OSError) as exc:
                    problems.append(f"{src.peer_id}: {exc}")
                    continue
                except PeerFault as exc:
                    self._blacklist(src, str(exc))
                    problems.append(f"{src.peer_id}: {exc}")
                    transient = False
                    continue
                local = await self._accept_manifest(src, data, want, problems)
                if local is not None:
                    return local
                transient = False
            if not problems or not transient or attempt == MANIFEST_ROUNDS:
                break
            log.warning("no source gave the manifest of %r (%s); trying them again in %.0f s (round %d of %d)",
                        self.request.model, "; ".join(problems), attempt * MANIFEST_RETRY_S, attempt + 1,
                        MANIFEST_ROUNDS)
            await trio.sleep(attempt * MANIFEST_RETRY_S)
        raise FetchError(f"no peer served a manifest of {self.request.model!r} matching "
                         f"{want or 'any announced hash'}: " + ("; ".join(problems) or "no source announces it"))

    async def _accept_manifest(self, src: Source, data: bytes, want: str | None, problems: list[str]) -> LocalStore | None:
        """The local store of a manifest `src` served, when it is the one wanted; else None (`src` blacklisted)."""
        sha = hashlib.sha256(data).hexdigest()
        if want is not None and sha != want:
            self._blacklist(src, f"served a manifest with sha256 {sha}, not the trust root {want}")
            problems.append(f"{src.peer_id}: manifest sha256 {sha[:16]}… does not match")
            return None
        try:
            local = LocalStore(self._out_dir(sha), data, sha)
        except (StoreError, ValueError) as exc:  # ValueError: not JSON
            self._blacklist(src, f"served a manifest that is not valid: {exc}")
            problems.append(f"{src.peer_id}: invalid manifest")
            return None
        if local.manifest.model_id != self.request.model:
            self._blacklist(src, f"served the manifest of {local.manifest.model_id!r} for {self.request.model!r}")
            return None
        if want is None:
            log.warning("trusting the manifest %s served by %s (--trust-first-manifest; no peer announces a hash); "
                        "pin it next time with --manifest-sha256 %s", sha, src.peer_id, sha)
        await trio.to_thread.run_sync(local.prepare)
        self.local = local
        self._report.update(model=self.request.model, manifest_sha256=sha, out=str(local.path))
        return local

    def _out_dir(self, sha: str) -> Path:
        return self.request.out or default_fetch_dir(self.request.model, sha, self.request.fetch_root)

    async def _manifest_from(self, src: Source) -> bytes:
        client = await ShardClient.connect(self.node, src.peer_id, src.addrs, timeout_s=self.request.connect_timeout_s,
                                           reply_timeout_s=self.request.reply_timeout_s)
        try:
            return await client.manifest(self.request.model)
        finally:
            await client.close()

    # --- fetching files --------------------------------------------------------------------

    async def fetch(self, relpaths: Sequence[str]) -> dict[str, Any]:
        """Fetch the listed store files (already present and matching ones are kept); returns the report."""
        local = self.local or await self.open()
        manifest = local.manifest
        unknown = [r for r in relpaths if r not in manifest.files]
        if unknown:
            raise FetchError(f"the manifest lists no files {unknown[:5]}")
        t0 = time.perf_counter()
        kept, needed = [], []
        for relpath in sorted(set(relpaths)):
            (kept if await trio.to_thread.run_sync(local.holds, relpath) else needed).append(relpath)
        await trio.to_thread.run_sync(local.record, kept)
        for relpath in kept:
            self._report["files"][relpath] = {"size": manifest.files[relpath]["size"], "kept": True, "from": {}}
        board = self._board = PieceBoard(
            [(r, manifest.files[r]["sha256"], int(manifest.files[r]["size"])) for r in needed], self.request.piece_bytes)
        self._total = sum(int(manifest.files[r]["size"]) for r in needed)
        self._received = 0
        for relpath in needed:
            self._locks[relpath] = trio.Lock()
            self._parts[relpath] = await trio.to_thread.run_sync(local.part, relpath)
        try:
            for relpath in needed:  # empty files are complete before any byte arrives
                await self._verify_if_complete(relpath)
            usable = sorted((s for s in self.sources.values() if s.state == "ok"),
                            key=lambda s: (s.manifest_sha256 != local.manifest_sha, s.peer_id))[: self.request.max_peers]
            if not board.done:
                try:
                    async with trio.open_nursery() as nursery:
                        for src in usable:
                            nursery.start_soon(self._worker, src)
                except* (StoreError, OSError) as group:  # the local disk failed (full, read-only, ...)
                    raise FetchError(f"writing into {local.path} failed: {group.exceptions[0]}") from None
        finally:
            for part in self._parts.values():
                part.discard()
            for part, _segments in self._suspects.values():
                part.discard()
            self._parts.clear()
            self._suspects.clear()
            await trio.to_thread.run_sync(local.cleanup)
        seconds = time.perf_counter() - t0
        self._report.update(
            kept_files=sorted(kept), fetched_files=sorted(needed), bytes_needed=self._total,
            bytes_received=sum(s.bytes for s in self.sources.values()), seconds=round(seconds, 3),
            mb_per_s=round(self._total / 1e6 / seconds, 2) if seconds > 0 else None,
            peers={s.peer_id: {"bytes": s.bytes, "state": s.state, "reason": s.reason, "spans": s.spans}
                   for s in self.sources.values()},
            blacklisted=sorted(s.peer_id for s in self.sources.values() if s.state == "blacklisted"),
            dropped=sorted(s.peer_id for s in self.sources.values() if s.state == "dropped"),
            events=self.events,
        )
        if not board.done:
            left = board.unfinished()
            states = ", ".join(f"{s.peer_id[-8:]} {s.state}{' (' + s.reason + ')' if s.reason else ''}"
                               for s in self.sources.values())
            raise FetchError(f"could not fetch {len(left)} file(s) ({', '.join(left[:4])}): peers: {states or 'none'}")
        return self._report

    def _announces(self, peer: str, relpath: str) -> bool:
        index = _layer_index(relpath)
        return index is not None and self.sources[peer].announces_layer(index)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _progress(self) -> None:
        if self.on_progress is None or self._board is None:
            return
        files = self._board.files.values()
        self.on_progress(FetchProgress(
            received=self._received, total=self._total,
            peers=sum(1 for s in self.sources.values() if s.state == "ok"),
            files_done=sum(1 for f in files if f.done), files_total=len(files)))

    async def _worker(self, src: Source) -> None:
        """Fetch pieces from one peer until nothing is left for it, or it fails."""
        board = self._board
        assert board is not None
        client: ShardClient | None = None
        failures = busy = 0
        try:
            while src.state == "ok" and not board.done:
                piece = board.take(src.peer_id, self._announces)
                if piece is None:
                    if not board.waiting_on_others(src.peer_id):
                        return
                    changed = self._changed
                    with trio.move_on_after(1.0):
                        await changed.wait()
                    continue
                at = [piece.offset]
                try:
                    if client is None:
                        client = await ShardClient.connect(
                            self.node, src.peer_id, src.addrs, timeout_s=self.request.connect_timeout_s,
                            reply_timeout_s=self.request.reply_timeout_s)
                    await self._fetch_piece(client, src, piece, at)
                    failures = busy = 0
                except ShardRefused as exc:
                    if exc.code == BUSY and busy < self.request.busy_retries:
                        busy += 1
                        board.release(src.peer_id, at[0])
                        await trio.sleep(min(0.25 * busy, 2.0))
                        continue
                    if exc.code == NOT_FOUND:
                        board.lacks(src.peer_id, piece.relpath)
                    elif exc.code == BUSY:
                        self._drop(src, f"busy {busy} times in a row")
                    else:  # bad_request / internal: its copy does not fit the manifest, as good as lacking it
                        self._event("refused", src.peer_id, file=piece.relpath, reason=str(exc))
                        board.lacks(src.peer_id, piece.relpath)
                except PeerFault as exc:
                    self._blacklist(src, str(exc))
                except (ConnectionError, trio.TooSlowError, OSError, ValueError) as exc:  # ValueError: unusable addrs
                    if client is not None:
                        await client.abort()
                    client = None
                    failures += 1
                    if failures > 1:
                        self._drop(src, f"{type(exc).__name__}: {exc}")
                    else:
                        self._event("retry", src.peer_id, reason=f"{type(exc).__name__}: {exc}")
                finally:
                    if src.peer_id in board.in_flight:
                        board.release(src.peer_id, at[0])
                    self._notify()
                await self._verify_if_complete(piece.relpath)
                if failures:
                    await trio.sleep(0.5)
        finally:
            if client is not None:
                await client.close()
            if src.peer_id in board.in_flight:
                board.release(src.peer_id, board.in_flight[src.peer_id].offset)
            if src.state == "blacklisted":
                await self._forget_bytes(board.discard_from(src.peer_id))
            elif src.state == "dropped":
                await self._forget_bytes(board.dropped(src.peer_id))
            self._notify()

    async def _fetch_piece(self, client: ShardClient, src: Source, piece: Any, at: list[int]) -> None:
        """Fetch one piece, writing each chunk as it comes; `at[0]` tracks the byte reached."""
        board = self._board
        assert board is not None
        state = board.files[piece.relpath]
        part = self._parts[piece.relpath]
        lock = self._locks[piece.relpath]

        async def on_chunk(chunk: FileChunk) -> None:
            try:
                async with lock:
                    await trio.to_thread.run_sync(part.write, chunk.offset, chunk.data)
            except OSError as exc:  # our disk, not the peer: ends the fetch (an OSError here would read as a link failure)
                raise StoreError(f"cannot write {piece.relpath}: {exc}") from exc
            n = len(chunk.data)
            board.received(src.peer_id, chunk.offset, n)
            at[0] = chunk.end
            src.bytes += n
            self._received += n
            if self.on_chunk is not None:
                self.on_chunk(src.peer_id, piece.relpath, chunk.offset, n)
            self._progress()
            if src.state != "ok":
                raise PeerFault(f"{src.peer_id} left this fetch ({src.state})")

        await client.file_range(state.sha256, piece.offset, piece.length, self.request.chunk_bytes, on_chunk)

    # --- verification and blame -------------------------------------------------------------

    async def _verify_if_complete(self, relpath: str) -> None:
        board, local = self._board, self.local
        assert board is not None and local is not None
        if not board.complete(relpath):
            return
        board.begin_verify(relpath)
        state = board.files[relpath]
        part = self._parts[relpath]
        async with self._locks[relpath]:
            digest = await trio.to_thread.run_sync(part.digest)
        if digest == state.sha256:
            await trio.to_thread.run_sync(local.install, part, relpath)
            self._report["files"][relpath] = {"size": state.size, "kept": False, "from": state.bytes_by_peer()}
            board.finish(relpath)
            if relpath in self._suspects:
                await self._blame(relpath)
            self._progress()
            self._notify()
            return
        senders = sorted(state.senders())
        self._event("hash_mismatch", ",".join(senders), file=relpath, got=digest, want=state.sha256)
        if len(senders) == 1:
            part.discard()
            self._parts[relpath] = await trio.to_thread.run_sync(local.part, relpath)
            board.restart(relpath, single_source=False)
            await self._blacklist_now(self.sources[senders[0]], f"sent {relpath} with sha256 {digest}, not {state.sha256}")
        else:  # keep the bad copy: the next (single-source) copy will show whose bytes were wrong
            old = self._suspects.pop(relpath, None)
            if old is not None:
                old[0].discard()
            suspect = part.path.with_name(part.path.name + ".suspect")
            part.path.rename(suspect)
            part.path = suspect
            self._suspects[relpath] = (part, list(state.segments))
            self._parts[relpath] = await trio.to_thread.run_sync(local.part, relpath)
            board.restart(relpath, single_source=True)
        self._notify()

    async def _blame(self, relpath: str) -> None:
        """Compare a bad copy (several senders) with the verified file: blacklist each sender whose bytes differ."""
        local = self.local
        assert local is not None
        suspect, segments = self._suspects.pop(relpath)
        good = local.path / relpath

        def differing() -> set[str]:
            out = set()
            with open(good, "rb") as fh:
                for peer, start, end in segments:
                    at = start
                    while at < end and peer not in out:
                        n = min(1 << 20, end - at)
                        fh.seek(at)
                        if fh.read(n) != suspect.read(at, n):
                            out.add(peer)
                        at += n
            return out

        try:
            liars = await trio.to_thread.run_sync(differing)
        finally:
            suspect.discard()
        for peer in sorted(liars):
            await self._blacklist_now(self.sources[peer], f"sent wrong bytes of {relpath} (found by comparing with a verified copy)")

    def _blacklist(self, src: Source, reason: str) -> None:
        if src.state == "blacklisted":
            return
        src.state, src.reason = "blacklisted", reason
        self._event("blacklisted", src.peer_id, reason=reason)
        log.warning("blacklisted %s: %s", src.peer_id, reason)
        self._notify()

    async def _blacklist_now(self, src: Source, reason: str) -> None:
        """Blacklist and discard the peer's bytes in unfinished files at once, unless its worker is mid-piece
        (that worker stops at its next chunk and discards them on the way out)."""
        self._blacklist(src, reason)
        board = self._board
        if board is not None and src.peer_id not in board.in_flight:
            await self._forget_bytes(board.discard_from(src.peer_id))

    def _drop(self, src: Source, reason: str) -> None:
        if src.state != "ok":
            return
        src.state, src.reason = "dropped", reason
        self._event("dropped", src.peer_id, reason=reason)

    async def _forget_bytes(self, relpaths: list[str]) -> None:
        """Files whose bytes were discarded must hash from the start again."""
        for relpath in relpaths:
            async with self._locks[relpath]:
                self._parts[relpath].forget_hash()
