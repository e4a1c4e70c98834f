"""Typed, immutable protocol messages, validated when built and when decoded from a msgpack map.

Every message travels as a map with `v` (protocol version), `type` and its fields.
Unknown keys (a newer minor version) are ignored; another major version is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import numpy as np

from .checks import (
    check_bytes,
    check_float,
    check_ident,
    check_int,
    check_map,
    check_opt_int,
    check_seq,
    check_str,
)
from .errors import BAD_REQUEST, BAD_TENSOR, LIMIT, ProtocolError
from .limits import (
    DEFAULT_LIMITS,
    MAX_POSITION,
    MAX_U63,
    MAX_U64,
    PROTOCOL_VERSION,
    Limits,
    check_version,
    parse_version,
)
from .tensors import WireTensor, decode_tensor, encode_tensor
from .topk import ID_CODECS, decode_ids, encode_ids, is_dense, sort_by_prob
from .trees import check_keep, check_parents

# Codes used in `Error` replies; peers may send others (newer versions), so they are not enforced.
ERROR_CODES = (
    "bad_frame",
    "version",
    "limit",
    "bad_tensor",
    "unknown_session",
    "bad_request",
    "busy",
    "internal",
    "forbidden",
    "unreachable",  # the next hop of a route could not be reached
    "idle",  # a session closed after its idle timeout
    "shutting_down",  # the peer is leaving; fail over
)

# A field kind: validate (and normalise) a Python value; `decode` turns the msgpack form into one.
Check = Callable[[Any, str, Limits], Any]


@dataclass(frozen=True)
class _Field:
    name: str
    check: Check
    decode: Check | None = None
    encode: Callable[[Any], Any] | None = None
    optional: bool = False  # may be missing on the wire (has a default)


def _session(v: Any, f: str, lim: Limits) -> str:
    return check_str(v, f, lim.max_str)


def _name(v: Any, f: str, lim: Limits) -> str:
    return check_str(v, f, lim.max_str)


def _text(v: Any, f: str, lim: Limits) -> str:
    return check_str(v, f, lim.max_str, empty=True)


def _opt_session(v: Any, f: str, lim: Limits) -> str | None:
    return None if v is None else check_str(v, f, lim.max_str)


def _pos(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 0, MAX_POSITION)


def _opt_pos(v: Any, f: str, lim: Limits) -> int | None:
    return check_opt_int(v, f, 0, MAX_POSITION)


def _epoch(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 0, MAX_U63)


def _nonce(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 0, MAX_U64)


def _payload(v: Any, f: str, lim: Limits) -> bytes:
    if isinstance(v, bytearray | memoryview):
        v = bytes(v)
    return check_bytes(v, f, lim.max_payload)


def _idents(v: Any, f: str, lim: Limits) -> tuple[str, ...]:
    items = check_seq(v, f, lim.max_list)
    return tuple(check_ident(x, f"{f}[{i}]") for i, x in enumerate(items))


def _strs(v: Any, f: str, lim: Limits) -> tuple[str, ...]:
    items = check_seq(v, f, lim.max_list)
    return tuple(check_str(x, f"{f}[{i}]", lim.max_str) for i, x in enumerate(items))


def _tokens(v: Any, f: str, lim: Limits) -> tuple[int, ...]:
    items = check_seq(v, f, lim.max_tokens_per_window, empty=False)
    return tuple(check_int(x, f"{f}[{i}]", 0, MAX_POSITION) for i, x in enumerate(items))


def _opt_parents(v: Any, f: str, lim: Limits) -> tuple[int, ...] | None:
    return None if v is None else check_parents(v, lim.max_tree_nodes, f)


def _opt_keep(v: Any, f: str, lim: Limits) -> tuple[int, ...] | None:
    return None if v is None else check_keep(v, lim.max_tree_nodes, f)


def _opt_seq_encode(v: tuple[Any, ...] | None) -> list[Any] | None:
    return None if v is None else list(v)


def _tree_fields() -> tuple[_Field, ...]:
    """`parents` (this window as a token tree; None = a chain) and `keep` (the accepted path of the last one)."""
    return (
        _Field("parents", _opt_parents, encode=_opt_seq_encode, optional=True),
        _Field("keep", _opt_keep, encode=_opt_seq_encode, optional=True),
    )


def _check_tree(parents: tuple[int, ...] | None, keep: tuple[int, ...] | None, commit: int | None,
                nodes: int, what: str, prefix: str) -> None:
    """A tree has one parent per window node; `keep` needs `commit` (the start of the window it keeps from)."""
    if parents is not None and len(parents) != nodes:
        raise ProtocolError(f"{len(parents)} parents for a window of {nodes} {what}", f"{prefix}.parents", BAD_REQUEST)
    if keep is not None and commit is None:
        raise ProtocolError("keep needs commit: the start of the window it keeps nodes of", f"{prefix}.keep", BAD_REQUEST)


def _tensor(v: Any, f: str, lim: Limits) -> WireTensor:
    if not isinstance(v, WireTensor):
        raise ProtocolError(f"must be a WireTensor, got {type(v).__name__}", f)
    v.validate(lim, f)
    return v


def _tensor_decode(v: Any, f: str, lim: Limits) -> WireTensor:
    return WireTensor.from_wire(v, lim, f)


def _tensor_encode(v: WireTensor) -> dict[str, Any]:
    return v.to_wire()


def _build(cls: type, values: dict[str, Any], limits: Limits, field: str) -> Any:
    """Make a frozen value without its default-limit check, then validate it against `limits`."""
    obj = object.__new__(cls)
    for key, value in values.items():
        object.__setattr__(obj, key, value)
    obj.validate(limits, field)
    return obj


@dataclass(frozen=True)
class Hop:
    """One hop of a source route: a peer, its addresses and its layer span [start, end); the head has 0, 0."""

    peer_id: str
    addrs: tuple[str, ...]
    start: int
    end: int

    def __post_init__(self) -> None:
        self.validate(DEFAULT_LIMITS)

    def validate(self, limits: Limits, field: str = "hop") -> None:
        """Check every field against `limits`."""
        object.__setattr__(self, "peer_id", check_str(self.peer_id, f"{field}.peer_id", limits.max_str))
        object.__setattr__(self, "addrs", _strs(self.addrs, f"{field}.addrs", limits))
        check_int(self.start, f"{field}.start", 0, MAX_POSITION)
        check_int(self.end, f"{field}.end", 0, MAX_POSITION)
        if self.start > self.end:
            raise ProtocolError(f"start {self.start} > end {self.end}", f"{field}.start")

    @property
    def is_head(self) -> bool:
        """True for the head's hop (it serves no layers)."""
        return self.start == self.end == 0

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map of this hop."""
        return {"peer_id": self.peer_id, "addrs": list(self.addrs), "start": self.start, "end": self.end}

    @classmethod
    def from_wire(cls, raw: object, limits: Limits, field: str = "hop") -> Hop:
        """Build from a decoded msgpack map, validating against `limits`."""
        m = check_map(raw, field)
        values = {}
        for key in ("peer_id", "addrs", "start", "end"):
            if key not in m:
                raise ProtocolError("missing", f"{field}.{key}")
            values[key] = m[key]
        return _build(cls, values, limits, field)


def _route(v: Any, f: str, lim: Limits) -> tuple[Hop, ...]:
    hops = check_seq(v, f, lim.max_route)
    for i, hop in enumerate(hops):
        if not isinstance(hop, Hop):
            raise ProtocolError(f"must be a Hop, got {type(hop).__name__}", f"{f}[{i}]")
        hop.validate(lim, f"{f}[{i}]")
    return hops


def _route_decode(v: Any, f: str, lim: Limits) -> tuple[Hop, ...]:
    hops = check_seq(v, f, lim.max_route)
    return tuple(Hop.from_wire(h, lim, f"{f}[{i}]") for i, h in enumerate(hops))


def _route_encode(v: tuple[Hop, ...]) -> list[dict[str, Any]]:
    return [h.to_wire() for h in v]


def _seq_encode(v: tuple[Any, ...]) -> list[Any]:
    return list(v)


_REGISTRY: dict[str, type[Message]] = {}


@dataclass(frozen=True)
class Message:
    """Base of all protocol messages: validation, the msgpack map form and decoding by `type`."""

    TYPE: ClassVar[str] = ""
    FIELDS: ClassVar[tuple[_Field, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            _REGISTRY[cls.TYPE] = cls

    def __post_init__(self) -> None:
        self.validate(DEFAULT_LIMITS)

    def validate(self, limits: Limits, field: str | None = None) -> None:
        """Check (and normalise lists to tuples) every field against `limits`; raises ProtocolError."""
        prefix = field or type(self).__name__
        for f in self.FIELDS:
            object.__setattr__(self, f.name, f.check(getattr(self, f.name), f"{prefix}.{f.name}", limits))
        self._check_more(limits, prefix)

    def _check_more(self, limits: Limits, prefix: str) -> None:
        """Cross-field checks of a message type."""

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map: `v`, `type` and every field."""
        out: dict[str, Any] = {"v": PROTOCOL_VERSION, "type": self.TYPE}
        for f in self.FIELDS:
            value = getattr(self, f.name)
            out[f.name] = f.encode(value) if f.encode is not None else value
        return out

    @classmethod
    def from_wire(cls, body: object, limits: Limits = DEFAULT_LIMITS) -> Message:
        """Decode a msgpack map into the message its `type` names, validating every field."""
        m = check_map(body, "frame")
        if "v" not in m:
            raise ProtocolError("missing", "v")
        check_version(m["v"])
        if "type" not in m:
            raise ProtocolError("missing", "type")
        name = check_ident(m["type"], "type")
        target = _REGISTRY.get(name)
        if target is None or (cls is not Message and target is not cls):
            raise ProtocolError(f"unknown message type {name!r}", "type", BAD_REQUEST)
        values: dict[str, Any] = {}
        for f in target.FIELDS:
            label = f"{target.__name__}.{f.name}"
            if f.name not in m:
                if not f.optional:
                    raise ProtocolError("missing", label)
                values[f.name] = target.__dataclass_fields__[f.name].default
                continue
            values[f.name] = f.decode(m[f.name], label, limits) if f.decode is not None else m[f.name]
        return _build(target, values, limits, target.__name__)


