"""Discovery records: who serves which blocks of which model, signed by the serving peer, with expiry.

A record is published under the DHT key of its model (see `record_key`) by the peer
it describes, refreshed every TTL/3 by an `Announcer`, and dropped by readers and
storing nodes once `expires` passes, so a dead peer's records are gone within the TTL.

`throughput` is the tokens per second the peer pushes through its whole announced
span [start, end) (one decode step); per-block compute time is therefore
1 / (throughput * (end - start)) seconds per token.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import msgpack
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID

from dsd.protocol.tensors import CODECS

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

RECORD_DOMAIN = b"dsd-record/1\x00"  # signature domain separation
ROLES = ("block", "federated", "relay")
REACHABILITY = ("public", "private", "unknown")  # unknown: no AutoNAT verdict (or a peer older than the field)
WEIGHT_FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "q4k")  # as `dsd.shard_store.quant` names them
DTYPE_FORMATS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
FLOAT_FORMATS = tuple(DTYPE_FORMATS.values())
MAX_RECORD_BYTES = 8 * 1024
MAX_STR = 256
MAX_ADDRS = 16
DEFAULT_TTL_S = 30.0


class RecordError(ValueError):
    """A record that is malformed, wrongly signed or signed by someone other than its peer id."""


def record_key(model: str) -> bytes:
    """The 32-byte DHT key under which every record of `model` is stored."""
    return hashlib.sha256(b"/dsd/records/1/" + model.encode("utf-8")).digest()


def _check_str(name: str, value: object, *, empty_ok: bool = False) -> None:
    if not isinstance(value, str):
        raise RecordError(f"record field {name} must be a string, got {type(value).__name__}")
    if len(value) > MAX_STR or (not value and not empty_ok):
        raise RecordError(f"record field {name} must have 1..{MAX_STR} characters")


def _check_int(name: str, value: object, lo: int = 0) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise RecordError(f"record field {name} must be an integer >= {lo}, got {value!r}")


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _check_time(name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise RecordError(f"record field {name} must be a finite number, got {value!r}")


@dataclass(frozen=True)
class PeerRecord:
    """One peer's announcement for one model: its span, speed, free KV cache and expiry (unix time)."""

    peer_id: str
    addrs: tuple[str, ...]
    model: str
    start: int
    end: int
    role: str = "block"
    throughput: float = 1.0  # tokens/s through the whole span [start, end)
    version: str = ""
    dtype: str = "float32"
    codec: str = ""  # the wire codec its hidden states leave in ("" unknown: its dtype's exact one; older peers)
    weights: str = ""  # the format its layers' weights are held in ("" unknown: its dtype's float format; older peers)
    cache_tokens_left: int = 0
    expires: float = 0.0
    issued: float = 0.0  # newer issued wins when a peer has several records stored
    vocab_size: int | None = None  # federated workers only
    topk_cap: int | None = None  # federated workers only: largest K it returns
    manifest_sha256: str | None = None  # sha256 of the served store's manifest.json (shard transfer's trust root)
    reachability: str = "unknown"  # public | private (reached through the relays in addrs) | unknown
    # Load over the last seconds (block peers; 0 from peers older than the fields): the share of the time the span
    # computed, mean rows per step, rows served per second, rows waiting when the record was made.
    busy: float = 0.0
    batch_rows: float = 0.0
    rows_per_s: float = 0.0
    queued_rows: int = 0

    def __post_init__(self) -> None:
        _check_str("peer_id", self.peer_id)
        if not isinstance(self.addrs, tuple) or len(self.addrs) > MAX_ADDRS:
            raise RecordError(f"record field addrs must be a tuple of at most {MAX_ADDRS} strings")
        for a in self.addrs:
            _check_str("addrs", a)
        _check_str("model", self.model)
        _check_int("start", self.start)
        _check_int("end", self.end, lo=1)
        if self.end <= self.start:
            raise RecordError(f"record span {self.start}:{self.end} is empty (end must exceed start)")
        if self.role not in ROLES:
            raise RecordError(f"record field role must be one of {ROLES}, got {self.role!r}")
        _check_time("throughput", self.throughput)
        if not self.throughput > 0:
            raise RecordError(f"record field throughput must be > 0, got {self.throughput!r}")
        _check_str("version", self.version, empty_ok=True)
        _check_str("dtype", self.dtype)
        if self.weights not in ("", *WEIGHT_FORMATS):
            raise RecordError(f"record field weights must be one of {WEIGHT_FORMATS} (or empty), got {self.weights!r:.40}")
        if self.codec not in ("", *CODECS):
            raise RecordError(f"record field codec must be one of {CODECS} (or empty), got {self.codec!r:.40}")
        _check_int("cache_tokens_left", self.cache_tokens_left)
        _check_time("expires", self.expires)
        _check_time("issued", self.issued)
        if self.role == "federated":
            _check_int("vocab_size", self.vocab_size, lo=1)
            _check_int("topk_cap", self.topk_cap, lo=1)
        else:
            for name in ("vocab_size", "topk_cap"):
                value = getattr(self, name)
                if value is not None:
                    _check_int(name, value, lo=1)
        if self.reachability not in REACHABILITY:
            raise RecordError(f"record field reachability must be one of {REACHABILITY}, got {self.reachability!r:.40}")
        for name in ("busy", "batch_rows", "rows_per_s"):
            value = getattr(self, name)
            _check_time(name, value)
            if value < 0 or (name == "busy" and value > 1):
                raise RecordError(f"record field {name} must be >= 0{' and <= 1' if name == 'busy' else ''}, "
                                  f"got {value!r}")
        _check_int("queued_rows", self.queued_rows)
        if self.manifest_sha256 is not None and not _is_sha256(self.manifest_sha256):
            raise RecordError(f"record field manifest_sha256 must be 64 lowercase hex characters, got {self.manifest_sha256!r:.80}")

    @property
    def weight_format(self) -> str:
        """The weight format of its layers: as announced, else (an older peer) its dtype's float format."""
        return self.weights or DTYPE_FORMATS.get(self.dtype, "fp32")

    @property
    def num_blocks(self) -> int:
        return self.end - self.start

    @property
    def wait_s(self) -> float:
        """Seconds a window arriving now is expected to wait for the work in progress: with the span busy a share
        `busy` of the time, a mean step of busy · batch_rows / rows_per_s seconds (half of it left on arrival, and
        the step it joins about as much longer)."""
        if self.rows_per_s <= 0:
            return 0.0
        return self.busy * (self.busy * self.batch_rows / self.rows_per_s)

    def live(self, now: float | None = None) -> bool:
        """True while the record has not expired (a withdrawn record has expires <= issued)."""
        now = time.time() if now is None else now
        return self.expires > now and self.expires > self.issued

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["addrs"] = list(self.addrs)
        if d["manifest_sha256"] is None:  # a record without it reads the same to peers that predate the field
            del d["manifest_sha256"]
        if d["reachability"] == "unknown":
            del d["reachability"]
        for name in ("codec", "weights"):
            if not d[name]:
                del d[name]
        for name in ("busy", "batch_rows", "rows_per_s", "queued_rows"):
            if not d[name]:  # an idle peer's record reads the same to peers that predate the load fields
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PeerRecord:
        """Build from a decoded dict; unknown keys (from newer versions) are ignored."""
        if not isinstance(d, dict):
            raise RecordError("record body must be a map")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if not isinstance(known.get("addrs"), (list, tuple)):
            raise RecordError("record field addrs must be a list of strings")
        known["addrs"] = tuple(known["addrs"])
        for name in ("throughput", "expires", "issued", "busy", "batch_rows", "rows_per_s"):
            if isinstance(known.get(name), int) and not isinstance(known.get(name), bool):
                known[name] = float(known[name])
        try:
            return cls(**known)
        except TypeError as exc:
            raise RecordError(f"record is missing fields: {exc}") from None


