"""Which files a fetch needs, and which peer fetches which piece of them: pure bookkeeping, no IO.

`files_for` names the store files of a layer span and of the head. A `PieceBoard` splits those
files into pieces and hands them to peer workers: a worker keeps to the file it is on, then takes
a file nobody works on (preferring files its peer announces), then helps with a file others are
on, so big files are fetched by several peers at once near the end. A piece a peer drops is
given back from the byte where it stopped, so nothing received is fetched twice. The board also
remembers which peer sent which bytes, so a file that fails its hash can be pinned on its sender.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from dsd.shard_store import Manifest
from dsd.shard_store.manifest import EMBED_FILE, HEAD_FILE, layer_file


def span_files(manifest: Manifest, start: int, end: int) -> list[str]:
    """Store files of decoder layers [start, end)."""
    if not 0 <= start < end <= manifest.num_layers:
        raise ValueError(f"blocks {start}:{end} are not inside the model's layers 0:{manifest.num_layers}")
    return [layer_file(i) for i in range(start, end)]


def head_files(manifest: Manifest) -> list[str]:
    """Store files the head reads (`Store.load_head` and `load_tokenizer`): embeddings, norm + lm_head, tokenizer."""
    return [EMBED_FILE, HEAD_FILE, *manifest.tokenizer_files]


def files_for(manifest: Manifest, blocks: tuple[int, int] | None, head: bool) -> list[str]:
    """The files of a span (None: no layers) plus the head's files when `head`, each once, sorted."""
    wanted = set(span_files(manifest, *blocks)) if blocks is not None else set()
    if head:
        wanted.update(head_files(manifest))
    return sorted(wanted)


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + length) of one file."""

    relpath: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass
class FileState:
    """One file of the fetch: its pieces still to fetch, who sent which bytes, and whether it is done."""

    relpath: str
    sha256: str
    size: int
    pending: list[Piece] = field(default_factory=list)
    received: int = 0
    segments: list[tuple[str, int, int]] = field(default_factory=list)  # (peer, start, end) of bytes written
    lacking: set[str] = field(default_factory=set)  # peers that do not hold the file
    single_source: bool = False  # after a mismatch with several senders: next copy from one peer only
    verifying: bool = False
    done: bool = False

    def senders(self) -> set[str]:
        return {peer for peer, _, _ in self.segments}

    def bytes_by_peer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for peer, start, end in self.segments:
            out[peer] = out.get(peer, 0) + end - start
        return out


class PieceBoard:
    """Hands out pieces of the files to fetch, one piece per peer at a time; all methods are synchronous."""

    def __init__(self, files: list[tuple[str, str, int]], piece_bytes: int) -> None:
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes}")
        self.piece_bytes = piece_bytes
        self.files: dict[str, FileState] = {}
        for relpath, sha, size in files:
            state = FileState(relpath, sha, size)
            self.files[relpath] = state
            self._queue(state, 0, size)
        self.in_flight: dict[str, Piece] = {}  # peer -> the piece it works on
        self._last: dict[str, str] = {}  # peer -> the file it worked on last

    # --- handing out ---------------------------------------------------------

    def _queue(self, state: FileState, start: int, end: int) -> None:
        """Add pieces covering [start, end) of a file, keeping its pending list in offset order."""
        at = start
        while at < end:
            n = min(self.piece_bytes, end - at)
            state.pending.append(Piece(state.relpath, at, n))
            at += n
        state.pending.sort(key=lambda p: p.offset)

    def _open_to(self, state: FileState, peer: str) -> bool:
        """May `peer` take a piece of this file now?"""
        if state.done or state.verifying or not state.pending or peer in state.lacking:
            return False
        if state.single_source:  # one sender per copy: only the peer already on it (or anyone, if nobody is)
            return state.senders() <= {peer} and self._workers(state) <= {peer}
        return True

    def _workers(self, state: FileState) -> set[str]:
        return {peer for peer, piece in self.in_flight.items() if piece.relpath == state.relpath}

    def take(self, peer: str, announces: Callable[[str, str], bool] = lambda peer, relpath: True) -> Piece | None:
        """The next piece for `peer` (None: nothing it can do now); `announces(peer, relpath)` prefers its own files."""
        if peer in self.in_flight:
            raise RuntimeError(f"{peer} already works on {self.in_flight[peer]}")
        open_files = [s for s in self.files.values() if self._open_to(s, peer)]
        if not open_files:
            return None
        last = self.files.get(self._last.get(peer, ""))
        untouched = [s for s in open_files if not self._workers(s)]
        own = [s for s in untouched if announces(peer, s.relpath)]
        if last is not None and last in open_files:
            state = last
        elif own or untouched:
            state = (own or untouched)[0]
        else:  # help with a file others are on: take its last pending piece, away from their frontier
            state = max(open_files, key=lambda s: sum(p.length for p in s.pending))
            piece = state.pending.pop()
            return self._start(peer, piece)
        return self._start(peer, state.pending.pop(0))

    def _start(self, peer: str, piece: Piece) -> Piece:
        self.in_flight[peer] = piece
        self._last[peer] = piece.relpath
        return piece

    # --- progress --------------------------------------------------------------

    def received(self, peer: str, offset: int, n: int) -> None:
        """`peer` wrote n bytes at `offset` of its piece's file."""
        piece = self.in_flight[peer]
        if not (piece.offset <= offset and offset + n <= piece.end):
            raise ValueError(f"bytes [{offset}, {offset + n}) are outside {piece}")
        state = self.files[piece.relpath]
        segs = state.segments
        if segs and segs[-1][0] == peer and segs[-1][2] == offset:
            segs[-1] = (peer, segs[-1][1], offset + n)
        else:
            segs.append((peer, offset, offset + n))
        state.received += n

    def release(self, peer: str, upto: int) -> None:
        """`peer` stops its piece having written up to byte `upto`; the rest goes back to the board."""
        piece = self.in_flight.pop(peer)
        state = self.files[piece.relpath]
        if upto < piece.end:
            self._queue(state, max(upto, piece.offset), piece.end)

    def lacks(self, peer: str, relpath: str) -> None:
        """`peer` does not hold this file."""
        self.files[relpath].lacking.add(peer)

    def complete(self, relpath: str) -> bool:
        """Every byte of the file was written and no piece of it is in flight: time to verify it."""
        state = self.files[relpath]
        return not state.done and not state.verifying and state.received == state.size and not self._workers(state)

    def begin_verify(self, relpath: str) -> None:
        """The file is being hashed: no pieces of it are handed out meanwhile."""
        self.files[relpath].verifying = True

    def finish(self, relpath: str) -> None:
        """The file verified and was installed."""
        state = self.files[relpath]
        state.verifying, state.done = False, True

    def restart(self, relpath: str, *, single_source: bool) -> None:
        """Discard every byte of the file (it failed its hash) and queue all of it again."""
        state = self.files[relpath]
        state.verifying = False
        state.pending.clear()
        state.segments.clear()
        state.received = 0
        state.single_source = state.single_source or single_source
        self._queue(state, 0, state.size)

    def discard_from(self, peer: str) -> list[str]:
        """Forget the bytes `peer` wrote into unfinished files (it was blacklisted, or it dropped out of a
        single-source copy) and queue those ranges again; returns the files touched."""
        touched = []
        for state in self.files.values():
            if state.done or state.verifying or peer not in state.senders():
                continue
            if state.single_source:
                self.restart(state.relpath, single_source=True)
            else:
                for who, start, end in [s for s in state.segments if s[0] == peer]:
                    state.segments.remove((who, start, end))
                    state.received -= end - start
                    self._queue(state, start, end)
            touched.append(state.relpath)
        return touched

    def dropped(self, peer: str) -> list[str]:
        """`peer` left: single-source copies it was writing start over (one sender per copy); returns those files."""
        touched = []
        for state in self.files.values():
            if state.single_source and not state.done and not state.verifying and peer in state.senders():
                self.restart(state.relpath, single_source=True)
                touched.append(state.relpath)
        return touched

    # --- state -------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return all(s.done for s in self.files.values())

    def unfinished(self) -> list[str]:
        return [s.relpath for s in self.files.values() if not s.done]

    def waiting_on_others(self, peer: str) -> bool:
        """True while work `peer` might still get exists: pieces in flight or files being verified."""
        for state in self.files.values():
            if state.done or peer in state.lacking:
                continue
            if state.verifying or self._workers(state) or self._open_to(state, peer):
                return True
        return False