def _tensor_field(name: str) -> _Field:
    return _Field(name, _tensor, decode=_tensor_decode, encode=_tensor_encode)


def _seq_field(name: str, check: Check, optional: bool = False) -> _Field:
    return _Field(name, check, encode=_seq_encode, optional=optional)


def _version(v: Any, f: str, lim: Limits) -> str:
    parse_version(v, f)
    return v


@dataclass(frozen=True)
class Hello(Message):
    """First message on a connection: protocol version, roles, model id and capabilities."""

    TYPE: ClassVar[str] = "hello"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("version", _version),
        _seq_field("roles", _idents),
        _Field("model", _text),
        _seq_field("capabilities", _idents, optional=True),
    )
    version: str
    roles: tuple[str, ...]
    model: str
    capabilities: tuple[str, ...] = ()


@dataclass(frozen=True)
class OpenSession(Message):
    """Open a session on a span [start, end) of `model`; `route` = the hops after the receiver, ending at the head."""

    TYPE: ClassVar[str] = "open_session"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("model", _name),
        _Field("start", _pos),
        _Field("end", _pos),
        _Field("max_len", _pos),
        _Field("route", _route, decode=_route_decode, encode=_route_encode),
    )
    session: str
    model: str
    start: int
    end: int
    max_len: int
    route: tuple[Hop, ...]

    def _check_more(self, limits: Limits, prefix: str) -> None:
        if self.start > self.end:
            raise ProtocolError(f"start {self.start} > end {self.end}", f"{prefix}.start")
        if self.max_len < 1:
            raise ProtocolError("must be at least 1", f"{prefix}.max_len")


