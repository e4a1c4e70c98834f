"""Typed messages over a byte stream: `dsd.protocol` frames on top of a libp2p (or shaped) stream.

The protocol layer is sans-IO; this is the thin IO shell around it. A receive that
hits a clean end of stream raises `EOFError`; bad bytes raise `ProtocolError`; a
reset or a broken transport raises `LinkError`. Deadlines belong to the caller
(`trio.fail_after`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Protocol

import trio

from dsd.protocol import FrameDecoder, Limits, Message, encode

log = logging.getLogger(__name__)

# How much one `read` asks the transport for; frames larger than this arrive in pieces.
READ_CHUNK = 64 * 1024


class ByteStream(Protocol):
    """What FramedStream needs from a transport stream (libp2p NetStream, ShapedStream, test pipes)."""

    async def read(self, n: int | None = None) -> bytes: ...
    async def write(self, data: bytes) -> Any: ...
    async def close(self) -> Any: ...
    async def reset(self) -> Any: ...


class LinkError(ConnectionError):
    """The stream under a FramedStream was reset or failed (not a clean end, not bad bytes)."""


def _is_eof(exc: BaseException) -> bool:
    return isinstance(exc, EOFError)


class FramedStream:
    """Sends and receives whole `dsd.protocol` messages on one stream; counts the bytes both ways."""

    def __init__(self, stream: ByteStream, limits: Limits | None = None, remote: str | None = None) -> None:
        self.stream = stream
        self.limits = limits or Limits()
        self.remote = remote
        self._decoder = FrameDecoder(self.limits)
        self._ready: deque[Message] = deque()
        self._send_lock = trio.Lock()
        self._recv_lock = trio.Lock()
        self._closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages_sent = 0
        self.messages_received = 0

    async def send(self, msg: Message) -> int:
        """Encode and write one message; returns the bytes written (frame header included)."""
        data = encode(msg, self.limits)
        async with self._send_lock:
            try:
                await self.stream.write(data)
            except trio.Cancelled:
                raise
            except Exception as exc:
                raise LinkError(f"write to {self.remote or 'peer'} failed: {exc!r}") from exc
        self.bytes_sent += len(data)
        self.messages_sent += 1
        return len(data)

    async def receive(self) -> Message:
        """The next message; EOFError on a clean end, ProtocolError on bad bytes, LinkError on reset."""
        async with self._recv_lock:
            while not self._ready:
                try:
                    chunk = await self.stream.read(READ_CHUNK)
                except trio.Cancelled:
                    raise
                except Exception as exc:
                    if _is_eof(exc):
                        chunk = b""
                    else:
                        raise LinkError(f"read from {self.remote or 'peer'} failed: {exc!r}") from exc
                if not chunk:
                    pending = len(self._decoder.pending)
                    if pending:
                        raise EOFError(f"stream ended inside a frame ({pending} bytes of it received)")
                    raise EOFError("stream ended")
                self.bytes_received += len(chunk)
                self._ready.extend(self._decoder.feed(chunk))
            self.messages_received += 1
            return self._ready.popleft()

    async def close(self) -> None:
        """Close our side (after queued writes are delivered); errors of an already-dead stream are ignored."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stream.close()
        except trio.Cancelled:
            raise
        except Exception:
            pass

    aclose = close

    async def reset(self) -> None:
        """Abort the stream both ways."""
        self._closed = True
        try:
            await self.stream.reset()
        except trio.Cancelled:
            raise
        except Exception:
            pass

    async def __aenter__(self) -> FramedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def send_quietly(stream: FramedStream, msg: Message, timeout_s: float = 5.0) -> None:
    """Best-effort send (the peer may already be gone): never raises, never waits past the timeout."""
    with trio.move_on_after(timeout_s):
        try:
            await stream.send(msg)
        except Exception as exc:
            log.debug("could not send %s: %r", type(msg).__name__, exc)


async def close_quietly(stream: FramedStream, timeout_s: float = 5.0) -> None:
    """Best-effort close: never raises, never waits past the timeout."""
    with trio.move_on_after(timeout_s):
        await stream.close()
