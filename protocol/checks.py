"""Small validators shared by messages and tensors; each raises ProtocolError naming the field."""

from __future__ import annotations

import math
import re

from .errors import LIMIT, ProtocolError

_IDENT_RE = re.compile(r"\A[A-Za-z0-9_.:/+-]{1,64}\Z")


def check_int(value: object, field: str, lo: int, hi: int) -> int:
    """An int (never a bool) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"must be an int, got {type(value).__name__}", field)
    if not lo <= value <= hi:
        code = LIMIT if value > hi else "bad_frame"
        raise ProtocolError(f"must be in [{lo}, {hi}], got {value}", field, code)
    return value


def check_opt_int(value: object, field: str, lo: int, hi: int) -> int | None:
    """None or an int in [lo, hi]."""
    return None if value is None else check_int(value, field, lo, hi)


def check_float(value: object, field: str, lo: float, hi: float) -> float:
    """A finite float (ints accepted) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"must be a number, got {type(value).__name__}", field)
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ProtocolError(f"must be finite and in [{lo}, {hi}], got {value!r}", field)
    return value


def check_str(value: object, field: str, max_len: int, *, empty: bool = False) -> str:
    """A str of at most `max_len` characters (non-empty unless `empty`)."""
    if not isinstance(value, str):
        raise ProtocolError(f"must be a str, got {type(value).__name__}", field)
    if len(value) > max_len:
        raise ProtocolError(f"longer than {max_len} characters ({len(value)})", field, LIMIT)
    if not value and not empty:
        raise ProtocolError("must not be empty", field)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ProtocolError("is not valid UTF-8 (lone surrogate)", field) from None
    return value


def check_ident(value: object, field: str) -> str:
    """A short identifier (codes, roles, capabilities, dtype and codec names): 1-64 of [A-Za-z0-9_.:/+-]."""
    if not isinstance(value, str):
        raise ProtocolError(f"must be a str, got {type(value).__name__}", field)
    if _IDENT_RE.match(value) is None:
        raise ProtocolError(f"must be 1-64 characters of [A-Za-z0-9_.:/+-], got {value[:70]!r}", field)
    return value


def check_bytes(value: object, field: str, max_len: int) -> bytes:
    """Bytes of at most `max_len`."""
    if not isinstance(value, bytes):
        raise ProtocolError(f"must be bytes, got {type(value).__name__}", field)
    if len(value) > max_len:
        raise ProtocolError(f"longer than {max_len} bytes ({len(value)})", field, LIMIT)
    return value


def check_seq(value: object, field: str, max_len: int, *, empty: bool = True) -> tuple[object, ...]:
    """A tuple (a list is accepted and converted) of at most `max_len` items."""
    if not isinstance(value, tuple | list):
        raise ProtocolError(f"must be a sequence, got {type(value).__name__}", field)
    if len(value) > max_len:
        raise ProtocolError(f"more than {max_len} items ({len(value)})", field, LIMIT)
    if not value and not empty:
        raise ProtocolError("must not be empty", field)
    return tuple(value)


def check_map(value: object, field: str) -> dict[str, object]:
    """A msgpack map (decoded as a dict)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"must be a map, got {type(value).__name__}", field)
    return value
