"""The DHT's record storage: every node keeps signed records for the keys it is close to, until they expire.

py-libp2p's KadDHT stores one value per key and answers `get_value`/`find_providers`
from a local cache first (so a reader can see a stale or partial set), and its
provider records live 48 h. Discovery needs many records per key (one per peer)
that vanish within seconds of their TTL, so, like hivemind's DHT (Petals), we store
(key, peer) -> signed record with expiry on the k nodes closest to the key, found by
py-libp2p's Kademlia lookup, over our own small protocol `/dsd/records/1`.

Wire: the typed messages of `dsd.protocol.records` (RecordsPut / RecordsGet, answered by
RecordsStored / RecordsFound or an Error), framed like every other dsd protocol.
`RecordStore.answer` is the sans-IO reply; `serve_records` and `ask_records` carry one
request and its reply over a stream.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from dsd.protocol import (
    RECORDS_LIMITS,
    Error,
    Message,
    ProtocolError,
    RecordsFound,
    RecordsGet,
    RecordsPut,
    RecordsStored,
)
from dsd.protocol.errors import BAD_REQUEST
from dsd.protocol.records import MAX_RECORDS_PER_KEY

from .framing import ByteStream, FramedStream
from .records import PeerRecord, RecordError, verify_record

MAX_KEYS = 4096
# Storing nodes refuse records claiming to live longer than this (limits replay of old records).
MAX_TTL_S = 3600.0
# Allowed clock skew between a publisher and a storing node.
CLOCK_SKEW_S = 60.0


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

    def answer(self, request: Message, now: float | None = None) -> Message:
        """The reply to one record-store request: how many records a put kept, or the live ones a get asks for."""
        if isinstance(request, RecordsPut):
            return RecordsStored(sum(self.put(request.key, blob, now) for blob in request.records))
        if isinstance(request, RecordsGet):
            return RecordsFound(tuple(self.get(request.key, now)))
        return Error(BAD_REQUEST, f"the record store answers records_put and records_get, not {request.TYPE}")

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


async def serve_records(store: RecordStore, raw: ByteStream, remote: str, timeout_s: float) -> None:
    """Answer the one request of an incoming `/dsd/records/1` stream; a request that cannot be read gets an Error."""
    stream = FramedStream(raw, RECORDS_LIMITS, remote=remote)
    try:
        with trio.fail_after(timeout_s):
            request = await stream.receive()
    except (EOFError, trio.TooSlowError):
        return
    except ProtocolError as exc:
        reply: Message = Error(exc.code, str(exc))
    else:
        reply = store.answer(request)
    with trio.move_on_after(timeout_s):
        await stream.send(reply)


async def ask_records(raw: ByteStream, remote: str, request: Message) -> Message:
    """Send one request on a fresh `/dsd/records/1` stream, return the reply and close the stream."""
    async with FramedStream(raw, RECORDS_LIMITS, remote=remote) as stream:
        await stream.send(request)
        return await stream.receive()