@dataclass(frozen=True)
class Forward(Message):
    """Hidden states of a window at start.. going down the route; `commit` (if set) truncates the KV first.

    `parents` makes the window a token tree (node i at start + depth(i)); `keep` lists the accepted
    nodes of the previous window, root first: the peers keep those rows after `commit` instead of
    truncating to it, so then start = commit + len(keep).
    """

    TYPE: ClassVar[str] = "forward"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _Field("commit", _opt_pos),
        _tensor_field("hidden"),
        *_tree_fields(),
    )
    session: str
    epoch: int
    start: int
    commit: int | None
    hidden: WireTensor
    parents: tuple[int, ...] | None = None
    keep: tuple[int, ...] | None = None

    def _check_more(self, limits: Limits, prefix: str) -> None:
        shape = self.hidden.shape
        if self.parents is not None and not (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)):
            raise ProtocolError(
                f"a tree window needs hidden [tokens, hidden], got {list(shape)}", f"{prefix}.parents", BAD_REQUEST
            )
        _check_tree(self.parents, self.keep, self.commit, shape[-2] if len(shape) >= 2 else 0, "hidden rows", prefix)


@dataclass(frozen=True)
class Result(Message):
    """The last span's output hidden states for the window at `start`, sent back to the head."""

    TYPE: ClassVar[str] = "result"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _tensor_field("hidden"),
    )
    session: str
    epoch: int
    start: int
    hidden: WireTensor


