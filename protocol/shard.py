"""Messages of content-addressed shard transfer (`/dsd/shard/1`): a store's manifest, and file ranges by sha256.

A fetcher asks a peer for the manifest of a model (`GetManifest`, answered by `ManifestData`
with the manifest.json bytes as stored, whose sha256 the fetcher checks against its trust
root) and for byte ranges of files named by their sha256 only (`GetFile`, answered by
`FileChunk`s of at most `chunk` bytes, each carrying its offset, then a `FileEnd` marker).
A request the peer cannot or will not answer gets an `Error` (codes below), and the stream
stays open for the next request; a malformed frame ends the stream after its `Error`.
No path ever travels on the wire: the serving peer maps a hash to a file through its manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from .checks import check_bytes, check_int, check_str
from .errors import LIMIT, ProtocolError
from .fields import _Field
from .limits import MAX_FILE_BYTES, SHARD_CHUNK_BYTES, Limits
from .messages import Message

# `Error` codes of a shard stream, besides bad_frame / version / limit (malformed requests) and
# bad_request (a range outside the file, or a message that is not a request).
NOT_FOUND = "not_found"  # no such model or file here (unknown hash, or a file this peer does not hold)
BUSY = "busy"  # rate limited or too many streams: retry later, or elsewhere
_SHA256 = re.compile(r"\A[0-9a-f]{64}\Z")


def check_sha256(v: Any, f: str) -> str:
    """A sha256 as 64 lowercase hex characters (nothing else can name a file on this protocol)."""
    if not isinstance(v, str):
        raise ProtocolError(f"must be a str, got {type(v).__name__}", f)
    if _SHA256.match(v) is None:
        raise ProtocolError(f"must be 64 lowercase hex characters (a sha256), got {v[:70]!r}", f)
    return v


def _sha(v: Any, f: str, lim: Limits) -> str:
    return check_sha256(v, f)


def _model(v: Any, f: str, lim: Limits) -> str:
    return check_str(v, f, lim.max_str)


def _offset(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 0, MAX_FILE_BYTES)


def _length(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 1, MAX_FILE_BYTES)


def _chunk(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 1, lim.max_chunk_bytes)


def _bytes_of(v: Any) -> Any:
    return bytes(v) if isinstance(v, bytearray | memoryview) else v


def _manifest_bytes(v: Any, f: str, lim: Limits) -> bytes:
    data = check_bytes(_bytes_of(v), f, lim.max_manifest_bytes)
    if not data:
        raise ProtocolError("must not be empty", f)
    return data


def _chunk_data(v: Any, f: str, lim: Limits) -> bytes:
    data = check_bytes(_bytes_of(v), f, lim.max_chunk_bytes)
    if not data:
        raise ProtocolError("must not be empty", f)
    return data


@dataclass(frozen=True)
class GetManifest(Message):
    """Ask for the manifest.json of `model` as the peer stores it."""

    TYPE: ClassVar[str] = "get_manifest"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("model", _model),)
    model: str


@dataclass(frozen=True)
class ManifestData(Message):
    """Answer to GetManifest: the manifest's exact bytes (the fetcher hashes them: the trust root)."""

    TYPE: ClassVar[str] = "manifest_data"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("model", _model), _Field("data", _manifest_bytes))
    model: str
    data: bytes


@dataclass(frozen=True)
class GetFile(Message):
    """Ask for bytes [offset, offset + length) of the file whose sha256 is `sha256`, in chunks of <= `chunk`."""

    TYPE: ClassVar[str] = "get_file"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("sha256", _sha),
        _Field("offset", _offset),
        _Field("length", _length),
        _Field("chunk", _chunk, optional=True),
    )
    sha256: str
    offset: int
    length: int
    chunk: int = SHARD_CHUNK_BYTES

    def _check_more(self, limits: Limits, prefix: str) -> None:
        if self.offset + self.length > MAX_FILE_BYTES:
            raise ProtocolError(f"range ends past {MAX_FILE_BYTES} bytes", f"{prefix}.length", LIMIT)


@dataclass(frozen=True)
class FileChunk(Message):
    """Bytes of a requested range, starting at `offset` of the file."""

    TYPE: ClassVar[str] = "file_chunk"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("sha256", _sha),
        _Field("offset", _offset),
        _Field("data", _chunk_data),
    )
    sha256: str
    offset: int
    data: bytes

    @property
    def end(self) -> int:
        """Offset just past this chunk."""
        return self.offset + len(self.data)


@dataclass(frozen=True)
class FileEnd(Message):
    """Every chunk of a GetFile was sent: the range ended at `end` (= offset + length)."""

    TYPE: ClassVar[str] = "file_end"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("sha256", _sha), _Field("end", _offset))
    sha256: str
    end: int
