"""Framing: 4-byte big-endian length + msgpack body, and an incremental sans-IO decoder.

`FrameDecoder.feed` takes bytes in any chunking and returns the complete messages.
A header claiming more than `max_frame_bytes` is refused as soon as its 4 bytes
arrive; msgpack itself is run with hard length caps, so nothing oversized is allocated.
"""

from __future__ import annotations

import struct

import msgpack

from .errors import BAD_FRAME, LIMIT, ProtocolError
from .limits import DEFAULT_LIMITS, Limits
from .messages import Message

HEADER = struct.Struct(">I")
MAX_MAP_KEYS = 64  # no message or nested value has more fields than this


def encode(msg: Message, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One frame for `msg`, re-validated against `limits`; too large a frame is a ProtocolError."""
    if not isinstance(msg, Message):
        raise ProtocolError(f"must be a Message, got {type(msg).__name__}", "message")
    msg.validate(limits)
    body = msgpack.packb(msg.to_wire(), use_bin_type=True)
    if len(body) > limits.max_frame_bytes:
        raise ProtocolError(f"{len(body)} bytes exceed max_frame_bytes {limits.max_frame_bytes}", "frame", LIMIT)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes | bytearray, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode one frame body (without its header) into a validated message."""
    max_array = max(limits.max_route, limits.max_tokens_per_window, limits.max_rank, limits.max_list)
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=4 * limits.max_str,
            max_bin_len=limits.max_frame_bytes,
            max_array_len=max_array,
            max_map_len=MAX_MAP_KEYS,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, ExtraData, UnicodeDecodeError, ...
        raise ProtocolError(f"not a valid msgpack body ({type(exc).__name__}: {str(exc)[:120]})", "frame") from None
    return Message.from_wire(obj, limits)


class FrameDecoder:
    """Incremental decoder: `feed(bytes) -> list[Message]`; after a ProtocolError the stream is unusable."""

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self._buf = bytearray()
        self._broken: ProtocolError | None = None

    @property
    def pending(self) -> bytes:
        """Bytes received but not yet returned as a message (a partial frame, header included)."""
        return bytes(self._buf)

    def feed(self, data: bytes) -> list[Message]:
        """Buffer `data` and return every message it completes (possibly none)."""
        if self._broken is not None:
            raise ProtocolError(f"stream already failed: {self._broken}", self._broken.field, self._broken.code)
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ProtocolError(f"must be bytes, got {type(data).__name__}", "data")
        self._buf += data
        out: list[Message] = []
        try:
            while len(self._buf) >= HEADER.size:
                (size,) = HEADER.unpack_from(self._buf)
                if size > self.limits.max_frame_bytes:
                    raise ProtocolError(
                        f"header claims {size} bytes, more than max_frame_bytes {self.limits.max_frame_bytes}",
                        "frame_length",
                        LIMIT,
                    )
                if size == 0:
                    raise ProtocolError("empty frame", "frame_length", BAD_FRAME)
                end = HEADER.size + size
                if len(self._buf) < end:
                    break
                body = self._buf[HEADER.size : end]
                del self._buf[:end]
                out.append(decode_body(body, self.limits))
        except ProtocolError as exc:
            self._broken = exc
            self._buf.clear()
            raise
        return out