@dataclass(frozen=True)
class Truncate(Message):
    """Drop KV entries at positions >= length on every peer of the session."""

    TYPE: ClassVar[str] = "truncate"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("session", _session), _Field("length", _pos))
    session: str
    length: int


@dataclass(frozen=True)
class CloseSession(Message):
    """End a session and free its KV cache."""

    TYPE: ClassVar[str] = "close_session"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("session", _session),)
    session: str


@dataclass(frozen=True)
class Ack(Message):
    """Reply to OpenSession / Truncate / CloseSession: the session's KV length now."""

    TYPE: ClassVar[str] = "ack"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("session", _session), _Field("length", _pos))
    session: str
    length: int


def _code(v: Any, f: str, lim: Limits) -> str:
    return check_ident(v, f)


def _opt_peer(v: Any, f: str, lim: Limits) -> str | None:
    return None if v is None else check_str(v, f, lim.max_str)


@dataclass(frozen=True)
class Error(Message):
    """A refusal or failure: `code` (see ERROR_CODES), a human message and the peer to `blame` (if known).

    `blame` is the peer id at fault as the reporter sees it (itself, its next hop, its upstream);
    heads act on it instead of parsing the message. Too long a message is cut at build time.
    """

    TYPE: ClassVar[str] = "error"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("code", _code),
        _Field("message", _text),
        _Field("session", _opt_session, optional=True),
        _Field("blame", _opt_peer, optional=True),
    )
    code: str
    message: str
    session: str | None = None
    blame: str | None = None

    def __post_init__(self) -> None:
        cap = DEFAULT_LIMITS.max_str
        if isinstance(self.message, str) and len(self.message) > cap:
            object.__setattr__(self, "message", self.message[: cap - 3] + "...")
        super().__post_init__()


@dataclass(frozen=True)
class Ping(Message):
    """Liveness / RTT probe; `payload` lets a prober measure bandwidth too."""

    TYPE: ClassVar[str] = "ping"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("nonce", _nonce), _Field("payload", _payload, optional=True))
    nonce: int
    payload: bytes = b""


@dataclass(frozen=True)
class Pong(Message):
    """Answer to a Ping, echoing its nonce (and payload if asked)."""

    TYPE: ClassVar[str] = "pong"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("nonce", _nonce), _Field("payload", _payload, optional=True))
    nonce: int
    payload: bytes = b""


def _temperature(v: Any, f: str, lim: Limits) -> float:
    return float(check_float(v, f, 0.0, 1e4))


def _top_p(v: Any, f: str, lim: Limits) -> float:
    value = float(check_float(v, f, 0.0, 1.0))
    if value <= 0.0:
        raise ProtocolError(f"must be in (0, 1], got {value}", f)
    return value


def _top_k(v: Any, f: str, lim: Limits) -> int:
    return check_int(v, f, 1, lim.max_topk)


def _opt_rows(v: Any, f: str, lim: Limits) -> int | None:
    return check_opt_int(v, f, 1, lim.max_tokens_per_window)


@dataclass(frozen=True)
class DraftWindow(Message):
    """Federated mode: the server's drafted tokens at positions start..; workers answer with a TopKResult."""

    TYPE: ClassVar[str] = "draft_window"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _Field("commit", _opt_pos),
        _seq_field("tokens", _tokens),
        _Field("top_k", _top_k),
        _Field("temperature", _temperature),
        _Field("top_p", _top_p, optional=True),
        _Field("rows", _opt_rows, optional=True),
        *_tree_fields(),
    )
    session: str
    epoch: int
    start: int
    commit: int | None
    tokens: tuple[int, ...]
    top_k: int
    temperature: float
    top_p: float = 1.0
    rows: int | None = None  # answer only the last `rows` positions (a prefill needs one); None = all
    parents: tuple[int, ...] | None = None  # a token tree, as in Forward; rows then count nodes
    keep: tuple[int, ...] | None = None  # the accepted path of the previous window, as in Forward

    def _check_more(self, limits: Limits, prefix: str) -> None:
        if self.rows is not None and self.rows > len(self.tokens):
            raise ProtocolError(f"asks for {self.rows} rows of a {len(self.tokens)}-token window", f"{prefix}.rows")
        _check_tree(self.parents, self.keep, self.commit, len(self.tokens), "tokens", prefix)


def _id_codec(v: Any, f: str, lim: Limits) -> str:
    if v not in ID_CODECS:
        raise ProtocolError(f"must be one of {ID_CODECS}, got {v!r}", f)
    return v


