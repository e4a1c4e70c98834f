"""Field kinds of the wire messages: each validates (and normalises) a Python value against the limits, and says how
its msgpack form decodes and encodes (`messages` builds its message types from them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .checks import (
    check_bytes,
    check_float,
    check_ident,
    check_int,
    check_opt_int,
    check_seq,
    check_str,
)
from .errors import BAD_REQUEST, ProtocolError
from .limits import MAX_POSITION, MAX_U63, MAX_U64, Limits
from .tensors import WireTensor
from .tree_rules import check_keep, check_parents

# A field kind: validate (and normalise) a Python value; `decode` turns the msgpack form into one.
Check = Callable[[Any, str, Limits], Any]


@dataclass(frozen=True)
class _Field:
    name: str
    check: Check
    decode: Check | None = None
    encode: Callable[[Any], Any] | None = None
    optional: bool = False  # may be missing on the wire (has a default)
    omit_default: bool = False  # left off the wire while it has its default (a field added to an old message)


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


def _flag(v: Any, f: str, lim: Limits) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(f"must be true or false, got {type(v).__name__}", f, BAD_REQUEST)
    return v


def _load(v: Any, f: str, lim: Limits) -> float:
    """A route's load so far: each hop adds its share in [0, 1] (docs/batching.md)."""
    return float(check_float(v, f, 0.0, float(lim.max_route)))


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
