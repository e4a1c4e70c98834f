"""The DHT's record storage: every node keeps signed records for the keys it is close to, until they expire.

py-libp2p's KadDHT stores one value per key and answers `get_value`/`find_providers`
from a local cache first (so a reader can see a stale or partial set), and its
provider records live 48 h. Discovery needs many records per key (one per peer)
that vanish within seconds of their TTL, so, like hivemind's DHT (Petals), we store
(key, peer) -> signed record with expiry on the k nodes closest to the key, found by
py-libp2p's Kademlia lookup, over our own small protocol `/dsd/records/1`.

Wire: 4-byte big-endian length + msgpack map. Requests: {"op": "put", "key", "records"}
or {"op": "get", "key"}; replies: {"stored": n} or {"records": [...]}, or {"error": str}.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import msgpack

from .records import MAX_RECORD_BYTES, PeerRecord, RecordError, verify_record

KEY_BYTES = 32
MAX_RECORDS_PER_KEY = 1024
MAX_KEYS = 4096
MAX_RECORDS_PER_PUT = 16
MAX_MESSAGE_BYTES = 64 + MAX_RECORDS_PER_KEY * (MAX_RECORD_BYTES + 16)
# Storing nodes refuse records claiming to live longer than this (limits replay of old records).
MAX_TTL_S = 3600.0
# Allowed clock skew between a publisher and a storing node.
CLOCK_SKEW_S = 60.0


class RecordStoreError(ValueError):
    """A malformed record-store request or reply; the message names what was wrong."""


def pack_message(obj: dict[str, Any]) -> bytes:
    """One length-prefixed msgpack frame."""
    body = msgpack.packb(obj, use_bin_type=True)
    if len(body) > MAX_MESSAGE_BYTES:
        raise RecordStoreError(f"record-store message of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return struct.pack(">I", len(body)) + body


def frame_length(header: bytes) -> int:
    """Body length from a 4-byte header, refused before any allocation when too large."""
    (n,) = struct.unpack(">I", header)
    if n > MAX_MESSAGE_BYTES:
        raise RecordStoreError(f"record-store frame claims {n} bytes, more than {MAX_MESSAGE_BYTES}")
    return n


def unpack_message(body: bytes) -> dict[str, Any]:
    """Decode a frame body into a map; RecordStoreError on anything else."""
    try:
        obj = msgpack.unpackb(body, raw=False, max_bin_len=MAX_RECORD_BYTES + 64, max_str_len=1024,
                              max_array_len=MAX_RECORDS_PER_KEY, max_map_len=16)
    except Exception as exc:
        raise RecordStoreError(f"record-store frame is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(obj, dict):
        raise RecordStoreError("record-store frame must be a map")
    return obj


def check_key(key: object) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise RecordStoreError(f"record-store key must be {KEY_BYTES} bytes")
    return key


def check_blobs(blobs: object, limit: int) -> list[bytes]:
    if not isinstance(blobs, list) or len(blobs) > limit:
        raise RecordStoreError(f"records must be a list of at most {limit} entries")
    if not all(isinstance(b, bytes) for b in blobs):
        raise RecordStoreError("records must be byte strings")
    return blobs


class RecordStore:
    """Local (key, peer id) -> newest signed record, dropped once expired; bounded in keys and records."""

    def __init__(self, key_for_model: Any = None, allow_signers: set[str] | None = None) -> None:
        self._data: dict[bytes, dict[str, tuple[PeerRecord, bytes]]] = {}
        self._key_for_model = key_for_model
        self._allow = allow_signers  # private swarm: only records signed by these peers are kept

    def put(self, key: bytes, blob: bytes, now: float | None = None) -> bool:
        """Store one signed record if it verifies, belongs under `key` and is newer; returns whether kept."""
        now = time.time() if now is None else now
        try:
            rec = verify_record(blob)
        except RecordError:
            return False
        if self._key_for_model is not None and self._key_for_model(rec.model) != key:
            return False
        if self._allow is not None and rec.peer_id not in self._allow:
            return False
        if rec.expires > now + MAX_TTL_S + CLOCK_SKEW_S or rec.issued > now + CLOCK_SKEW_S:
            return False
        self.expire(now)
        slot = self._data.get(key)
        if slot is None:
            if len(self._data) >= MAX_KEYS:
                return False
            slot = self._data[key] = {}
        old = slot.get(rec.peer_id)
        if old is not None and old[0].issued >= rec.issued:
            return old[1] == blob
        if not rec.live(now):  # a withdrawal: forget the peer's record, keep nothing
            slot.pop(rec.peer_id, None)
            if not slot:
                del self._data[key]
            return True
        if old is None and len(slot) >= MAX_RECORDS_PER_KEY:
            return False
        slot[rec.peer_id] = (rec, blob)
        return True

    def get(self, key: bytes, now: float | None = None) -> list[bytes]:
        """The live signed records under `key`."""
        self.expire(now)
        return [blob for _rec, blob in self._data.get(key, {}).values()]

    def expire(self, now: float | None = None) -> int:
        """Drop expired records; returns how many went."""
        now = time.time() if now is None else now
        gone = 0
        for key in list(self._data):
            slot = self._data[key]
            for pid in [p for p, (rec, _b) in slot.items() if not rec.live(now)]:
                del slot[pid]
                gone += 1
            if not slot:
                del self._data[key]
        return gone

    def __len__(self) -> int:
        return sum(len(s) for s in self._data.values())
