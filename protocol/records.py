"""Messages of the record store (`/dsd/records/1`): put and get the signed discovery records under a DHT key.

A node asks one of the nodes closest to a key to keep records (`RecordsPut`, answered by
`RecordsStored`) or for the live records it holds (`RecordsGet`, answered by `RecordsFound`);
a request it cannot read is answered by an `Error`. Records are opaque signed blobs here
(`dsd.discovery.records` verifies them). Frames are the usual 4-byte length + msgpack map,
decoded under `RECORDS_LIMITS`: large enough for the fullest reply, refused beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .checks import check_bytes, check_int, check_seq
from .errors import ProtocolError
from .fields import Check, _Field
from .limits import Limits
from .messages import Message

KEY_BYTES = 32  # a sha256 of the model name (`dsd.discovery.records.record_key`)
MAX_RECORD_BYTES = 8 * 1024  # one signed record; `dsd.discovery.records` refuses larger ones too
MAX_RECORDS_PER_PUT = 16
MAX_RECORDS_PER_KEY = 1024
RECORDS_FRAME_BYTES = 256 + MAX_RECORDS_PER_KEY * (MAX_RECORD_BYTES + 16)
# The decoder of a records stream: frames up to the fullest RecordsFound, arrays up to its length.
RECORDS_LIMITS = Limits(max_frame_bytes=RECORDS_FRAME_BYTES, max_list=MAX_RECORDS_PER_KEY)


def _blob(v: Any, f: str, max_len: int) -> bytes:
    if isinstance(v, bytearray | memoryview):
        v = bytes(v)
    return check_bytes(v, f, max_len)


def _key(v: Any, f: str, lim: Limits) -> bytes:
    key = _blob(v, f, KEY_BYTES)
    if len(key) != KEY_BYTES:
        raise ProtocolError(f"must be {KEY_BYTES} bytes, got {len(key)}", f)
    return key


def _records(max_count: int) -> Check:
    """A field check for a list of at most `max_count` signed records."""

    def check(v: Any, f: str, lim: Limits) -> tuple[bytes, ...]:
        items = check_seq(v, f, max_count)
        return tuple(_blob(x, f"{f}[{i}]", MAX_RECORD_BYTES) for i, x in enumerate(items))

    return check


def _stored(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 0, MAX_RECORDS_PER_PUT)


@dataclass(frozen=True)
class RecordsPut(Message):
    """Keep these signed records under `key`; the storing node keeps those that verify and belong there."""

    TYPE: ClassVar[str] = "records_put"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("key", _key),
        _Field("records", _records(MAX_RECORDS_PER_PUT), encode=list),
    )
    key: bytes
    records: tuple[bytes, ...]


@dataclass(frozen=True)
class RecordsGet(Message):
    """Ask for the live records held under `key`."""

    TYPE: ClassVar[str] = "records_get"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("key", _key),)
    key: bytes


@dataclass(frozen=True)
class RecordsStored(Message):
    """Answer to RecordsPut: how many of its records the node kept."""

    TYPE: ClassVar[str] = "records_stored"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("stored", _stored),)
    stored: int


@dataclass(frozen=True)
class RecordsFound(Message):
    """Answer to RecordsGet: the live signed records under the key (unverified: the reader checks them)."""

    TYPE: ClassVar[str] = "records_found"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("records", _records(MAX_RECORDS_PER_KEY), encode=list),)
    records: tuple[bytes, ...]
