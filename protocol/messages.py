"""Typed, immutable protocol messages, validated when built and when decoded from a msgpack map.

Every message travels as a map with `v` (protocol version), `type` and its fields.
Unknown keys (a newer minor version) are ignored; another major version is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .checks import (
    check_ident,
    check_int,
    check_map,
    check_seq,
    check_str,
)
from .errors import BAD_REQUEST, ProtocolError
from .fields import (
    Check,
    _build,
    _check_tree,
    _epoch,
    _Field,
    _flag,
    _idents,
    _load,
    _name,
    _nonce,
    _opt_pos,
    _opt_session,
    _payload,
    _pos,
    _session,
    _strs,
    _tensor,
    _tensor_decode,
    _tensor_encode,
    _text,
    _tree_fields,
)
from .limits import (
    DEFAULT_LIMITS,
    MAX_POSITION,
    PROTOCOL_VERSION,
    Limits,
    check_version,
    parse_version,
)
from .tensors import WireTensor

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
    "draining",  # the peer is leaving the swarm (refusing new sessions, or ending them): fail over, no blame
    "shutting_down",  # the same, from peers before "draining"
    "not_found",  # shard transfer: no such model or file on this peer
)

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
            if f.omit_default and value == self.__dataclass_fields__[f.name].default:
                continue
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
    truncating to it, so then start = commit + len(keep). `ahead` marks a window the head sent on a bet,
    before the result it follows (no head is blocked on it yet: a busy peer runs blocked windows first).
    `load`: the load of the hops it has passed so far, each adding its own (what one more row of this session
    costs the other sessions there, in their tokens); the last hop's `Result` carries the route's sum.
    """

    TYPE: ClassVar[str] = "forward"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _Field("commit", _opt_pos),
        _tensor_field("hidden"),
        *_tree_fields(),
        _Field("ahead", _flag, optional=True, omit_default=True),
        _Field("load", _load, optional=True, omit_default=True),
    )
    session: str
    epoch: int
    start: int
    commit: int | None
    hidden: WireTensor
    parents: tuple[int, ...] | None = None
    keep: tuple[int, ...] | None = None
    ahead: bool = False
    load: float = 0.0

    def _check_more(self, limits: Limits, prefix: str) -> None:
        shape = self.hidden.shape
        if self.parents is not None and not (len(shape) == 2 or (len(shape) == 3 and shape[0] == 1)):
            raise ProtocolError(
                f"a tree window needs hidden [tokens, hidden], got {list(shape)}", f"{prefix}.parents", BAD_REQUEST
            )
        _check_tree(self.parents, self.keep, self.commit, shape[-2] if len(shape) >= 2 else 0, "hidden rows", prefix)


@dataclass(frozen=True)
class Result(Message):
    """The last span's output hidden states for the window at `start`, sent back to the head; `load`: the route's
    (see `Forward`)."""

    TYPE: ClassVar[str] = "result"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session),
        _Field("epoch", _epoch),
        _Field("start", _pos),
        _tensor_field("hidden"),
        _Field("load", _load, optional=True, omit_default=True),
    )
    session: str
    epoch: int
    start: int
    hidden: WireTensor
    load: float = 0.0


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
    """Reply to OpenSession / Truncate / CloseSession: the session's KV length now.

    An OpenSession's Ack also says how each leg from the answering peer on travels (`links`: direct,
    relayed or hole-punched, the last one the leg back to the head), so the head can report its whole ring."""

    TYPE: ClassVar[str] = "ack"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session), _Field("length", _pos),
        _Field("links", _idents, encode=_seq_encode, optional=True, omit_default=True),
    )
    session: str
    length: int
    links: tuple[str, ...] = ()


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
class Move(Message):
    """The sender of a running session's leg moves it to a new stream (a direct link appeared where it was relayed):
    nothing more of `session` comes on this stream; the receiver reads on from the stream that `Attach`es it."""

    TYPE: ClassVar[str] = "move"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("session", _session),)
    session: str


@dataclass(frozen=True)
class Attach(Message):
    """First message of a stream that takes over a running session's leg after a `Move` on the old one: the leg into
    the receiver's span at `start`, or (`start` None) the return leg into the head. Only the peer that sent on the
    old stream may attach; the session's caches and position are kept: nothing is replayed."""

    TYPE: ClassVar[str] = "attach"
    FIELDS: ClassVar[tuple[_Field, ...]] = (_Field("session", _session), _Field("start", _opt_pos, optional=True))
    session: str
    start: int | None = None


@dataclass(frozen=True)
class Moved(Message):
    """Sent back toward the head by a peer that moved its leg to the next hop: that leg (the one out of `peer`)
    travels as `link` now (direct, hole-punched, with +quic), so the head's report shows the ring as it is."""

    TYPE: ClassVar[str] = "moved"
    FIELDS: ClassVar[tuple[_Field, ...]] = (
        _Field("session", _session), _Field("peer", _session), _Field("link", _code),
    )
    session: str
    peer: str
    link: str


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


MESSAGE_TYPES: dict[str, type[Message]] = _REGISTRY
