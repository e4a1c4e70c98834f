"""Return legs: the streams that the last peers of this head's routes open back to it."""

from __future__ import annotations

import logging

import trio

from dsd.discovery.framing import FramedStream
from dsd.protocol import (
    Ack,
    Error,
    Message,
    ProtocolError,
)

from .errors import RouteError

log = logging.getLogger(__name__)


class ReturnLegs:
    """Streams that the last peers of this head's routes open back to it, matched by session id."""

    def __init__(self) -> None:
        self._inboxes: dict[str, trio.MemorySendChannel[Message | BaseException]] = {}
        self._streams: dict[str, FramedStream] = {}  # session id -> its return leg (for its byte counts)

    def expect(self, session: str) -> trio.MemoryReceiveChannel[Message | BaseException]:
        send, recv = trio.open_memory_channel[Message | BaseException](64)
        self._inboxes[session] = send
        return recv

    def forget(self, session: str) -> None:
        self._inboxes.pop(session, None)
        self._streams.pop(session, None)

    def inbox(self, session: str) -> trio.MemorySendChannel[Message | BaseException] | None:
        return self._inboxes.get(session)

    def stream(self, session: str) -> FramedStream | None:
        """The return leg of `session`, once its last peer has opened it (until the session is forgotten)."""
        return self._streams.get(session)

    async def serve(self, stream: FramedStream, remote: str, first: Ack) -> None:
        """Pump one return leg into its session's inbox until EOF."""
        inbox = self._inboxes.get(first.session)
        if inbox is None:
            await stream.send(Error("unknown_session", f"this head has no session {first.session!r}", first.session))
            await stream.close()
            return
        self._streams[first.session] = stream
        try:
            await inbox.send(first)
            while True:
                msg = await stream.receive()
                await inbox.send(msg)
        except (EOFError, ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            # After a normal close nobody reads the inbox any more; otherwise the route is broken.
            with trio.move_on_after(1):
                try:
                    await inbox.send(RouteError(f"return leg from {remote} ended: {exc!r}", peer=remote))
                except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                    pass
        finally:
            with trio.move_on_after(2):
                await stream.close()