def _ids_blob(v: Any, f: str, lim: Limits) -> bytes:
    if isinstance(v, bytearray | memoryview):
        v = bytes(v)
    return check_bytes(v, f, lim.max_frame_bytes)


PROB_CODECS = {"fp32": "raw", "fp16": "fp16", "bf16": "bf16"}


@dataclass(frozen=True)
class TopKResult(Message):
    """Federated mode: per position the K most likely token ids and their probabilities.

    `ids` is the packed id blob (see `topk.encode_ids`: ascending per position), `probs`
    a float tensor [positions, k] aligned with it. Build with `TopKResult.build`, read with `.arrays()`.
    """

    TYPE: ClassVar[str] = "topk_result"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _Field("k", _top_k),
        _Field("ids", _ids_blob),
        _tensor_field("probs"),
        _Field("id_codec", _id_codec, optional=True),
    )
    session: str
    epoch: int
    start: int
    k: int
    ids: bytes
    probs: WireTensor
    id_codec: str = "varint"

    def _check_more(self, limits: Limits, prefix: str) -> None:
        shape = self.probs.shape
        if len(shape) != 2 or shape[1] != self.k:
            raise ProtocolError(f"must have shape [positions, k={self.k}], got {list(shape)}", f"{prefix}.probs")
        if self.probs.dtype not in ("float16", "float32", "float64"):
            raise ProtocolError(f"must be a float tensor, got {self.probs.dtype}", f"{prefix}.probs.dtype")
        if not 1 <= shape[0] <= limits.max_tokens_per_window:
            raise ProtocolError(
                f"{shape[0]} positions (allowed 1..{limits.max_tokens_per_window})", f"{prefix}.probs", LIMIT
            )
        if self.id_codec == "dense":  # nothing to unpack; don't materialise n x k ids just to check
            if self.ids:
                raise ProtocolError(f"dense ids carry no bytes, got {len(self.ids)}", f"{prefix}.ids")
        else:
            decode_ids(self.ids, shape[0], self.k, self.id_codec, f"{prefix}.ids")

    @property
    def positions(self) -> int:
        """Number of positions (rows) this result covers."""
        return self.probs.shape[0]

    @classmethod
    def build(
        cls,
        session: str,
        epoch: int,
        start: int,
        ids: np.ndarray,
        probs: np.ndarray,
        *,
        id_codec: str = "auto",
        prob_codec: str = "fp16",
        zstd: bool = False,
    ) -> Self:
        """Pack top-K `ids` [n, k] and `probs` [n, k] (any order per row).

        id_codec 'varint', 'uint32', 'dense' or 'auto' (dense when the ids are all of 0..k-1, else
        varint); prob_codec 'fp16', 'bf16' or 'fp32'; `zstd` compresses the probabilities.
        """
        ids = np.asarray(ids)
        probs = np.asarray(probs)
        if ids.ndim != 2 or probs.shape != ids.shape:
            raise ProtocolError(f"ids {ids.shape} and probs {probs.shape} must both be [positions, k]", "ids")
        if not isinstance(prob_codec, str) or prob_codec not in PROB_CODECS:
            raise ProtocolError(f"must be one of {tuple(PROB_CODECS)}, got {prob_codec!r}", "prob_codec")
        order = np.argsort(ids, axis=1, kind="stable")
        sorted_ids = np.take_along_axis(ids, order, axis=1)
        sorted_p = np.take_along_axis(probs, order, axis=1).astype(np.float32)
        if id_codec == "auto":
            id_codec = "dense" if is_dense(sorted_ids) else "varint"
        wire_p = encode_tensor(sorted_p, PROB_CODECS[prob_codec], zstd)
        return cls(session, epoch, start, int(ids.shape[1]), encode_ids(sorted_ids, id_codec), wire_p, id_codec)

    def arrays(self, limits: Limits = DEFAULT_LIMITS) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [n, k], probs float32 [n, k]) sorted by probability desc; probs must lie in [0, 1]."""
        n = self.positions
        ids = decode_ids(self.ids, n, self.k, self.id_codec, "TopKResult.ids")
        p = decode_tensor(self.probs, limits).astype(np.float32)
        if np.any(p < 0) or np.any(p > 1):
            raise ProtocolError("probabilities must be in [0, 1]", "TopKResult.probs", BAD_TENSOR)
        return sort_by_prob(ids, p)


MESSAGE_TYPES: dict[str, type[Message]] = _REGISTRY