def sign_record(record: PeerRecord, key_pair: KeyPair) -> bytes:
    """Serialize and sign `record` with the key of the peer it names (the peer ids must match)."""
    signer = ID.from_pubkey(key_pair.public_key).to_base58()
    if signer != record.peer_id:
        raise RecordError(f"record names peer {record.peer_id} but the key belongs to {signer}")
    body = msgpack.packb(record.to_dict(), use_bin_type=True)
    sig = key_pair.private_key.sign(RECORD_DOMAIN + body)
    return msgpack.packb({"body": body, "pk": key_pair.public_key.serialize(), "sig": sig}, use_bin_type=True)


def verify_record(blob: bytes) -> PeerRecord:
    """Decode a signed record; RecordError unless the signature holds and the key matches the peer id."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) > MAX_RECORD_BYTES:
        raise RecordError(f"signed record must be bytes of at most {MAX_RECORD_BYTES}")
    try:
        outer = msgpack.unpackb(blob, raw=False, max_bin_len=MAX_RECORD_BYTES, max_str_len=MAX_RECORD_BYTES,
                                max_array_len=64, max_map_len=64)
    except Exception as exc:
        raise RecordError(f"signed record is not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(outer, dict) or not all(isinstance(outer.get(k), bytes) for k in ("body", "pk", "sig")):
        raise RecordError("signed record must be a map with bytes fields body, pk, sig")
    try:
        public_key = deserialize_public_key(outer["pk"])
        ok = public_key.verify(RECORD_DOMAIN + outer["body"], outer["sig"])
    except Exception as exc:
        raise RecordError(f"signed record has an unusable public key ({type(exc).__name__})") from None
    if not ok:
        raise RecordError("record signature does not verify")
    try:
        body = msgpack.unpackb(outer["body"], raw=False, max_array_len=MAX_ADDRS + 4, max_map_len=64)
    except Exception as exc:
        raise RecordError(f"record body is not valid msgpack ({type(exc).__name__})") from None
    record = PeerRecord.from_dict(body)
    signer = ID.from_pubkey(public_key).to_base58()
    if signer != record.peer_id:
        raise RecordError(f"record names peer {record.peer_id} but is signed by {signer}")
    return record


def newest_live(records: Iterable[PeerRecord], now: float | None = None) -> list[PeerRecord]:
    """Keep each peer's most recently issued record (per model and role), then drop expired ones."""
    now = time.time() if now is None else now
    best: dict[tuple[str, str, str], PeerRecord] = {}
    for rec in records:
        k = (rec.peer_id, rec.model, rec.role)
        if k not in best or rec.issued > best[k].issued:
            best[k] = rec
    return sorted((r for r in best.values() if r.live(now)), key=lambda r: (r.start, r.end, r.peer_id))
